"""labkit.flash_attention against references that share none of its code.

References: ``F.scaled_dot_product_attention`` (with torch's own lower-right causal bias for
s_q != s_k), the score matrix materialised in fp64, a mask written out by a loop, the memory
meter, ``FlopCounterMode``, and the tiny GPT with its own attention core. The Triton kernels run
in one subprocess (interpreted on the CPU, compiled on a GPU): see tests/flash_triton_worker.py.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.utils.flop_counter import FlopCounterMode

from labkit.flash_attention import (
    FlashAttention, IOCounter, apply_flash_attention, attention_flops, causal_mask, flash_attention,
    flash_block_size,
    hbm_accesses, standard_attention,
)
from labkit.memory import MemoryMeter
from labkit.model import GPTConfig, build_model

ROOT = Path(__file__).resolve().parent.parent
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


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("s_q, s_k, d, Br, Bc", SHAPES)
def test_equals_sdpa_and_the_fp64_reference(s_q, s_k, d, Br, Bc, causal):
    q, k, v, dout = _qkv(s_q, s_k, d)
    flash = _run(lambda *x: flash_attention(*x, causal=causal, block_q=Br, block_k=Bc, return_lse=True), q, k, v, dout)
    ref = _run(lambda *x: standard_attention(*x, causal, return_lse=True), q, k, v, dout)
    for a, b in zip(flash, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)  # fp64 on both sides: round-off of sums only
    mask = causal_lower_right(s_q, s_k) if causal else None
    sdpa = _run(lambda *x: F.scaled_dot_product_attention(*x, attn_mask=mask), *(t.float() for t in (q, k, v, dout)))
    f32 = _run(lambda *x: flash_attention(*x, causal=causal, block_q=Br, block_k=Bc), *(t.float() for t in (q, k, v, dout)))
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], f32, sdpa):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)  # fp32 sums in other orders


def test_the_causal_mask_is_bottom_right_aligned():
    # written out by a loop: query i of s_q sees key j of s_k when j <= i + (s_k - s_q)
    want = torch.tensor([[j > i + 3 for j in range(7)] for i in range(4)])
    assert torch.equal(causal_mask(4, 7), want)
    assert torch.equal(causal_mask(5, 5), torch.ones(5, 5, dtype=torch.bool).triu(1))  # the usual triangle


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
        hbm_accesses(64, 16, 32, kind="flash")


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
def test_counted_hbm_accesses_equal_the_formula(N, d, B):
    q, k, v, dout = _qkv(N, N, d, dtype=torch.float32, lead=(1,))
    io = IOCounter()  # the backward adds to the counter the forward was given
    xs = [t.requires_grad_() for t in (q, k, v)]
    out = flash_attention(*xs, block_q=B, block_k=B, io=io)
    counted_fwd = io.total
    out.backward(dout)
    want = hbm_accesses(N, d, 4 * d * B + B * B, "flash")  # M = 4 d B + B^2 gives Br = Bc = B
    assert (counted_fwd, io.total - counted_fwd) == (want.forward, want.backward)  # exact: element counts
    std = hbm_accesses(N, d, kind="standard")
    assert std.forward == 4 * N * N + 4 * N * d and std.backward == 7 * N * N + 8 * N * d  # Algorithms 0 and 3


def test_the_gpt_trains_to_the_same_loss():
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=40, vocab_size=64)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 64, (3, 40), generator=g) for _ in range(2))
    torch.manual_seed(0)
    plain = build_model(cfg)
    losses = {}
    for impl in (None, "pytorch", "sdpa"):
        model = copy.deepcopy(plain)
        if impl:
            apply_flash_attention(model, impl, block_q=16, block_k=16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[impl] = []
        for _ in range(5):
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[impl].append(loss.item())
    assert losses[None][-1] < losses[None][0] - 0.1  # it trains
    for impl in ("pytorch", "sdpa"):
        # fp32 attention in another summation order, carried through five Adam steps
        assert losses[impl] == pytest.approx(losses[None], rel=1e-4), impl


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
        triton_err, torch_err = case["err"]["triton"], case["err"]["torch"]
        for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], triton_err, torch_err):
            if case["case"].startswith("float32"):
                assert a <= 1e-5, (case["case"], name, a)  # fp32 round-off on O(1) values
            else:
                assert a <= 2 * b, (case["case"], name, a, b)  # flash-attention's rule: twice PyTorch's error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the compiled Triton kernels")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_compiled_triton_on_cuda_against_sdpa(dtype):
    from labkit.flash_attention import FlashAttentionTriton

    for causal in (False, True):
        q, k, v, dout = (t.cuda() for t in _qkv(1000, 1000, 128, dtype=torch.float64, lead=(2, 4)))
        low = [t.to(dtype) for t in (q, k, v, dout)]
        exact = _run(lambda *x: standard_attention(*x, causal, return_lse=True), *(t.double() for t in low))
        tri = _run(lambda *x: FlashAttentionTriton.apply(*x, causal), *low)
        plain = _run(lambda *x: standard_attention(*x, causal, return_lse=True), *low)
        for name, a, b, ref in zip(["out", "lse", "dq", "dk", "dv"], tri, plain, exact):
            err, err_plain = (a.double() - ref).abs().max().item(), (b.double() - ref).abs().max().item()
            # flash-attention's rule for its kernels (hopper/test_flash_attn.py): twice PyTorch's error
            # plus twice the dtype's rounding of the reference values (tensor cores round P to 16 bits)
            slack = 2 * (ref.to(dtype) + 0.3 - 0.3 - ref.to(dtype)).abs().max().item()
            assert err <= 2 * err_plain + slack, (name, causal, err, err_plain)
