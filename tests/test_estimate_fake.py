"""The estimator at real scale with nothing allocated: one rank of Llama-2-7B (tp 2, with and
without sequence parallelism; tp 2 x pp 2) and of Llama-2-70B (tp 8), traced under
``FakeTensorMode`` with torch's fake process group and measured by PyTorch's own memory tracker
(``torch.distributed._tools.mem_tracker.MemTracker``), the way torchtitan estimates memory without GPUs.

Every tensor is fake: shapes and dtypes flow through labkit's tensor-parallel model, the
collectives return at once, no byte is allocated. Two of labkit's checks read values (that the
ranks see the same batch, that each target id and each rank's vocabulary start are valid) and
cannot run on fake tensors; they are switched off here, and the vocabulary-parallel loss keeps
its max all-reduce. The model is built on the meta device, sharded, then given fake storage.

The test runs 4 layers of Llama-2-7B and of Llama-2-70B (full width, 4,096 tokens) to stay
short; ``python tests/test_estimate_fake.py llama-2-7b 32 2 2`` measures all 32 of 7B's
(scripts/bench_estimate.py --fake-layers 32 prints the table).
Each case runs in a process of its own (forked from one that imported torch and labkit,
tests/warm_kernels.py), so the fake process group touches no other test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from warm_kernels import python_command

ROOT = Path(__file__).resolve().parents[1]
SEQ = 4096


def measure(name: str, n_layer: int, tp: int, pp: int, sp: int = 0, seq_len: int = SEQ) -> dict:
    """One rank (tensor rank 0, pipeline stage 0) of preset ``name`` with ``n_layer`` layers: bytes the
    tracker counts after one micro-batch's forward (activations) and after backward and an AdamW
    step (model states), and the micro-batches stage 0 holds at once under 1F1B."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import labkit.tensor_parallel.layers as tp_layers
    from labkit.model import build_model, get_preset
    from labkit.pipeline import build_chunks, peak_in_flight, schedule_1f1b, split_stages
    from labkit.tensor_parallel import apply_tensor_parallel

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    tp_layers._check_targets = lambda *args, **kwargs: None  # reads the target ids' values

    def max_only(logits, group, vocab_start):  # the max all-reduce, without its value check
        m = logits.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        return m

    tp_layers._max_and_check_start = max_only
    cfg = get_preset(name, n_layer=n_layer)
    model = build_model(cfg, device="meta", dtype=torch.bfloat16)
    if tp > 1:
        apply_tensor_parallel(model, None, bool(sp), init_sync=None)
        model._tp_batch_checked = True  # the one-time same-batch check compares values
    part = model if pp == 1 else build_chunks(model, split_stages(model, pp), pp, 0)[0]

    def tracked(mt):
        return {str(k).rsplit(".", 1)[-1]: v for k, v in next(iter(mt.get_tracker_snapshot().values())).items()}

    with FakeTensorMode(allow_non_fake_inputs=True):
        part.to_empty(device="cpu")
        opt = torch.optim.AdamW(part.parameters(), lr=1e-4, foreach=False)
        idx = torch.randint(cfg.vocab_size, (1, seq_len))
        mt = MemTracker()
        mt.track_external(part, opt)
        with mt:
            out = part(idx, idx) if pp == 1 else part(idx)
            after_forward = tracked(mt)
            out.backward() if pp == 1 else out.backward(torch.ones_like(out))
            del out
            opt.step()
            after_step = tracked(mt)
    in_flight = 1 if pp == 1 else peak_in_flight(schedule_1f1b(pp, 2 * pp)[0])
    return {"activations": after_forward["ACT"] * in_flight, "params": after_step["PARAM"],
            "grads": after_step["GRAD"], "optimizer": after_step["OPT"],
            "n_tensors": len(list(part.parameters()))}


def _run(name: str, n_layer: int, tp: int, pp: int, sp: bool) -> dict:
    env = dict(os.environ)  # the worker's own: its torch server's (labkit is installed, tests/ is the script's)
    # forked from a process that imported torch and labkit (tests/warm_kernels.py): fresh otherwise
    out = subprocess.run([*python_command("torch", env), __file__, name, str(n_layer), str(tp), str(pp),
                          str(int(sp))], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# Llama-2-70B at t = 8 leaves each rank one of its 8 key-value heads (grouped-query attention).
CASES = [("llama-2-7b", 2, 1, False), ("llama-2-7b", 2, 1, True), ("llama-2-7b", 2, 2, False),
         ("llama-2-70b", 8, 1, False)]


@pytest.mark.parametrize("name, tp, pp, sp", CASES, ids=["7b-tp2", "7b-tp2-sp", "7b-tp2-pp2", "70b-tp8"])
def test_one_rank_under_fake_tensors(name, tp, pp, sp):
    from labkit.estimate import training_memory
    from labkit.shapes import preset

    n_layer = 4
    got = _run(name, n_layer, tp, pp, sp)
    shape = preset(name).replace(n_layer=n_layer)
    dims = SimpleNamespace(dp_size=1, tp_size=tp, pp_size=pp, cp_size=1)
    est = training_memory(shape, seq_len=SEQ, micro_batch=1, dims=dims, precision="bf16",
                          num_microbatches=2 * pp, sequence_parallel=sp)
    assert est.stage == 0  # stage 0 holds p micro-batches of L/p layers: the most loaded
    # model states to the byte; torch's AdamW keeps a 4-byte step count per tensor, on the host on a GPU
    assert (got["params"], got["grads"]) == (est.params, est.grads)
    assert got["optimizer"] == est.optimizer + 4 * got["n_tensors"]
    assert abs(got["activations"] / est.activations - 1) < 0.03, (got["activations"], est.activations)


if __name__ == "__main__":  # python tests/test_estimate_fake.py [preset [n_layer [tp [pp [sp]]]]]
    args = sys.argv[1:] + ["llama-2-7b", "32", "2", "1", "0"][len(sys.argv) - 1:]
    print(json.dumps(measure(args[0], *(int(a) for a in args[1:5]))))
