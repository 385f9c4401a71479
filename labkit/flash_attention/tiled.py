"""FlashAttention-2 in PyTorch tiles, to step through (Chapter 7; Dao 2023, Algorithms 1 and 2).

Full tensors stand for HBM; a slice ``[..., i0:i1, :]`` is a tile loaded into SRAM. The forward
keeps a running max ``m`` and sum ``l`` per row (the online softmax), never forms the (s_q, s_k)
scores, and saves one statistic, the row log-sum-exp ``L``. The backward recomputes each tile of P
from ``L`` with D = rowsum(dO * O). Tiles compute in fp32 (fp64 for fp64 inputs), as the kernels'
accumulators do. An optional :class:`IOCounter` counts the elements each load and store moves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..validate import check_bool, check_int
from .reference import check_inputs

__all__ = ["FlashAttention", "IOCounter", "flash_attention"]


@dataclass
class IOCounter:
    """Elements read from and written to HBM (the full tensors) by the tiled algorithm."""

    reads: int = 0
    writes: int = 0

    @property
    def total(self) -> int:
        return self.reads + self.writes


def _load(io, t):
    if io is not None:
        io.reads += t.numel()
    return t


def _store(io, dst, src):
    if io is not None:
        io.writes += src.numel()
    dst.copy_(src)


def _tile_mask(i0, i1, j0, j1, offset, device):
    """(Br, Bc) bool, True above the bottom-right-aligned diagonal (key j > query i + offset)."""
    rows = torch.arange(i0, i1, device=device)[:, None]
    cols = torch.arange(j0, j1, device=device)[None, :]
    return cols > rows + offset


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_blocks(block_q, block_k, io):
    check_int("block_q", block_q, minimum=1)
    check_int("block_k", block_k, minimum=1)
    if io is not None and not isinstance(io, IOCounter):
        raise TypeError(f"io={io!r} must be an IOCounter or None")


def _group(q, k) -> int:
    """Query heads per kv head: h / h_kv (1 for multi-head attention)."""
    return q.shape[-3] // k.shape[-3] if q.dim() >= 3 else 1


def _grouped(g, *qs, kvs=()):
    """With g > 1: query-side (..., h, s, ...) -> (..., h_kv, g, s, ...); kv side (..., h_kv, 1, s, d)."""
    if g == 1:
        return (*qs, *kvs)
    n = kvs[0].dim()  # q, O, dO have n dimensions (heads at -3); L, dL have n - 1 (heads at -2)
    return (*(t.unflatten(-3 if t.dim() == n else -2, (-1, g)) for t in qs), *(t.unsqueeze(-3) for t in kvs))


class FlashAttention(torch.autograd.Function):
    """``FlashAttention.apply(q, k, v, causal, block_q=64, block_k=64, io=None)``.

    q (..., h, s_q, d), k and v (..., h_kv, s_k, d), h_kv dividing h -> O (..., h, s_q, d).
    Saves q, k, v, O and L (..., h, s_q).
    """

    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_q=64, block_k=64, io=None):
        check_inputs(q, k, v, causal)
        _check_blocks(block_q, block_k, io)
        g = _group(q, k)
        out, lse = _forward(*_grouped(g, q, kvs=(k, v)), causal, block_q, block_k, io)
        out, lse = (out.flatten(-4, -3), lse.flatten(-3, -2)) if g > 1 else (out, lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.blocks, ctx.io = causal, (block_q, block_k), io
        ctx.set_materialize_grads(False)  # d_lse is None when L is not used: nothing extra moves
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if d_out is None:  # only L was used
            d_out = torch.zeros_like(out)
        g = _group(q, k)
        qs = (q, out, lse, d_out) + (() if d_lse is None else (d_lse,))
        *qs, kg, vg = _grouped(g, *qs, kvs=(k, v))
        qg, out, lse, d_out = qs[:4]
        dq, dk, dv = _backward(qg, kg, vg, out, lse, d_out, qs[4] if d_lse is not None else None,
                               ctx.causal, *ctx.blocks, ctx.io)
        if g > 1:  # back to (..., h, s_q, d) and (..., h_kv, s_k, d)
            dq, dk, dv = dq.flatten(-4, -3), dk.squeeze(-3), dv.squeeze(-3)
        return dq, dk, dv, None, None, None, None


def _forward(q, k, v, causal, Br, Bc, io):
    """FlashAttention-2, Algorithm 1: rows of Q in blocks of Br, keys in blocks of Bc."""
    s_q, s_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale, offset, acc_t = 1.0 / math.sqrt(d), s_k - s_q, _compute_dtype(q.dtype)
    out = torch.empty_like(q)  # O in HBM
    lse = torch.empty(q.shape[:-1], dtype=acc_t, device=q.device)  # L in HBM, (..., s_q)
    for i0 in range(0, s_q, Br):  # on a GPU each row block is its own thread block
        i1 = min(i0 + Br, s_q)
        Qi = _load(io, q[..., i0:i1, :]).to(acc_t)  # (..., Br, d)
        m = torch.full(Qi.shape[:-1], float("-inf"), dtype=acc_t, device=q.device)  # (..., Br)
        l = torch.zeros_like(m)  # (..., Br)
        acc = torch.zeros_like(Qi)  # unnormalised O_i, (..., Br, d)
        for j0 in range(0, s_k, Bc):
            if causal and j0 > i1 - 1 + offset:
                break  # this tile and the rest lie above the diagonal: skipped, never loaded
            j1 = min(j0 + Bc, s_k)
            Kj = _load(io, k[..., j0:j1, :]).to(acc_t)  # (..., Bc, d)
            Vj = _load(io, v[..., j0:j1, :]).to(acc_t)  # (..., Bc, d)
            S = (Qi @ Kj.transpose(-2, -1)) * scale  # (..., Br, Bc), on chip only
            if causal and j1 - 1 > i0 + offset:  # the tile crosses the diagonal
                S = S.masked_fill(_tile_mask(i0, i1, j0, j1, offset, q.device), float("-inf"))
            m_new = torch.maximum(m, S.amax(dim=-1))  # running max
            P = torch.exp(S - m_new[..., None])  # (..., Br, Bc), unnormalised
            alpha = torch.exp(m - m_new)  # rescales what was summed under the old max
            l = alpha * l + P.sum(dim=-1)  # running sum
            acc = alpha[..., None] * acc + P @ Vj  # (..., Br, d)
            m = m_new
        _store(io, out[..., i0:i1, :], acc / l[..., None])  # O_i = diag(l)^-1 acc
        _store(io, lse[..., i0:i1], m + torch.log(l))  # L_i = m + log(l)
    return out, lse


def _group_sum(x, like):
    """A query group's (..., h_kv, g, Bc, d) contributions summed onto its kv head's (..., h_kv, 1, Bc, d)."""
    return x if x.shape == like.shape else x.sum(dim=-3, keepdim=True)


def _backward(q, k, v, out, lse, d_out, d_lse, causal, Br, Bc, io):
    """FlashAttention-2, Algorithm 2: key blocks outside, query blocks inside; P from L.

    A gradient dL of the log-sum-exp adds P_ij dL_i to dS_ij: it enters as D_i - dL_i."""
    s_q, s_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale, offset, acc_t = 1.0 / math.sqrt(d), s_k - s_q, _compute_dtype(q.dtype)
    D = torch.empty(q.shape[:-1], dtype=acc_t, device=q.device)  # (..., s_q) in HBM
    rowsum = (_load(io, d_out).to(acc_t) * _load(io, out).to(acc_t)).sum(dim=-1)  # (..., s_q)
    _store(io, D, rowsum if d_lse is None else rowsum - _load(io, d_lse).to(acc_t))
    dq = torch.zeros(q.shape, dtype=acc_t, device=q.device)  # dQ = 0 in HBM, (..., s_q, d)
    if io is not None:
        io.writes += dq.numel()
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for j0 in range(0, s_k, Bc):  # on a GPU each key block is its own thread block
        j1 = min(j0 + Bc, s_k)
        Kj = _load(io, k[..., j0:j1, :]).to(acc_t)  # (..., Bc, d)
        Vj = _load(io, v[..., j0:j1, :]).to(acc_t)  # (..., Bc, d)
        dKj, dVj = torch.zeros_like(Kj), torch.zeros_like(Vj)
        for i0 in range(0, s_q, Br):
            i1 = min(i0 + Br, s_q)
            if causal and j0 > i1 - 1 + offset:
                continue  # the whole tile is masked: P = 0 there
            Qi = _load(io, q[..., i0:i1, :]).to(acc_t)  # (..., Br, d)
            dOi = _load(io, d_out[..., i0:i1, :]).to(acc_t)  # (..., Br, d)
            Li = _load(io, lse[..., i0:i1])  # (..., Br)
            Di = _load(io, D[..., i0:i1])  # (..., Br)
            S = (Qi @ Kj.transpose(-2, -1)) * scale  # (..., Br, Bc), recomputed
            if causal and j1 - 1 > i0 + offset:
                S = S.masked_fill(_tile_mask(i0, i1, j0, j1, offset, q.device), float("-inf"))
            P = torch.exp(S - Li[..., None])  # softmax probabilities, exactly, from L
            dVj += _group_sum(P.transpose(-2, -1) @ dOi, dVj)  # (..., Bc, d)
            dP = dOi @ Vj.transpose(-2, -1)  # (..., Br, Bc)
            dS = P * (dP - Di[..., None])  # softmax backward with D_i = rowsum(dO_i * O_i)
            dQi = _load(io, dq[..., i0:i1, :])  # read-modify-write (an atomic add on a GPU)
            _store(io, dq[..., i0:i1, :], dQi + (dS @ Kj) * scale)
            dKj += _group_sum((dS.transpose(-2, -1) @ Qi) * scale, dKj)  # (..., Bc, d)
        _store(io, dk[..., j0:j1, :], dKj)
        _store(io, dv[..., j0:j1, :], dVj)
    return dq.to(q.dtype), dk, dv


def flash_attention(q, k, v, *, causal: bool = False, block_q: int = 64, block_k: int = 64,
                    return_lse: bool = False, io: IOCounter | None = None):
    """FlashAttention-2 on PyTorch tiles: q (..., h, s_q, d), k and v (..., h_kv, s_k, d) -> (..., h, s_q, d).

    ``block_q`` and ``block_k`` are the paper's Br and Bc; ``return_lse`` also returns L (..., s_q).
    Causal masks are bottom-right aligned (see :mod:`labkit.flash_attention.reference`).
    """
    check_bool("return_lse", return_lse)
    out, lse = FlashAttention.apply(q, k, v, causal, block_q, block_k, io)
    return (out, lse) if return_lse else out
