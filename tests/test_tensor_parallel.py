"""labkit.tensor_parallel on real gloo ranks: equality, collectives, memory, DTensor, TP x ZeRO-1.

One 4-rank launch serves every distributed test: tensor parallelism over two 2-rank groups and
over all 4 ranks, each with and without sequence parallelism; plain training loops at t = 2 and 4;
2 x 2 TP x ZeRO-1; the refusals; generation.
"""

import re

import pytest
import torch

from labkit.dist import launch
from labkit.memory import activation_bytes as chapter1_activation_bytes
from labkit.memory import korthikanti_activation_bytes
from labkit.model import build_model, get_preset
from labkit.runs.tensor_parallel import bench_rank, roundoff, tp_rank, tp_train_rank, tp_zero1_rank
from labkit.tensor_parallel import (RECOMPUTE, ColumnParallelLinear, activation_bytes, apply_tensor_parallel, check_tp_size,
                                    collectives_per_layer, collectives_per_step, layer_comm_bytes, layer_flops,
                                    model_activation_bytes, params_per_rank, shard_indices)
from tp_workers import tp_checks

# Its module fixtures launch ranks once: every test of the file on one xdist worker, or each
# worker that picked one up would launch them again.
pytestmark = pytest.mark.xdist_group("dist:tensor_parallel")

CFG = get_preset("tiny")
BATCH = 2  # tp_rank's default
CONFIGS = [(t, sp) for t in (2, 4) for sp in (False, True)]
GLOO = dict(backend="gloo", timeout_s=120, join_timeout_s=600)  # a loaded 2-core machine is slow
# Every equivalence below is judged by the round-off floor measured in the same run (see
# labkit.runs.tensor_parallel_ref): the error of the sharded float32 result against the unsharded
# model in float64 must be within ROUNDOFF times the unsharded float32 model's own error. Both are
# float32 computations of the same sums in different orders, so they err alike on any CPU or GPU;
# a missing or doubled collective is off by orders of magnitude more.
ROUNDOFF = 4


def within_roundoff(pair, what=""):
    err, floor = pair
    assert err <= ROUNDOFF * floor, f"{what}: error {err:.3g} > {ROUNDOFF} x the run's round-off {floor:.3g}"


@pytest.fixture(scope="module")
def runs(request):
    """One launch for the file; when a run selects only its round-off tests (``-m roundoff``, the
    re-run of tests/test_cross_machine.py), only what those read."""
    mine = [item for item in request.session.items if item.path == request.path]
    roundoff_only = bool(mine) and all(item.get_closest_marker("roundoff") for item in mine)
    return launch(tp_checks, 4, CFG, roundoff_only=roundoff_only, **GLOO)


# the roundoff mark (re-run under another CPU kernel setting): the cheapest case of each equivalence
ROUNDOFF_CASE = pytest.mark.roundoff


@pytest.mark.parametrize("t,sp", [pytest.param(*c, marks=ROUNDOFF_CASE) if c == (2, True) else c for c in CONFIGS])
def test_outputs_loss_and_every_gradient_equal_the_unsharded_model(runs, t, sp):
    for r in runs:
        res = r["tp"][(t, sp)]
        assert res["n_grads"] == 4 * 12 + 4  # every parameter of this rank: 12 per block, 4 outside
        # logits are gathered from the V/t columns: whole (B, T, V) on every rank
        within_roundoff(res["logits"], (t, sp, "logits"))
        within_roundoff(res["loss"], (t, sp, "loss"))
        # one floor for all 52 gradients, each error and floor relative to its gradient's size
        within_roundoff(res["grads"], (t, sp, "gradients"))


@pytest.mark.parametrize("t,sp", CONFIGS)
def test_pytorch_dtensor_tensor_parallelism_gives_the_same_outputs(runs, t, sp):
    for r in runs:
        res = r["tp"][(t, sp)]
        # DTensor adds the same t partial sums by its own collectives: the same floor holds
        within_roundoff(res["dtensor_logits"], (t, sp, "DTensor logits"))
        within_roundoff(res["dtensor_loss"], (t, sp, "DTensor loss"))


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
        # the bytes a rank sends in a ring, from what was counted: an all-reduce sends 2 (t-1)/t of
        # its tensor, an all-gather or a reduce-scatter (t-1)/t; layer_comm_bytes predicts the sum
        ring = {"all_reduce": 2 * (t - 1) / t, "all_gather": (t - 1) / t, "reduce_scatter": (t - 1) / t}
        sent = sum(ring[k] * v for pas in ("forward", "backward") for k, v in layer["bytes"][pas].items())
        assert sent == pytest.approx(layer_comm_bytes(CFG.seq_len, BATCH, CFG.d_model, t, 4, sp), rel=1e-12)
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


