"""labkit.flash_attention against references that share none of its code.

References: ``F.scaled_dot_product_attention`` (with torch's own lower-right causal bias for
s_q != s_k), the score matrix materialised in fp64, a mask written out by a loop, the memory
meter, ``FlopCounterMode``, and the tiny GPT with its own attention core. The Triton kernels run
in one subprocess (interpreted on the CPU, compiled on a GPU): see tests/flash_triton_worker.py.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from labkit.flash_attention import (
    FlashAttention, FlashAttentionCore, IOCounter, apply_flash_attention, attention_flops, causal_mask,
    flash_attention, flash_block_size, hbm_accesses, paper_block_sizes, standard_attention,
)
from labkit.memory import MemoryMeter
from labkit.model import GPTConfig, build_model

ROOT = Path(__file__).resolve().parent.parent


def _lower_right(s_q, s_k):
    """SDPA's causal mask aligned to the last key, imported when first used: its module imports
    torch._dynamo, a CPU-second that every pytest worker paid while collecting this file."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(s_q, s_k)


# (s_q, s_k, d, Br, Bc): odd lengths that are no multiple of the tiles, s_q < s_k, a single tile
SHAPES = [(67, 67, 16, 16, 32), (33, 50, 24, 16, 16), (5, 130, 8, 64, 32), (9, 9, 64, 64, 64)]


