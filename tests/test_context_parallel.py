"""labkit.context_parallel on real gloo ranks: ring attention against SDPA on the gathered
sequence, GPT training with cp = 2 (and tp = 2 x cp = 2) against one process, bytes sent,
activation memory, the zigzag layout's balanced work, and the refusals.

One 4-rank launch (tests/cp_workers.py) serves every distributed test. Equivalences are judged in
float64: the ring adds the same terms as full attention in another order, which moves float64
results by ~1e-16 relative; a wrong block, mask or position is off by O(1), so
torch.testing.assert_close's float64 defaults (rtol 1e-7, atol 1e-7) separate the two. The ring
in bfloat16 is judged against PyTorch's own bfloat16 attention's error, measured in the same run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cp_workers import BATCH, FAMILIES, RING_CASES, RING_SHAPES, cp_checks, reference_training, ring_inputs
from labkit.context_parallel import (block_flops, causal_pairs, check_cp_seq_len, chunk_offsets, chunks_of_rank,
                                     computed_blocks, global_loss_bytes, ring_attention, ring_attention_saved_bytes,
                                     ring_bytes_per_layer, shard_rotary_bytes, shard_sequence, unshard_sequence)
from labkit.dist import launch

# Its module fixtures launch ranks once: every test of the file on one xdist worker, or each
# worker that picked one up would launch them again.
pytestmark = pytest.mark.xdist_group("dist:context_parallel")

GLOO = dict(backend="gloo", timeout_s=120, join_timeout_s=600)  # a loaded 2-core machine is slow


@pytest.fixture(scope="module")
def runs():
    return launch(cp_checks, 4, **GLOO)


def _sdpa_with_grads(case, dtype=torch.float64, compute=None):
    """F.scaled_dot_product_attention on the whole sequence: output and dq, dk, dv, the inputs rounded
    to ``dtype`` and computed in ``compute`` (None: ``dtype``)."""
    shape, causal, _ = RING_CASES[case]
    q, k, v, dout = (t.to(dtype).to(compute or dtype) for t in ring_inputs(shape, seed=case))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.roundoff
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", range(len(RING_CASES)))
def test_ring_attention_equals_sdpa_forward_and_every_gradient(runs, cp, case):
    layout = RING_CASES[case][2]
    want = _sdpa_with_grads(case)
    groups = [[0, 1], [2, 3]] if cp == 2 else [[0, 1, 2, 3]]
    for ranks in groups:
        shards = [runs[r][f"ring{cp}"][case] for r in ranks]
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            got = unshard_sequence([s[i] for s in shards], layout=layout, dim=2)
            torch.testing.assert_close(got, want[i], msg=lambda m: f"cp={cp} {RING_CASES[case]} {name}: {m}")


@pytest.mark.roundoff
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_in_bf16_is_within_pytorchs_roundoff(runs, cp):
    """bf16 inputs: the ring computes its blocks and sums O and dQ in fp32 (L's dtype), as FlashAttention
    does, so they may err at most twice PyTorch's own bf16 attention (flash-attention's test rule); dK
    and dV travel round the ring in bf16, as K and V do (ring_bytes_per_layer's count), each of the
    cp - 1 hops rounding a partial sum: allowed one rounding of the result each, measured, |bf16(x) - x|."""
    groups = [[0, 1], [2, 3]] if cp == 2 else [[0, 1, 2, 3]]
    for case, (_, _, layout) in enumerate(RING_CASES):
        plain = _sdpa_with_grads(case, torch.bfloat16)
        exact = _sdpa_with_grads(case, torch.bfloat16, compute=torch.float64)  # the inputs' exact result
        for ranks in groups:
            shards = [runs[r][f"ring{cp}_bf16"][case] for r in ranks]
            for i, name in enumerate(("out", "dq", "dk", "dv")):
                got = unshard_sequence([s[i] for s in shards], layout=layout, dim=2)
                assert got.dtype == torch.bfloat16
                err, own = ((t.double() - exact[i]).abs().max().item() for t in (got, plain[i]))
                hop = (exact[i].to(torch.bfloat16).double() - exact[i]).abs().max().item() if i > 1 else 0.0
                assert err <= 2 * own + (cp - 1) * hop, (cp, RING_CASES[case], name, err, own, hop)


@pytest.mark.parametrize("dtype, recompute", [("float32", "none"), ("bfloat16", "none"), ("float32", "selective"),
                                             ("bfloat16", "selective")])
def test_what_the_ring_keeps_for_backward_is_the_count(runs, dtype, recompute):
    # counted by saved-tensor hooks on 2 ranks: q, k, v as passed, O and the fp32 L (none); the
    # checkpointed ring keeps its inputs only (selective); k and v with their n_kv heads, unrepeated
    B, h, h_kv, S, d = RING_SHAPES[1]
    want = ring_attention_saved_bytes(S // 2, B, h, h_kv, d, dtype_bytes=torch.finfo(getattr(torch, dtype)).bits // 8,
                                      recompute=recompute)
    for r in runs:
        assert sorted(r["saved2"][dtype, recompute]) == sorted(want.values()), (dtype, recompute, want)


def test_zigzag_balances_causal_work_counted_in_flops(runs):
    B, h, _, S, d = (2, 4, 4, 16, 5)  # RING_SHAPES[0]
    for layout, n in (("contiguous", 4), ("zigzag", 8)):
        c = S // n
        counted = [r["flops4"][layout] for r in runs]
        want = [block_flops(B, h, d, c, c) * computed_blocks(r, 4, layout) for r in range(4)]
        assert counted == want, (layout, counted, want)
    assert len({r["flops4"]["zigzag"] for r in runs}) == 1  # equal on every rank
    contiguous = [r["flops4"]["contiguous"] for r in runs]
    assert contiguous == sorted(contiguous) and contiguous[-1] == 4 * contiguous[0]  # the last rank does 4x


@pytest.mark.roundoff
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpt_trained_three_steps_with_cp2_equals_one_process(runs, family):
    want = reference_training(FAMILIES[family])
    trained = [r["train2"] for r in runs if r["family"] == family]
    assert len(trained) == 2
    for got in trained:
        # the value every rank reports is the global mean loss, not its shard's
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]))
        for name, p in want["params"].items():
            torch.testing.assert_close(got["params"][name], p, msg=lambda m: f"{family} {name}: {m}")
        assert got["reductions"] == 3  # one gradient sum per backward pass, by the wrapper itself


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bytes_sent_per_layer_equal_the_formula(runs, family):
    cfg = FAMILIES[family]
    for r in runs:
        if r["family"] != family:
            continue
        for fwd, bwd in r["train2"]["sent"]:  # CommCounter's send bytes of the whole model, float64
            for direction, counted in (("forward", fwd), ("backward", bwd)):
                want = ring_bytes_per_layer(BATCH, cfg.seq_len, cfg.kv_heads, cfg.head_dim, 2, 8, direction)
                assert counted == cfg.n_layer * want, (family, direction, counted, want)
    # forward: 2 (cp - 1) / cp of the sequence's K, i.e. (cp - 1) / cp of K and V together
    kv_bytes = 2 * BATCH * cfg.seq_len * cfg.kv_heads * cfg.head_dim * 8
    assert ring_bytes_per_layer(BATCH, cfg.seq_len, cfg.kv_heads, cfg.head_dim, 2, 8) == kv_bytes // 2


def test_attention_activations_per_rank_shrink_as_one_over_cp(runs):
    for r in runs:
        acts = {cp: m["activations"] for cp, m in r["memory"].items()}
        for cp in (2, 4):
            # every activation of the model is per token; a handful of loss scalars is not
            assert abs(acts[cp] * cp / acts[1] - 1) < 1e-3, (cp, acts)


@pytest.mark.roundoff
def test_tp2_x_cp2_trains_like_one_process(runs):
    want = reference_training(FAMILIES["gpt2"])
    for r in runs:
        torch.testing.assert_close(torch.tensor(r["tp_cp"]["losses"]), torch.tensor(want["losses"]))
        torch.testing.assert_close(r["tp_cp"]["ln_f"], want["ln_f"])


@pytest.mark.roundoff
def test_parallelize_gpt_composes_cp_with_tp_and_with_dp(runs):
    """parallelize_gpt with tp = 2 x cp = 2, and with dp = 2 x cp = 2, under its plain loop."""
    want = reference_training(FAMILIES["gpt2"])
    for r in runs:
        got = r["parallelize"]["tp2_cp2"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]))
        torch.testing.assert_close(got["params"]["ln_f.weight"], want["params"]["ln_f.weight"])
    # every row has all its targets, so the mean of the replicas' means is the global mean
    want = reference_training(FAMILIES["llama"], ignore=False)
    for r in runs:
        got = r["parallelize"]["dp2_cp2"]["params"]
        assert set(got) == set(want["params"])
        for name, p in want["params"].items():
            torch.testing.assert_close(got[name], p, msg=lambda m: f"dp x cp {name}: {m}")


def test_bad_input_on_ranks_is_refused_naming_it(runs):
    for r in runs:
        said = r["refusals"]
        assert "mismatched shards across the group" in said["mismatched_across_ranks"]
        assert "zigzag" in said["zigzag_odd_shard"] and "2 * cp_size" in said["zigzag_odd_shard"]
        assert "cp_size=3" in said["cp_size_vs_group"] and "2 ranks" in said["cp_size_vs_group"]


def test_bad_input_is_refused_naming_it():
    x = torch.zeros(1, 12)
    with pytest.raises(ValueError, match=r"x.size\(1\)=12 must be divisible by 2 \* cp_size = 8"):
        shard_sequence(x, 4, 0)
    with pytest.raises(ValueError, match=r"cp_size = 5"):
        shard_sequence(x, 5, 0, layout="contiguous")
    with pytest.raises(ValueError, match="rank=4"):
        shard_sequence(x, 4, 4, layout="contiguous")
    with pytest.raises(ValueError, match="mismatched shapes"):
        unshard_sequence([torch.zeros(1, 4), torch.zeros(1, 6)])
    with pytest.raises(ValueError, match="layout='diagonal' is unknown"):
        check_cp_seq_len(16, 2, "diagonal")
    q, k = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 6, 8)
    with pytest.raises(ValueError, match="mismatched shards"):
        ring_attention(q, k, k, None, check=True)  # refused before any process group is needed


def test_shards_round_trip_and_the_layouts_chunks():
    x = torch.arange(2 * 24).view(2, 24)
    for cp in (1, 2, 3):
        for layout in ("contiguous", "zigzag"):
            shards = [shard_sequence(x, cp, r, layout=layout) for r in range(cp)]
            assert torch.equal(unshard_sequence(shards, layout=layout), x)
    assert [chunks_of_rank(r, 4) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert torch.equal(shard_sequence(x, 2, 1)[0], torch.tensor([6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]))
    assert chunk_offsets(1, 2, 16) == [(0, 4, 4), (4, 4, 8)]


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_causal_work_sums_to_the_triangle_and_zigzag_splits_it_evenly(cp):
    for layout in ("contiguous", "zigzag"):
        assert sum(causal_pairs(r, cp, layout) for r in range(cp)) == pytest.approx(1.0, rel=1e-12)
    assert all(causal_pairs(r, cp, "zigzag") == pytest.approx(1 / cp, rel=1e-12) for r in range(cp))
    assert causal_pairs(cp - 1, cp, "contiguous") == pytest.approx((2 * cp - 1) / cp**2, rel=1e-12)


def test_the_ring_count_refuses_what_it_does_not_model_by_name():
    args = dict(seq_len=8, batch_size=2, n_head=4, n_kv_head=2, head_dim=8, dtype_bytes=2)
    for bad, name in ((dict(recompute="some"), "recompute"), (dict(dtype_bytes=8), "dtype_bytes"),
                      (dict(n_kv_head=True), "n_kv_head"), (dict(seq_len=0), "seq_len")):
        with pytest.raises(ValueError, match=name):
            ring_attention_saved_bytes(**{**args, **bad})
    with pytest.raises(ValueError, match="head_dim"):
        shard_rotary_bytes(8, 2.0, 2)
    with pytest.raises(ValueError, match="tp_size"):
        global_loss_bytes(False)
    assert ring_attention_saved_bytes(**args, recompute="full") == {}  # the block keeps its input


def test_the_formulas_import_without_torch():
    """The estimator and the planner call analytic.py where torch may be absent."""
    code = ("import sys; import labkit.context_parallel as cp; "
            "assert cp.ring_bytes_per_layer(1, 8, 1, 4, 2, 2) == 64; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
