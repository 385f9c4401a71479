"""labkit.tensor_parallel on real gloo ranks: equality, collectives, memory, DTensor, TP x ZeRO-1.

One 4-rank launch serves every distributed test: tensor parallelism over two 2-rank groups and
over all 4 ranks, each with and without sequence parallelism, then 2 x 2 TP x ZeRO-1.
"""

import pytest
import torch
from torch.testing import assert_close

from labkit.dist import launch
from labkit.memory import activation_bytes as chapter1_activation_bytes
from labkit.memory import korthikanti_activation_bytes
from labkit.model import get_preset
from labkit.tensor_parallel import (RECOMPUTE, activation_bytes, check_tp_size, collectives_per_layer,
                                    collectives_per_step, model_activation_bytes, params_per_rank,
                                    shard_indices)
from tp_workers import tp_checks

CFG = get_preset("tiny")
BATCH = 2  # tp_rank's default
CONFIGS = [(t, sp) for t in (2, 4) for sp in (False, True)]
GLOO = dict(backend="gloo", timeout_s=120, join_timeout_s=600)  # a loaded 2-core machine is slow
# Each output element is a sum over h (or 4h) products that tensor parallelism splits into t
# partial sums added by a collective: the same terms in another order, a few fp32 ulps apart.
SUM_ORDER = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def runs():
    return launch(tp_checks, 4, CFG, **GLOO)


def _full_logits(runs, t, sp):
    """Concatenate the vocabulary columns of the first tp group's ranks: (B, T, V)."""
    res = [r["tp"][(t, sp)] for r in runs[:t]]
    assert [r["tp_rank"] for r in res] == list(range(t))
    return torch.cat([r["logits"] for r in res], dim=-1)


@pytest.mark.parametrize("t,sp", CONFIGS)
def test_outputs_loss_and_every_gradient_equal_the_unsharded_model(runs, t, sp):
    ref = runs[0]["tp"]
    assert_close(_full_logits(runs, t, sp), ref["ref_logits"], **SUM_ORDER)
    for r in runs:
        res = r["tp"][(t, sp)]
        # the loss's sum of exps runs over V/t columns per rank, then over ranks
        assert_close(torch.tensor(res["loss"]), torch.tensor(ref["ref_loss"]), rtol=1e-6, atol=0)
        assert len(res["grads"]) == 4 * 12 + 4  # every parameter of this rank: 12 per block, 4 outside
        for name, (diff, scale) in res["grads"].items():
            # weight gradients of split layers sum over B T rows on one rank: no cross-rank sum,
            # yet the input gradients feeding them came through one, so the same bound holds
            assert diff <= SUM_ORDER["atol"] + SUM_ORDER["rtol"] * scale, (t, sp, name, diff, scale)