def _qkv(s_q, s_k, d, dtype=torch.float64, lead=(2, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, s_q, d, generator=g, dtype=dtype)
    k, v = (torch.randn(*lead, s_k, d, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, torch.randn(*lead, s_q, d, generator=g, dtype=dtype)


def _run(fn, q, k, v, dout):
    """(output, L or None, dq, dk, dv) of fn on fresh leaves."""
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    res = fn(*xs)
    out, lse = res if isinstance(res, tuple) else (res, None)
    return (out.detach(), lse, *torch.autograd.grad(out, xs, dout))


def _rel(x, ref):
    """Relative error ||x - ref|| / ||ref|| in fp64 (a norm: the max of a few fp32 sums is luck)."""
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.roundoff
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("s_q, s_k, d, Br, Bc", SHAPES)
def test_equals_sdpa_and_the_fp64_reference(s_q, s_k, d, Br, Bc, causal):
    q, k, v, dout = _qkv(s_q, s_k, d)
    flash = _run(lambda *x: flash_attention(*x, causal=causal, block_q=Br, block_k=Bc, return_lse=True), q, k, v, dout)
    ref = _run(lambda *x: standard_attention(*x, causal, return_lse=True), q, k, v, dout)
    for a, b in zip(flash, ref):
        # float64 on both sides: sums of O(100) terms of size O(10) round at ~1e-14, far below
        # 1e-12, and a wrong mask, scale or statistic is off by far more
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # fp32: the house rule, error against the fp64 reference of the fp32-rounded inputs at most
    # twice PyTorch's own (the worse of SDPA and the materialised scores, which sum in different
    # orders), plus twice the fp32 rounding of the reference's values (flash-attention's slack)
    x32 = [t.float() for t in (q, k, v, dout)]
    exact = _run(lambda *x: standard_attention(*x, causal, return_lse=True), *(t.double() for t in x32))
    mask = _lower_right(s_q, s_k) if causal else None
    sdpa = _run(lambda *x: F.scaled_dot_product_attention(*x, attn_mask=mask), *x32)
    plain = _run(lambda *x: standard_attention(*x, causal, return_lse=True), *x32)
    f32 = _run(lambda *x: flash_attention(*x, causal=causal, block_q=Br, block_k=Bc, return_lse=True), *x32)
    for name, a, b, c, r in zip(["out", "lse", "dq", "dk", "dv"], f32, sdpa, plain, exact):
        torch_err = max(_rel(c, r), _rel(b, r) if b is not None else 0.0)  # SDPA returns no L
        assert _rel(a, r) <= 2 * torch_err + 2 * _rel(r.float(), r), (name, _rel(a, r), torch_err)


def test_the_causal_mask_is_bottom_right_aligned():
    # written out by a loop: query i of s_q sees key j of s_k when j <= i + (s_k - s_q)
    want = torch.tensor([[j > i + 3 for j in range(7)] for i in range(4)])
    assert torch.equal(causal_mask(4, 7), want)
    assert torch.equal(causal_mask(5, 5), torch.ones(5, 5, dtype=torch.bool).triu(1))  # the usual triangle


@pytest.mark.roundoff
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_low_precision_error_is_at_most_twice_pytorchs(dtype, causal):
    q, k, v, dout = _qkv(45, 61, 32, dtype=torch.float64, seed=1)
    low = [t.to(dtype) for t in (q, k, v, dout)]
    exact = _run(lambda *x: standard_attention(*x, causal, return_lse=True), *(t.double() for t in low))
    flash = _run(lambda *x: flash_attention(*x, causal=causal, block_q=16, block_k=16, return_lse=True), *low)
    plain = _run(lambda *x: standard_attention(*x, causal, return_lse=True), *low)
    for name, a, b, ref in zip(["out", "lse", "dq", "dk", "dv"], flash, plain, exact):
        err_flash, err_plain = (a.double() - ref).abs().max().item(), (b.double() - ref).abs().max().item()
        # flash-attention's own test rule: no more than twice the error of PyTorch in the same dtype
        assert err_flash <= 2 * err_plain, (name, err_flash, err_plain)
    assert flash[0].dtype == dtype and flash[1].dtype == torch.float32  # L is kept in fp32


@pytest.mark.roundoff
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h, h_kv", [(4, 2), (6, 1)])
def test_grouped_query_inputs_equal_sdpa_on_repeated_kv_heads(h, h_kv, causal):
    g = torch.Generator().manual_seed(h + h_kv)
    s_q, s_k, d = 21, 37, 12  # odd lengths, no multiple of the tiles
    q, dout = (torch.randn(2, h, s_q, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, h_kv, s_k, d, generator=g, dtype=torch.float64) for _ in range(2))
    dl = torch.randn(2, h, s_q, generator=g, dtype=torch.float64)
    mask = _lower_right(s_q, s_k) if causal else None

    def reference(q, k, v):  # kv heads repeated for their query heads; autograd sums the copies back
        k, v = (t.repeat_interleave(h // h_kv, dim=1) for t in (k, v))
        scores = q @ k.transpose(-2, -1) / d ** 0.5
        if causal:
            scores = scores.masked_fill(~torch.ones(s_q, s_k, dtype=torch.bool).tril(s_k - s_q), float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), torch.logsumexp(scores, -1)

    results = []
    for fn in (lambda *x: flash_attention(*x, causal=causal, block_q=8, block_k=16, return_lse=True), reference):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*xs)
        results.append((out, lse, *torch.autograd.grad((out * dout).sum() + (lse * dl).sum(), xs)))
    for a, b in zip(*results):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)  # float64: sums of ~40 terms round at ~1e-15


def test_saves_the_inputs_the_output_and_one_statistic():
    q, k, v, _ = _qkv(40, 40, 16, dtype=torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, lse = FlashAttention.apply(q.requires_grad_(), k, v, True, 16, 16)
    assert [tuple(t.shape) for t in saved] == [(2, 3, 40, 16)] * 4 + [(2, 3, 40)]  # q, k, v, O and L
    assert saved[3] is out and saved[4] is lse


def test_bad_input_raises_naming_it():
    q, k, v, _ = _qkv(8, 8, 16, dtype=torch.float32)
    cases = [
        ((q, k, v[..., :4, :]), "v.shape"),  # k and v lengths differ
        ((q, k[..., :8], v[..., :8]), "head dims"),  # d differs between q and k, v
        ((q[:1], k, v), "leading"),  # batch dims differ
        ((q.long(), k.long(), v.long()), "q.dtype"),  # not floating point
        ((q, k.double(), v), "dtypes"),
    ]
    for args, word in cases:
        with pytest.raises(ValueError, match=word):
            flash_attention(*args)
    with pytest.raises(ValueError, match="s_q=8 > s_k=5"):
        flash_attention(q, k[..., :5, :], v[..., :5, :], causal=True)
    with pytest.raises(ValueError, match="block_q=0"):
        flash_attention(q, k, v, block_q=0)
    with pytest.raises(ValueError, match="kind='sparse'"):
        hbm_accesses(64, 16, 1024, kind="sparse")
    assert [flash_block_size(16, m) for m in (65, 131, 132, 4 * 16 * 40 + 40 ** 2)] == [1, 1, 2, 40]
    with pytest.raises(ValueError, match="M=32"):
        hbm_accesses(64, 16, 32, kind="flash", tiles="square")
    with pytest.raises(ValueError, match="tiles='rect'"):
        hbm_accesses(64, 16, 1024, kind="flash", tiles="rect")
    for bad in (True, 0, 2.0):  # a bool is not an int
        with pytest.raises(ValueError, match="block_k="):
            flash_attention(q, k, v, block_k=bad)
        with pytest.raises(ValueError, match="N="):
            hbm_accesses(bad, 16)
        with pytest.raises(ValueError, match="block_q="):
            apply_flash_attention(build_model(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8,
                                                        vocab_size=16)), block_q=bad)


_Q = torch.zeros(1, 1, 4, 8)
MORE_BAD = [  # each once silently taken (a truthy string, a no-op dropout) or failing far away
    (lambda: flash_attention(_Q, _Q, _Q, return_lse="no"), TypeError, "return_lse='no'"),
    (lambda: standard_attention(_Q, _Q, _Q, return_lse="no"), TypeError, "return_lse='no'"),
    (lambda: flash_attention(_Q, _Q, _Q, io=5), TypeError, "io=5 must be an IOCounter"),
    (lambda: causal_mask(-1, 3), ValueError, "s_q=-1"),
    (lambda: causal_mask(True, 3), ValueError, "s_q=True"),
    (lambda: causal_mask(4, 2.0), ValueError, "s_k=2.0"),
    (lambda: causal_mask(5, 3), ValueError, "s_q=5 > s_k=3"),
    (lambda: FlashAttentionCore(dropout="0.1"), ValueError, "dropout='0.1'"),
    (lambda: FlashAttentionCore(dropout=-0.5), ValueError, "dropout=-0.5"),
    (lambda: FlashAttentionCore(dropout=float("nan")), ValueError, "dropout=nan"),
    (lambda: FlashAttentionCore(dropout=True), ValueError, "dropout=True"),
    (lambda: paper_block_sizes(16, 8), ValueError, "M=8"),
]


@pytest.mark.parametrize("call, kind, words", MORE_BAD, ids=[w for _, _, w in MORE_BAD])
def test_more_bad_input_raises_naming_it(call, kind, words):
    with pytest.raises(kind, match=words.replace("(", r"\(")):
        call()


@pytest.mark.parametrize("causal, use_out", [(False, True), (True, True), (True, False)])
def test_a_loss_that_uses_the_log_sum_exp_gets_its_gradient(causal, use_out):
    # once L was marked non-differentiable: a loss using it got a silently partial gradient.
    # fp64 on both sides: the two orders of summation agree to ~1e-15, far below any lost term
    q, k, v, dout = _qkv(13, 21, 8)
    dl = torch.randn(2, 3, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = []
    for fn in (lambda *a: flash_attention(*a, causal=causal, block_q=4, block_k=8, return_lse=True),
               lambda *a: standard_attention(*a, causal, return_lse=True)):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*xs)
        loss = (lse * dl).sum() + ((out * dout).sum() if use_out else 0)
        grads.append(torch.autograd.grad(loss, xs, allow_unused=True, materialize_grads=True))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _fit(xs, ys):
    """p in y = c x^p, least squares in log-log."""
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def test_memory_grows_linearly_for_flash_and_quadratically_for_standard():
    lengths, d, B = [256, 512, 1024, 2048], 64, 64

    def peak(fn, s):
        q, k, v, dout = _qkv(s, s, d, dtype=torch.float32, lead=(1, 1))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with MemoryMeter() as meter:
            with meter.phase("forward"):
                out = fn(q, k, v)
            with meter.phase("backward"):
                out.backward(dout)
                del out
        return meter.report().peak_bytes  # everything the forward and backward allocated

    flash = [peak(lambda q, k, v: flash_attention(q, k, v, causal=True, block_q=B, block_k=B), s) for s in lengths]
    standard = [peak(lambda q, k, v: standard_attention(q, k, v, True), s) for s in lengths]
    p_flash, p_standard = _fit(lengths, flash), _fit(lengths, standard)
    print(f"extra memory ~ s^{p_flash:.2f} (FlashAttention), s^{p_standard:.2f} (standard)")
    # constant Br x Bc tile temporaries pull the slope below 1; an s^2 term would push it towards 2
    assert 0.8 <= p_flash <= 1.05
    # the s^2 scores dominate; the O(s d) tensors pull the slope slightly below 2
    assert 1.85 <= p_standard <= 2.05
    steps = np.diff(flash)
    assert np.array_equal(steps[1:], 2 * steps[:-1])  # exactly affine in s: each doubling adds twice as much


def test_flops_equal_the_formulas():
    q, k, v, dout = _qkv(48, 80, 16, dtype=torch.float32)
    for kind, fn in [("standard", lambda *x: standard_attention(*x, False)),
                     ("flash", lambda *x: flash_attention(*x, block_q=16, block_k=32))]:
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        with FlopCounterMode(display=False) as fwd_counter:
            out = fn(*xs)
        with FlopCounterMode(display=False) as bwd_counter:
            out.backward(dout)
        fwd, bwd = attention_flops(48, 16, kind, s_k=80)
        assert (fwd_counter.get_total_flops(), bwd_counter.get_total_flops()) == (6 * fwd, 6 * bwd), kind  # 6 heads
    assert hbm_accesses(64, 16, 1024, "flash").flops_backward == 10 * 64 * 64 * 16  # recompute costs 2 N^2 d


@pytest.mark.parametrize("N, d, B", [(100, 16, 16), (64, 8, 32), (37, 32, 8)])
def test_counted_hbm_accesses_equal_the_formula_for_square_tiles(N, d, B):
    q, k, v, dout = _qkv(N, N, d, dtype=torch.float32, lead=(1,))
    io = IOCounter()  # the backward adds to the counter the forward was given
    xs = [t.requires_grad_() for t in (q, k, v)]
    out = flash_attention(*xs, block_q=B, block_k=B, io=io)
    counted_fwd = io.total
    out.backward(dout)
    M = 4 * d * B + B * B  # the largest square tile for this M is B
    assert flash_block_size(d, M) == B and flash_block_size(d, M - 1) == B - 1
    want = hbm_accesses(N, d, M, "flash", tiles="square")
    assert (counted_fwd, io.total - counted_fwd) == (want.forward, want.backward)  # exact: element counts
    std = hbm_accesses(N, d, kind="standard")
    assert std.forward == 4 * N * N + 4 * N * d and std.backward == 7 * N * N + 8 * N * d  # Algorithms 0 and 3


@pytest.mark.parametrize("N, d, M", [(100, 8, 4 * 8 * 24), (77, 16, 4 * 16 * 10 + 5)])
def test_counted_hbm_accesses_equal_the_formula_for_the_papers_tiles(N, d, M):
    B_c, B_r = paper_block_sizes(d, M)  # held on chip through the inner loop, streamed past
    assert (B_c, B_r) == (-(-M // (4 * d)), min(-(-M // (4 * d)), d))
    q, k, v, dout = _qkv(N, N, d, dtype=torch.float32, lead=(1,))
    counted = []
    # the forward holds Q_i (rows outside), the backward K_j and V_j (keys outside): each pass is
    # run with the held block of B_c rows, as Theorem 2's proof holds the K_j, V_j of Algorithm 1
    for block_q, block_k in ((B_c, B_r), (B_r, B_c)):
        io = IOCounter()
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention(*xs, block_q=block_q, block_k=block_k, io=io)
        fwd = io.total
        out.backward(dout)
        counted.append((fwd, io.total - fwd))
    want = hbm_accesses(N, d, M, "flash")  # tiles="paper" is the default
    assert (counted[0][0], counted[1][1]) == (want.forward, want.backward)  # exact: element counts


@pytest.mark.parametrize("d", [32, 64, 128])
def test_papers_tiles_scale_as_theorem_2(d):
    # Theorem 2: Theta(N^2 d^2 / M) for d <= M <= N d. Here 4d divides M (so 2M doubles B_c
    # exactly) and N = 4096 B_c: the lower-order terms of Eq. eq-fa-io are N (9d + 2) against the
    # leading (N^2 / B_c)(6d + 2), a fraction x <= 1.5 B_c / N, so the ratio in N lies in
    # [4 - 2x, 4] and the ratio in M in [0.5, 0.5 + x / 2]; an exponent of N or M off by any
    # amount would leave these intervals.
    M = 4 * d * 256
    B_c = paper_block_sizes(d, M)[0]
    N = 4096 * B_c
    assert d <= M <= N * d
    x = 1.5 * B_c / N
    base = hbm_accesses(N, d, M, "flash").total
    in_n, in_m = hbm_accesses(2 * N, d, M, "flash").total / base, hbm_accesses(N, d, 2 * M, "flash").total / base
    assert 4 - 2 * x <= in_n <= 4, in_n
    assert 0.5 <= in_m <= 0.5 + x / 2, in_m
    # square tiles with M >> d^2 have B ~ sqrt(M): doubling M cuts the traffic by about 1/sqrt(2),
    # not by half, so they are a named variant, not Theorem 2's analysis
    M_big = 4096 * d * d
    square = hbm_accesses(N, d, 2 * M_big, "flash", "square").total / hbm_accesses(N, d, M_big, "flash", "square").total
    assert 0.6 < square < 0.75, square


@pytest.mark.roundoff
def test_the_gpt_trains_to_the_same_loss():
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=40, vocab_size=64)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 64, (3, 40), generator=g) for _ in range(2))
    torch.manual_seed(0)
    plain = build_model(cfg).double()
    losses = {}
    for impl in (None, "pytorch", "sdpa"):
        model = copy.deepcopy(plain)
        if impl:
            apply_flash_attention(model, impl, block_q=16, block_k=16)
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        losses[impl] = []
        for _ in range(5):
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[impl].append(loss.item())
    assert losses[None][-1] < losses[None][0] - 0.1  # it trains
    for impl in ("pytorch", "sdpa"):
        # float64 and SGD (Adam would magnify near-zero gradients): five steps of fp64 round-off
        # stay near 1e-15, far below 1e-9, while a wrong mask or scale moves the loss by 1e-2
        assert losses[impl] == pytest.approx(losses[None], rel=1e-9), impl


def test_dropout_in_training_is_refused():
    model = build_model(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, vocab_size=16, dropout=0.1))
    apply_flash_attention(model, "pytorch")
    x = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="dropout=0.1"):
        model(x)
    model.eval()
    assert model(x).shape == (1, 8, 16)  # no dropout in eval: allowed
    with pytest.raises(ValueError, match="impl='cuda'"):
        apply_flash_attention(model, "cuda")


