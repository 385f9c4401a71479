"""FlashAttention-2 as Triton kernels (Chapter 7): compiled on a GPU, interpreted on the CPU.

Imported only when used: labkit never imports Triton at import time. On the CPU the kernels run
under Triton's interpreter, which needs ``TRITON_INTERPRET=1`` in the environment before Triton
is first imported. One program per row block (forward) or key block (backward), the paper's
grid; exp2 with log2(e) folded into the scale, fp32 accumulators, dQ by atomic adds in fp32
(Dao 2023, Algorithm 2). Same contract and masks as :class:`labkit.flash_attention.FlashAttention`.
Precision is explicit: ``tl.dot`` rounds fp32 inputs to TF32 by default, so fp32 inputs multiply
in full fp32 here (``input_precision="ieee"``), as PyTorch's fp32 matmuls do by default; 16-bit
inputs use the tensor cores, with P rounded to the inputs' dtype before P V. Grouped-query
inputs (k, v with h_kv < h heads): program (batch, head i) reads kv head i // (h / h_kv); the
backward writes each query head's dK, dV and sums each group's in PyTorch.
"""

from __future__ import annotations

import math
import os

import torch

from ..validate import check_bool
from .reference import check_inputs

try:
    import triton
    import triton.language as tl
except ImportError as err:  # pragma: no cover - triton ships with torch on Linux
    raise ImportError("labkit.flash_attention.triton_kernels needs the triton package "
                      "(pip install triton)") from err

__all__ = ["FlashAttentionTriton", "dot_precision", "flash_attention_triton", "interpreted"]

LOG2E = 1.4426950408889634


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _fwd_kernel(Q, K, V, O, L, s_q, s_k, offset, qk_scale, group, D: tl.constexpr, CAUSAL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                DOT: tl.constexpr):
    """Algorithm 1 for one row block of one (batch, head): running m and l in base 2."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols0, dims = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    row_ok, dim_ok = rows < s_q, dims < D
    Q, O, L = Q + bh * s_q * D, O + bh * s_q * D, L + bh * s_q
    K, V = K + (bh // group) * s_k * D, V + (bh // group) * s_k * D  # this query head's kv head
    q = tl.load(Q + rows[:, None] * D + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = s_k
    if CAUSAL:  # key blocks wholly above this row block's diagonal are never visited
        hi = tl.minimum(s_k, (pid_m + 1) * BLOCK_M + offset)
    for j0 in range(0, hi, BLOCK_N):
        cols = j0 + cols0
        kv_mask = (cols < s_k)[:, None] & dim_ok[None, :]
        k = tl.load(K + cols[:, None] * D + dims[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        ok = (cols < s_k)[None, :]
        if CAUSAL:
            ok = ok & (cols[None, :] <= rows[:, None] + offset)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + cols[:, None] * D + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT)
        m = m_new
    acc = acc / l[:, None]
    tl.store(O + rows[:, None] * D + dims[None, :], acc.to(O.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(L + rows, (m + tl.log2(l)) / 1.4426950408889634, mask=row_ok)  # natural-log L


@triton.jit
def _bwd_preprocess(O, DO, Delta, s_q, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """D_i = rowsum(dO_i * O_i) for one row block."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    rows, dims = pid_m * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    mask = (rows < s_q)[:, None] & (dims < D)[None, :]
    offs = bh * s_q * D + rows[:, None] * D + dims[None, :]
    o = tl.load(O + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + bh * s_q + rows, tl.sum(o * do, 1), mask=rows < s_q)