@pytest.mark.parametrize("sp", [pytest.param(True, marks=ROUNDOFF_CASE), False])
def test_a_plain_training_loop_over_tp_trains_like_one_process(runs, sp):
    for r in runs:
        for t in (2, 4):
            res = r["train"][sp][t]
            # three SGD steps (one of them accumulating two backward passes): see ROUNDOFF
            within_roundoff(res["losses"], (t, sp, "losses"))
            within_roundoff(res["params"], (t, sp, "parameters"))
            assert res["explicit_calls"] == 0  # summed already at the end of backward: nothing left
            # one sum per backward pass: 3 steps, one of them with two passes
            assert res["reductions"] == (4 if sp else None)


@pytest.mark.parametrize("sp", [False, pytest.param(True, marks=ROUNDOFF_CASE)])
def test_tp_with_zero1_on_a_2x2_mesh_trains_like_one_process(runs, sp):
    res = [r["zero1"][sp] for r in runs]
    assert sorted(r["dp_rank"] for r in res) == [0, 0, 1, 1]
    other = next(r for r in res if r["dp_rank"] != res[0]["dp_rank"])
    # each data-parallel rank's loss is the mean over its half of the rows: their mean is the batch's
    mean = torch.tensor([(a + b) / 2 for a, b in zip(res[0]["losses"], other["losses"])])
    ref = res[0]["ref_losses"]
    # plain SGD (Adam would magnify round-off where a gradient is near zero): see ROUNDOFF
    within_roundoff(roundoff(mean, torch.tensor(ref["32"]), torch.tensor(ref["64"], dtype=torch.float64)),
                    (sp, "losses"))
    for r in res:
        assert len(r["losses"]) == 3
        within_roundoff(r["params"], (sp, "parameters"))


def test_bad_input_is_refused_naming_both_sides(runs):
    msg = runs[0]["refusals"]
    assert "tp_size=4 must divide n_head=2" in msg["n_head"]
    assert "tp_size=4 must divide vocab_size=250" in msg["vocab_size"]
    assert "dropout=0.1" in msg["dropout"]
    assert "tp_size=2" in msg["twice"] and "size 4" in msg["twice"]


def test_ranks_with_different_models_or_batches_are_refused(runs):
    for r in runs:
        res = r["unequal"]
        assert "differ across ranks" in res["check"] and "same seed" in res["check"]
        assert res["broadcast"] == 0.0  # init_sync="broadcast": every rank holds rank 0's model exactly
        assert "different batches" in res["batch"]
        assert res["same_batch_loss"] == runs[0]["unequal"]["same_batch_loss"]


def test_vocab_parallel_loss_refuses_targets_the_model_refuses(runs):
    for r in runs:
        msg = r["targets"]
        assert "target 256 is outside [0, vocab_size=256)" in msg["too_large"] and "-100" in msg["too_large"]
        assert "target -1 is outside" in msg["minus_one"] and "-100" in msg["minus_one"]
        assert "every target is -100" in msg["all_ignored"]


def test_faults_on_real_ranks_raise_on_every_rank_and_nothing_hangs(runs):
    for rank, r in enumerate(runs):
        msg = r["more"]
        if rank >= 2:
            assert "not a member of group" in msg["not_member"]
        assert "targets (2, 8) must be (B, T, V/t) and (B, T)" in msg["short_targets"]
        assert "vocab_start=0" in msg["start"] and "rank * V/t" in msg["start"]  # rank 0 too: its start is right
        assert "token id 256 is outside [0, vocab_size=256)" in msg["embedding_id"]
        assert msg["after"] == runs[0]["more"]["after"]  # the group still works after the refusals


def test_generation_on_a_tensor_parallel_model(runs):
    ref = runs[0]["generation"]
    # greedy tokens can only flip where two logits tie within round-off: this reference has none
    assert ref["margin"] > 1e3 * torch.finfo(torch.float32).eps * ref["scale"]
    for r in runs:
        gen = r["generation"]
        assert torch.equal(gen["uncached"], ref["want"])  # every rank: the unsharded model's tokens
        assert torch.equal(gen["cached"], ref["want"])  # the KV cache holds this rank's heads
        assert gen["engine"] == ref["want"][0, 8:].tolist()  # so does the serving engine's paged cache
        assert "cannot decode with a KV cache" in gen["sp_cache"]


def test_a_pipeline_stages_part_is_sharded_and_a_sharded_model_deep_copies(runs):
    for r in runs:
        for pair in r["stage"]:
            within_roundoff(pair, "stage output")  # the same sums over h in t partial sums


def test_sequence_parallel_must_be_a_bool():
    model = build_model("tiny")
    with pytest.raises(TypeError, match="sequence_parallel='no' must be True or False"):
        apply_tensor_parallel(model, None, sequence_parallel="no")
    with pytest.raises(TypeError, match="sequence_parallel=1 must be True or False"):
        collectives_per_layer(1)
    with pytest.raises(ValueError, match="init_sync='maybe'"):
        apply_tensor_parallel(model, None, init_sync="maybe")