@pytest.mark.parametrize("t,sp", CONFIGS)
def test_pytorch_dtensor_tensor_parallelism_gives_the_same_outputs(runs, t, sp):
    ours = _full_logits(runs, t, sp)
    for r in runs:
        res = r["tp"][(t, sp)]
        # both add t partial sums by a collective; their orders may differ from each other's
        assert_close(res["dtensor_logits"], ours, **SUM_ORDER)
        assert_close(torch.tensor(res["dtensor_loss"]), torch.tensor(res["loss"]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("t,sp", CONFIGS)
def test_collectives_counted_per_layer_and_per_step(runs, t, sp):
    want_step = collectives_per_step(CFG.n_layer, sequence_parallel=sp)
    for r in runs:
        res = r["tp"][(t, sp)]
        layer = res["layer_comm"]
        assert {"forward": layer["forward"], "backward": layer["backward"]} == collectives_per_layer(sp)
        # every collective of a layer moves one (B, T, C) fp32 tensor (its full size, as counted)
        u = BATCH * CFG.seq_len * CFG.d_model * 4
        assert all(v == n * u for pas in ("forward", "backward") for k, n in layer[pas].items()
                   for v in [layer["bytes"][pas][k]])
        assert {k: v["calls"] for k, v in res["comm"].items()} == want_step
    assert want_step == ({"all_gather": 27, "reduce_scatter": 18, "all_reduce": 4} if sp else {"all_reduce": 21})


@pytest.mark.parametrize("t,sp", CONFIGS)
def test_memory_per_rank_matches_the_formulas(runs, t, sp):
    res = runs[0]["tp"][(t, sp)]["memory"]
    for recompute in RECOMPUTE:
        acts, params = res[recompute]
        assert params == 4 * params_per_rank(CFG, t)  # fp32: exact
        want = model_activation_bytes(CFG, BATCH, t, sp, recompute).total
        assert abs(acts / want - 1) <= 0.02, (recompute, acts, want)  # the spec's 2%
    acts1, params1 = runs[0]["tp"]["memory_t1"]
    assert abs(acts1 / model_activation_bytes(CFG, BATCH).total - 1) <= 0.02
    assert params1 == 4 * params_per_rank(CFG, 1)
    # sequence parallelism shards what plain tensor parallelism replicates
    if sp:
        plain = runs[0]["tp"][(t, False)]["memory"]["none"][0]
        assert res["none"][0] < plain


@pytest.mark.parametrize("sp", [False, True])
def test_tp_with_zero1_on_a_2x2_mesh_trains_like_one_process(runs, sp):
    res = [r["zero1"][sp] for r in runs]
    assert sorted(r["dp_rank"] for r in res) == [0, 0, 1, 1]
    for r in res:
        assert len(r["losses"]) == 3
        # each data-parallel rank's loss is the mean over its half of the rows: their mean is the
        # global batch's; fp32 sums in another order, ~1e-7 relative
        mean = torch.tensor([(a + b) / 2 for a, b in zip(res[0]["losses"], res[2]["losses"])]) \
            if res[0]["dp_rank"] != res[2]["dp_rank"] else None
        assert mean is not None
        assert_close(mean, torch.tensor(r["ref_losses"]), rtol=1e-6, atol=0)
        for name, (diff, scale) in r["params"].items():
            # Adam's early steps are about lr * g / |g|: a ~1e-7 relative gradient difference
            # becomes up to ~2e-5 where |g| is tiny (the ZeRO tests' bound)
            assert diff <= 5e-5, (sp, name, diff)


def test_bad_input_is_refused_naming_both_sides(runs):
    msg = runs[0]["refusals"]
    assert "tp_size=4 must divide n_head=2" in msg["n_head"]
    assert "tp_size=4 must divide vocab_size=250" in msg["vocab_size"]
    assert "dropout=0.1" in msg["dropout"]
    assert "tp_size=2" in msg["twice"] and "size 4" in msg["twice"]


def test_a_pipeline_stages_part_is_sharded_and_a_sharded_model_deep_copies(runs):
    for r in runs:
        # the same sums over h in t partial sums as in the whole model's test
        assert max(r["stage"]) <= 1e-5, r["stage"]


def test_check_tp_size_names_the_argument_and_both_values():
    with pytest.raises(ValueError, match="tp_size=3 must divide n_head=8"):
        check_tp_size(3, n_head=8)
    with pytest.raises(ValueError, match="tp_size=4 must divide d_model=6"):
        check_tp_size(4, n_head=4, d_model=6)
    with pytest.raises(ValueError, match="tp_size=0 must be an int >= 1"):
        check_tp_size(0)
    with pytest.raises(ValueError, match="recompute='some'"):
        activation_bytes(64, 2, 128, 4, recompute="some")
    with pytest.raises(ValueError, match="dropout"):
        model_activation_bytes(get_preset("tiny", dropout=0.1), 2)


def test_korthikanti_table_2():
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B
    sbh = s * b * h
    # no parallelism: the core's own Chapter 1 formula, written independently
    assert activation_bytes(s, b, h, a) == pytest.approx(korthikanti_activation_bytes(s, b, h, a))
    for t in (2, 8):
        assert activation_bytes(s, b, h, a, tp=t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
        assert activation_bytes(s, b, h, a, tp=t, sp=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
        assert activation_bytes(s, b, h, a, tp=t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
        assert activation_bytes(s, b, h, a, t, True, "selective") == pytest.approx(34 * sbh / t)
        assert activation_bytes(s, b, h, a, tp=t, recompute="full") == pytest.approx(2 * sbh)


def test_labkit_formula_at_t1_is_chapter_1s():
    for cfg in (CFG, get_preset("gpt2-small")):
        one = chapter1_activation_bytes(cfg, 3)
        ours = model_activation_bytes(cfg, 3)
        assert (ours.per_layer, ours.head) == (one.per_layer, one.head)


def test_shard_indices_take_each_ranks_heads_from_q_k_and_v():
    idx = shard_indices(12, rank=1, tp_size=2, chunks=3)  # q, k, v of 4 rows each, 2 ranks
    assert idx.tolist() == [2, 3, 6, 7, 10, 11]
    with pytest.raises(ValueError, match="tp_size=4 must divide d_model=6"):
        shard_indices(18, 0, 4, chunks=3, name="d_model")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs: NCCL ranks, one GPU each")
def test_tensor_parallelism_on_cuda_with_nccl():
    from labkit.runs.tensor_parallel import tp_rank

    world = 4 if torch.cuda.device_count() >= 4 else 2
    results = launch(tp_rank, world, CFG, tp_sizes=(world,), recomputes=("none",), backend="nccl", timeout_s=300)
    for sp in (False, True):
        # cuBLAS and NCCL sum in yet other orders: the same float round-off bound as on gloo
        assert_close(_full_logits([{"tp": r} for r in results], world, sp), results[0]["ref_logits"], **SUM_ORDER)
        for r in results:
            for loss in (r[(world, sp)]["loss"], r[(world, sp)]["dtensor_loss"]):
                assert_close(torch.tensor(loss), torch.tensor(r["ref_loss"]), rtol=1e-5, atol=0)
            for name, (diff, scale) in r[(world, sp)]["grads"].items():
                assert diff <= SUM_ORDER["atol"] + SUM_ORDER["rtol"] * scale, (sp, name, diff, scale)
        acts, params = results[0][(world, sp)]["memory"]["none"]
        want = model_activation_bytes(CFG, BATCH, world, sp, device_type="cuda").total
        assert params == 4 * params_per_rank(CFG, world) and abs(acts / want - 1) <= 0.02, (acts, want)