@triton.jit
def _bwd_kernel(Q, K, V, DO, L, Delta, DQ, DK, DV, s_q, s_k, offset, scale, group, D: tl.constexpr,
                CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                DOT: tl.constexpr):
    """Algorithm 2 for one key block: dK_j, dV_j in registers, dQ_i by atomic adds."""
    pid_n, bh = tl.program_id(0), tl.program_id(1)
    cols, dims, rows0 = pid_n * BLOCK_N + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_M)
    col_ok, dim_ok = cols < s_k, dims < D
    Q, DO, DQ = Q + bh * s_q * D, DO + bh * s_q * D, DQ + bh * s_q * D
    L, Delta = L + bh * s_q, Delta + bh * s_q
    K, V = K + (bh // group) * s_k * D, V + (bh // group) * s_k * D  # this query head's kv head
    DK, DV = DK + bh * s_k * D, DV + bh * s_k * D  # per query head, summed over the group after
    kv_mask = col_ok[:, None] & dim_ok[None, :]
    k = tl.load(K + cols[:, None] * D + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + cols[:, None] * D + dims[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    if CAUSAL:  # row blocks wholly above the diagonal see none of these keys
        lo = tl.maximum(0, pid_n * BLOCK_N - offset) // BLOCK_M * BLOCK_M
    for i0 in range(lo, s_q, BLOCK_M):
        rows = i0 + rows0
        q_mask = (rows < s_q)[:, None] & dim_ok[None, :]
        q = tl.load(Q + rows[:, None] * D + dims[None, :], mask=q_mask, other=0.0)
        do = tl.load(DO + rows[:, None] * D + dims[None, :], mask=q_mask, other=0.0)
        lse = tl.load(L + rows, mask=rows < s_q, other=0.0)
        delta = tl.load(Delta + rows, mask=rows < s_q, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT) * (scale * 1.4426950408889634)  # recomputed, log2 units
        ok = (rows < s_q)[:, None] & col_ok[None, :]
        if CAUSAL:
            ok = ok & (cols[None, :] <= rows[:, None] + offset)
        p = tl.where(ok, tl.exp2(s - lse[:, None] * 1.4426950408889634), 0.0)  # (BLOCK_M, BLOCK_N)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT)
        dq = tl.dot(ds.to(k.dtype), k, input_precision=DOT) * scale
        tl.atomic_add(DQ + rows[:, None] * D + dims[None, :], dq, mask=q_mask)
    tl.store(DK + cols[:, None] * D + dims[None, :], (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + cols[:, None] * D + dims[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


def _config(d: int):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages): small tiles under the interpreter."""
    block_d = max(16, triton.next_power_of_2(d))
    if interpreted():
        return 16, 16, block_d, 1, 1
    block_n = 64 if block_d <= 64 else 32
    return 128, block_n, block_d, 4 if block_d <= 64 else 8, 3


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of every ``tl.dot``: "ieee" (full fp32) for fp32 inputs, where Triton's
    default would be TF32 (10-bit mantissas); for 16-bit inputs it changes nothing."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_runnable(q):
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q.dtype={q.dtype}: the Triton kernels take float16, bfloat16 or float32")
    if q.device.type == "cpu" and not interpreted():
        raise RuntimeError("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before triton is first imported (e.g. in a fresh process)")


class FlashAttentionTriton(torch.autograd.Function):
    """``FlashAttentionTriton.apply(q, k, v, causal)``: the contract of ``FlashAttention``."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False):
        check_inputs(q, k, v, causal)
        _check_runnable(q)
        lead, s_q, s_k, d = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1]
        q3, k3, v3 = (t.reshape(-1, t.shape[-2], d).contiguous() for t in (q, k, v))  # (BH, s, d)
        bh, group = q3.shape[0], q3.shape[0] // k3.shape[0]  # group: query heads per kv head
        out = torch.empty_like(q3)
        lse = torch.empty((bh, s_q), dtype=torch.float32, device=q.device)
        BM, BN, BD, warps, stages = _config(d)
        _fwd_kernel[(triton.cdiv(s_q, BM), bh)](
            q3, k3, v3, out, lse, s_q, s_k, s_k - s_q, LOG2E / math.sqrt(d), group, D=d, CAUSAL=causal,
            BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, DOT=dot_precision(q.dtype), num_warps=warps,
            num_stages=stages)
        ctx.save_for_backward(q3, k3, v3, out, lse)
        ctx.causal, ctx.lead, ctx.lead_kv = causal, lead, k.shape[:-2]
        out, lse = out.view(*lead, s_q, d), lse.view(*lead, s_q)
        ctx.set_materialize_grads(False)  # L is differentiable; d_lse is None when it is not used
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q3, k3, v3, out, lse = ctx.saved_tensors
        bh, s_q, d = q3.shape
        s_k, group = k3.shape[1], bh // k3.shape[0]
        if d_out is None:  # only L was used
            d_out = torch.zeros_like(out)
        do = d_out.reshape(bh, s_q, d).contiguous()  # (BH, s_q, d)
        BM, BN, BD, warps, stages = _config(d)
        delta = torch.empty_like(lse)
        _bwd_preprocess[(triton.cdiv(s_q, BM), bh)](out, do, delta, s_q, D=d, BLOCK_M=BM, BLOCK_D=BD)
        if d_lse is not None:  # dL_i adds P_ij dL_i to dS_ij: it enters as D_i - dL_i
            delta -= d_lse.reshape(bh, s_q).float()
        dq = torch.zeros(q3.shape, dtype=torch.float32, device=q3.device)  # atomic adds land here
        per_head = (bh, s_k, d)  # dK, dV of every query head; a group's are summed below
        dk, dv = (torch.empty(per_head, dtype=torch.float32 if group > 1 else k3.dtype, device=k3.device)
                  for _ in range(2))
        _bwd_kernel[(triton.cdiv(s_k, BN), bh)](
            q3, k3, v3, do, lse, delta, dq, dk, dv, s_q, s_k, s_k - s_q, 1.0 / math.sqrt(d), group, D=d,
            CAUSAL=ctx.causal, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, DOT=dot_precision(q3.dtype),
            num_warps=warps, num_stages=stages)
        if group > 1:  # (BH, s_k, d) -> (BH_kv, s_k, d): a kv head's gradient sums its query heads'
            dk, dv = (t.view(-1, group, s_k, d).sum(1).to(k3.dtype) for t in (dk, dv))
        shape_q, shape_k = (*ctx.lead, s_q, d), (*ctx.lead_kv, s_k, d)
        return dq.to(q3.dtype).view(shape_q), dk.view(shape_k), dv.view(shape_k), None


def flash_attention_triton(q, k, v, *, causal: bool = False, return_lse: bool = False):
    """FlashAttention-2 in Triton: q (..., h, s_q, d), k and v (..., h_kv, s_k, d) -> (..., h, s_q, d)."""
    check_bool("return_lse", return_lse)
    out, lse = FlashAttentionTriton.apply(q, k, v, causal)
    return (out, lse) if return_lse else out