TP_BAD = [  # each once a silent result (the last rank's rows, negative bytes) or a far error
    (lambda: shard_indices(8, -1, 2), "rank=-1 must be an int in [0, 1]"),
    (lambda: shard_indices(8, 2, 2), "rank=2 must be an int in [0, 1]"),
    (lambda: shard_indices(8, 0, 0), "tp_size=0"),
    (lambda: shard_indices(8, 0, 2, chunks=0), "chunks=0"),
    (lambda: check_tp_size(2, n_head=0), "n_head=0 must be an int >= 1"),
    (lambda: check_tp_size(1, n_head=True), "n_head=True"),
    (lambda: activation_bytes(-1, 2, 128, 4), "s=-1"),
    (lambda: activation_bytes(8, 2, 128.5, 4), "h=128.5"),
    (lambda: layer_flops(8, "2", 128), "b='2'"),
    (lambda: layer_comm_bytes(8, 2, 128, 2, dtype_bytes=0), "dtype_bytes=0"),
    (lambda: model_activation_bytes(CFG, 2, 4, True, seq_len=6), "sequence length 6 must be divisible by tp_size=4"),
]


@pytest.mark.parametrize("call, words", TP_BAD, ids=[w for _, w in TP_BAD])
def test_more_bad_sizes_raise_naming_them(call, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        call()


MESH_BAD = [  # checked before any rank builds a mesh: once torch's mesh error, a ZeroDivisionError, or
    # unequal data-parallel shares whose mean is not the whole batch's (a run that fails its own check)
    (lambda: tp_rank(0, 4, CFG, tp_sizes=(3,)), "tp_size=3 must divide world_size=4"),
    (lambda: tp_rank(0, 4, CFG, tp_sizes=(0,)), "tp_size=0"),
    (lambda: tp_train_rank(0, 4, CFG, tp_sizes=(8,)), "tp_size=8 must be an int in [1, 4]"),
    (lambda: bench_rank(0, 4, CFG, tp_sizes=(True,)), "tp_size=True"),
    (lambda: tp_zero1_rank(0, 4, CFG, batch_size=5), "dp_size=2 must divide batch_size=5"),
    (lambda: tp_zero1_rank(0, 4, CFG, dp_size=3), "dp_size=3 must divide world_size=4"),
]


@pytest.mark.parametrize("call, words", MESH_BAD, ids=[w for _, w in MESH_BAD])
def test_run_functions_refuse_a_mesh_that_cannot_be_built(call, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        call()


def test_without_torch_distributed_or_with_a_wrong_group_or_model_the_error_says_so():
    # no process group here: once torch's own message, or an AttributeError deep in torch
    with pytest.raises(ValueError, match="apply_tensor_parallel needs torch.distributed started"):
        apply_tensor_parallel(build_model("tiny"), None)
    with pytest.raises(ValueError, match="ColumnParallelLinear needs torch.distributed started"):
        ColumnParallelLinear(torch.nn.Linear(4, 4), None)
    with pytest.raises(TypeError, match="linear must be a torch.nn.Linear, got Conv1d"):
        ColumnParallelLinear(torch.nn.Conv1d(4, 4, 1), None)


def test_check_tp_size_names_the_argument_and_both_values():
    with pytest.raises(ValueError, match="tp_size=3 must divide n_head=8"):
        check_tp_size(3, n_head=8)
    with pytest.raises(ValueError, match="tp_size=4 must divide d_model=6"):
        check_tp_size(4, n_head=4, d_model=6)
    with pytest.raises(ValueError, match="tp_size=0 must be an int >= 1"):
        check_tp_size(0)
    with pytest.raises(ValueError, match="tp_size=True must be an int >= 1"):
        check_tp_size(True)  # a bool is not an int
    with pytest.raises(ValueError, match="tp_size=True"):
        layer_flops(64, 2, 128, True)
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
        # tp_size and sequence_parallel are the names; tp and sp, the earlier ones, still work
        assert activation_bytes(s, b, h, a, tp_size=t, sequence_parallel=True) == activation_bytes(
            s, b, h, a, tp=t, sp=True)
    with pytest.raises(ValueError, match="disagree"):
        activation_bytes(s, b, h, a, tp_size=2, tp=8)


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
        for r in results:
            res = r[(world, sp)]
            # cuBLAS and NCCL sum in yet other orders; the floor is measured on the same GPU
            for key in ("logits", "loss", "grads", "dtensor_logits", "dtensor_loss"):
                within_roundoff(res[key], (sp, key))
        acts, params = results[0][(world, sp)]["memory"]["none"]
        want = model_activation_bytes(CFG, BATCH, world, sp, device_type="cuda").total
        assert params == 4 * params_per_rank(CFG, world) and abs(acts / want - 1) <= 0.02, (acts, want)