def test_triton_kernels_in_a_subprocess():
    """Interpreted on the CPU (TRITON_INTERPRET=1 before triton's import), compiled on a GPU."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "flash_triton_worker.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["triton_at_import"] is False  # importing labkit.flash_attention did not import triton
    assert report["interpreted"] == (report["device"] == "cpu")
    assert len(report["results"]) == 8
    for case in report["results"]:
        names = ["out", "lse", "dq", "dk", "dv"]
        if case["case"].startswith("float32"):
            # fp32 sums in another order: relative error (a norm, as a max over a few fp32 sums is
            # luck) at most twice PyTorch's, plus twice the fp32 rounding of the reference
            for name, a, b, r in zip(names, case["rel"]["triton"], case["rel"]["torch"], case["round"]):
                assert a <= 2 * b + 2 * r, (case["case"], name, a, b, r)
        else:
            # flash-attention's rule: no more than twice PyTorch's error in the same dtype
            for name, a, b in zip(names, case["err"]["triton"], case["err"]["torch"]):
                assert a <= 2 * b, (case["case"], name, a, b)
    lse = report["lse_grad"]  # dq, dk, dv of a loss that uses L: the same fp32 rule
    for name, a, b, r in zip(["dq", "dk", "dv"], lse["triton"], lse["torch"], lse["round"]):
        assert a <= 2 * b + 2 * r, ("gradient through L", name, a, b, r)
    for case in report["gqa"]:  # 4 query heads on 2 kv heads against SDPA on repeated kv heads, fp32
        assert case["shapes"] == [[1, 4, 19, 16], [1, 4, 19, 16], [1, 2, 45, 16], [1, 2, 45, 16]]
        for name, a, b, r in zip(["out", "dq", "dk", "dv"], case["rel"]["triton"], case["rel"]["torch"], case["round"]):
            assert a <= 2 * b + 2 * r, ("gqa", case["causal"], name, a, b, r)


def test_every_triton_dot_states_its_precision():
    # tl.dot rounds fp32 inputs to TF32 by default on a GPU (the interpreter does not emulate it, so
    # this is read from the source): each product must say which precision it uses
    source = (ROOT / "labkit" / "flash_attention" / "triton_kernels.py").read_text()
    dots = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == "dot"]
    assert len(dots) == 7  # S and P V forward; S, dV, dP, dK, dQ backward
    assert all(any(kw.arg == "input_precision" for kw in node.keywords) for node in dots)


def test_star_import_needs_no_triton():
    # a None entry in sys.modules makes `import triton` raise ImportError, as on macOS or Windows
    code = ("import sys; sys.modules['triton'] = None\n"
            "from labkit.flash_attention import *\nprint(flash_attention.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "flash_attention", proc.stderr[-2000:]


def test_lab_runs_without_triton(tmp_path):
    """Lab 7 from the top where `import triton` fails, as on macOS or Windows: the Triton cell says
    that it skipped the kernels, and every later cell runs (nbconvert stops at a cell's error)."""
    (tmp_path / "triton.py").write_text('raise ImportError("no triton here: a stand-in of the test")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
         "--output-dir", str(tmp_path), "--output", "lab", str(ROOT / "labs" / "07_flash_attention.ipynb")],
        cwd=ROOT / "labs", env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cells = [c for c in json.loads((tmp_path / "lab.ipynb").read_text())["cells"] if c["cell_type"] == "code"]
    printed = ["".join("".join(o["text"]) for o in c["outputs"] if o["output_type"] == "stream") for c in cells]
    i = next(i for i, c in enumerate(cells) if "import FlashAttentionTriton" in "".join(c["source"]))
    # triton is installed here: only the stand-in can have made the import fail
    assert "Triton is not installed (" in printed[i] and "pip install triton" in printed[i], printed[i]
    assert "Triton kernels'" not in printed[i]  # no kernel ran
    assert i < len(cells) - 1 and "the loss fell: True" in printed[-1]  # the GPT cell after it ran


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the compiled Triton kernels")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_compiled_triton_on_cuda_against_sdpa(dtype):
    from labkit.flash_attention import FlashAttentionTriton

    d = 64 if dtype == torch.float32 else 128  # fp32 tiles take twice the shared memory
    for causal in (False, True):
        q, k, v, dout = (t.cuda() for t in _qkv(1000, 1000, d, dtype=torch.float64, lead=(2, 4)))
        low = [t.to(dtype) for t in (q, k, v, dout)]
        exact = _run(lambda *x: standard_attention(*x, causal, return_lse=True), *(t.double() for t in low))
        tri = _run(lambda *x: FlashAttentionTriton.apply(*x, causal), *low)
        plain = _run(lambda *x: standard_attention(*x, causal, return_lse=True), *low)
        for name, a, b, ref in zip(["out", "lse", "dq", "dk", "dv"], tri, plain, exact):
            if dtype == torch.float32:
                # PyTorch's fp32 matmuls do not use TF32 by default; the kernels' fp32 products are
                # "ieee" too, so TF32's 10-bit mantissas (errors ~1e-3 relative) would fail this
                assert _rel(a, ref) <= 2 * _rel(b, ref) + 2 * _rel(ref.float(), ref), (name, causal)
                continue
            err, err_plain = (a.double() - ref).abs().max().item(), (b.double() - ref).abs().max().item()
            # flash-attention's rule for its kernels (hopper/test_flash_attn.py): twice PyTorch's error
            # plus twice the dtype's rounding of the reference values (tensor cores round P to 16 bits)
            slack = 2 * (ref.to(dtype) + 0.3 - 0.3 - ref.to(dtype)).abs().max().item()
            assert err <= 2 * err_plain + slack, (name, causal, err, err_plain)
