"""Interleaving when v p does not divide the layers: chunks of unequal size, trained like one process.

Llama 3 405B's 126 layers on 16 stages cannot be cut into equal chunks; ``split_stages`` then gives
the first n_layer mod v p chunks one layer more (``labkit.shapes.layer_split``, the estimator's
rule). A 6-layer GPT on 2 stages with v = 2 (chunks of 2, 2, 1, 1 layers) trained by a plain loop
over ``parallelize_gpt`` ends where one process ends, judged in float64 against the parameters'
move (see tests/test_parallelize.py for the bound)."""

import pytest
import torch

from labkit.dist import launch
from labkit.model import GPTConfig
from labkit.estimate import training_memory
from labkit.parallel.config import RunConfig
from labkit.shapes import ModelShape
from parallel_workers import parallelize_rank

pytestmark = pytest.mark.xdist_group("dist:pipeline_uneven")

CFG = GPTConfig(n_layer=6, d_model=32, n_head=4, vocab_size=64, seq_len=8)
CASES = [((1, 1, 2), dict(schedule="interleaved", v=2, num_microbatches=2)),
         ((1, 1, 2), dict(schedule="interleaved", v=3, num_microbatches=4))]  # v p = 6: equal, for contrast
RTOL = 1e-9


@pytest.fixture(scope="module")
def runs():
    return launch(parallelize_rank, 2, cases=CASES, cfg=CFG, backend="gloo", timeout_s=120, join_timeout_s=600)


@pytest.mark.parametrize("i", range(len(CASES)), ids=["v2-uneven", "v3-even"])
def test_uneven_interleaved_chunks_train_like_one_process(runs, i):
    for r in runs:
        for name, got in r[i]["got"].items():
            move = (r[i]["want"][name] - r[i]["start"][name]).abs().max()
            assert move > 0 and (got - r[i]["want"][name]).abs().max() <= RTOL * move, name
    assert {n for r in runs for n in r[i]["got"]} >= {f"blocks.{k}.attn.c_attn.weight" for k in range(6)}
    losses = torch.tensor([r[i]["losses"] for r in runs if r[i]["losses"][0] is not None], dtype=torch.float64)
    torch.testing.assert_close(losses.mean(0), torch.tensor(runs[0]["ref_losses"], dtype=torch.float64),
                               rtol=RTOL, atol=0)


def test_the_estimator_counts_the_uneven_chunks_each_rank_holds():
    shape = ModelShape.from_config(CFG)
    assert [shape.stage_ranges(2, r, v=2) for r in (0, 1)] == [[(0, 2), (4, 5)], [(2, 4), (5, 6)]]
    run = RunConfig(pp_size=2, v=2, num_microbatches=2, seq_len=8, attention="eager", precision="fp32")
    est = [training_memory(shape, run, stage=r) for r in (0, 1)]
    even = [training_memory(shape.replace(n_layer=8), run, stage=r) for r in (0, 1)]
    # 3 of 6 layers a rank, against 4 of 8: the states and the kept activations shrink with the layers
    assert all(e.params < f.params and e.activations < f.activations for e, f in zip(est, even))
