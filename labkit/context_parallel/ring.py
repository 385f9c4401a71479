"""Ring attention (Liu et al. 2023): FlashAttention's outer loop over key-value blocks, spread
over the ranks of a context-parallel group.

Each rank holds s / cp queries, keys and values. In cp steps the key-value shards travel around
the ring (rank r sends to r + 1, receives from r - 1); at each step a rank attends its queries to
the block it holds and merges the partial result with the online softmax's log-sum-exp rule
(eq-fa-merge, Chapter 7), while the next block is already in flight: the send and the receive of
step j + 1 are posted, as one ``batch_isend_irecv``, before step j computes. Backward sends the
keys and values around again, with their gradients travelling beside them, accumulated by every
rank they pass and delivered to their owner after the last step. Under a causal mask, blocks
wholly in a query's future are skipped, and partial ones are masked by global positions. Blocks
are computed, and O and dQ summed, in the softmax's dtype (fp32 for 16-bit inputs, as
FlashAttention's); dK and dV travel in the inputs' dtype, as K and V do.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..attention import causal_mask, merge_attention, reference_attention
from ..validate import check_bool, check_choice
from .analytic import LAYOUTS, chunk_offsets

__all__ = ["RingAttention", "ring_attention", "check_ring_inputs", "ring_peers"]


def ring_peers(group) -> tuple[int, int, int, int]:
    """(rank in group, cp_size, global rank of the next rank, of the previous rank)."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    return rank, cp, glob((rank + 1) % cp), glob((rank - 1) % cp)


def _post(send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int, group, tag: int) -> list:
    """Send ``send`` to the next rank and receive ``recv`` from the previous one, as one batch
    (NCCL runs it as a group, so two ranks that both send first cannot wait on each other)."""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group, tag),
                                   dist.P2POp(dist.irecv, recv, prv, group, tag)])


def _wait(works) -> None:
    for work in works or ():
        work.wait()


def _pairs(q_segs, k_segs, causal: bool):
    """The (query chunk, key chunk) blocks to compute: (qi, q slice, k slice, q0, k0, masked).
    Causal: a key chunk wholly after the query chunk is skipped; one wholly before is unmasked."""
    for qi, (qs, n, q0) in enumerate(q_segs):
        for ks, m, k0 in k_segs:
            if causal and k0 > q0 + n - 1:
                continue  # every key is in every query's future
            masked = causal and k0 + m - 1 > q0
            yield qi, slice(qs, qs + n), slice(ks, ks + m), q0, k0, masked


def _block_backward(q, k, v, dout, lse, delta, masked, q0, k0, scale):
    """Gradients of one block given the final lse and D = rowsum(dO ∘ O) (FlashAttention-2,
    Algorithm 2): q (..., h, n, d), k and v (..., h_kv, m, d) -> dq, dk, dv of those shapes, in
    the softmax's dtype (lse's: fp32 for 16-bit inputs, as the forward's softmax)."""
    q, k, v, dout = (t.to(lse.dtype) for t in (q, k, v, dout))
    n_rep = q.size(-3) // k.size(-3)
    kk, vv = k.repeat_interleave(n_rep, dim=-3), v.repeat_interleave(n_rep, dim=-3)  # (..., h, m, d)
    p = torch.exp((q @ kk.transpose(-2, -1)) * scale - lse.unsqueeze(-1))  # P (..., h, n, m)
    if masked:
        p = p.masked_fill(~causal_mask(q.size(-2), k.size(-2), q_offset=q0, k_offset=k0, device=q.device), 0.0)
    dv = p.transpose(-2, -1) @ dout  # (..., h, m, d)
    ds = p * (dout @ vv.transpose(-2, -1) - delta.unsqueeze(-1))  # dS = P ∘ (dP - D)
    dq = (ds @ kk) * scale  # (..., h, n, d)
    dk = (ds.transpose(-2, -1) @ q) * scale  # (..., h, m, d)
    fold = lambda t: t.unflatten(-3, (-1, n_rep)).sum(-3)  # noqa: E731  (..., h_kv, m, d)
    return dq, fold(dk), fold(dv)


class RingAttention(torch.autograd.Function):
    """softmax(q kᵀ · scale) v over the whole sequence, from this rank's shards; see the module."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale):
        rank, cp, nxt, prv = ring_peers(group)
        seq = q.size(-2) * cp
        q_segs = chunk_offsets(rank, cp, seq, layout)
        lse_dtype = torch.promote_types(q.dtype, torch.float32)  # the core's softmax dtype: O merged in it
        outs = [torch.zeros_like(q[..., qs:qs + n, :], dtype=lse_dtype) for qs, n, _ in q_segs]
        lses = [torch.full_like(o[..., 0], float("-inf"), dtype=lse_dtype) for o in outs]  # (..., h, n)
        kv = torch.stack([k, v])  # (2, ..., h_kv, s/cp, d): one message a step
        for step in range(cp):
            if step < cp - 1:  # post the next block's transfer before computing this one
                incoming = torch.empty_like(kv)
                works = _post(kv, incoming, nxt, prv, group, tag=step)
            k_segs = chunk_offsets((rank - step) % cp, cp, seq, layout)  # the block's owner's chunks
            for qi, qsl, ksl, q0, k0, masked in _pairs(q_segs, k_segs, causal):
                o, lse = reference_attention(*(t.to(lse_dtype) for t in (q[..., qsl, :], kv[0][..., ksl, :],
                                                                         kv[1][..., ksl, :])),
                                             causal=masked, q_offset=q0, k_offset=k0, scale=scale, return_lse=True)
                outs[qi], lses[qi] = merge_attention(outs[qi], lses[qi], o, lse)
            if step < cp - 1:
                _wait(works)
                kv = incoming
        out, lse = torch.cat(outs, dim=-2).to(q.dtype), torch.cat(lses, dim=-1)  # (..., h, s/cp, d), (..., h, s/cp)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.layout, ctx.scale = group, causal, layout, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        rank, cp, nxt, prv = ring_peers(ctx.group)
        seq = q.size(-2) * cp
        q_segs = chunk_offsets(rank, cp, seq, ctx.layout)
        delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # D (..., h, s/cp), in the softmax's dtype
        dq, kv = torch.zeros_like(q, dtype=lse.dtype), torch.stack([k, v])  # gradients summed in L's dtype
        dkv_works = dkv_in = kv_works = None
        for step in range(cp):
            if step < cp - 1:
                incoming = torch.empty_like(kv)
                kv_works = _post(kv, incoming, nxt, prv, ctx.group, tag=cp + step)
            mine = torch.zeros_like(kv, dtype=lse.dtype)  # this rank's share of the block owner's dK, dV
            k_segs = chunk_offsets((rank - step) % cp, cp, seq, ctx.layout)
            for qi, qsl, ksl, q0, k0, masked in _pairs(q_segs, k_segs, ctx.causal):
                dq_b, dk_b, dv_b = _block_backward(q[..., qsl, :], kv[0][..., ksl, :], kv[1][..., ksl, :],
                                                   dout[..., qsl, :], lse[..., qsl], delta[..., qsl],
                                                   masked, q0, k0, ctx.scale)
                dq[..., qsl, :] += dq_b
                mine[0][..., ksl, :] += dk_b
                mine[1][..., ksl, :] += dv_b
            if cp == 1:
                return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(k.dtype), None, None, None, None
            if dkv_works is not None:  # the shares of the ranks this block passed before
                _wait(dkv_works)
                mine += dkv_in
            dkv_in, send = torch.empty_like(kv), mine.to(kv.dtype)  # sent in k's dtype, as K and V
            dkv_works = _post(send, dkv_in, nxt, prv, ctx.group, tag=2 * cp + step)
            if step < cp - 1:
                _wait(kv_works)
                kv = incoming
        _wait(dkv_works)  # after cp steps, our own block's dK, dV, summed over every rank
        return dq.to(q.dtype), dkv_in[0], dkv_in[1], None, None, None, None


def check_ring_inputs(q, k, v, layout: str, cp_size: int | None = None) -> None:
    """Raise ValueError unless q (..., h, n, d), k and v (..., h_kv, n, d) are shards ring
    attention can take: one shape for k and v, the same tokens and batch as q, h_kv dividing h,
    and (zigzag) n even, two chunks."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() < 3:
            raise TypeError(f"{name} must be a tensor (..., heads, s/cp, head_dim), got "
                            f"{getattr(t, 'shape', type(t).__name__)}")
    if k.shape != v.shape or q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} must match each other "
                         f"and q's dtype {q.dtype}")
    if q.shape[:-3] != k.shape[:-3] or q.size(-2) != k.size(-2) or q.size(-1) != k.size(-1):
        raise ValueError(f"mismatched shards: q {tuple(q.shape)} and k {tuple(k.shape)} must have the same "
                         "batch dims, tokens (s/cp, dim -2) and head_dim (dim -1)")
    if q.size(-3) % k.size(-3):
        raise ValueError(f"k's heads {k.size(-3)} must divide q's heads {q.size(-3)} (grouped-query attention)")
    if layout == "zigzag" and q.size(-2) % 2:
        whole = "" if cp_size is None else f", {q.size(-2) * cp_size} tokens, by 2 * cp_size = {2 * cp_size}"
        raise ValueError(f"q.size(-2)={q.size(-2)} tokens on this rank: layout='zigzag' needs an even shard "
                         f"(the sequence divisible by 2 * cp_size{whole})")


def _check_same_across_group(q, k, group) -> None:
    """One all-reduce: every rank of ``group`` must hold shards of one shape (else a receive
    would wait for a message of another size); all ranks raise together."""
    shape = torch.tensor([*q.shape, *k.shape], dtype=torch.int64, device=q.device)
    both = torch.cat([shape, -shape])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    hi, lo = both[:shape.numel()], -both[shape.numel():]
    if not torch.equal(hi, lo):
        raise ValueError(f"mismatched shards across the group: this rank has q {tuple(q.shape)}, k {tuple(k.shape)}; "
                         f"the ranks' shapes range from {lo.tolist()} to {hi.tolist()} (q's dims, then k's)")


def ring_attention(q, k, v, group=None, *, causal: bool = False, layout: str = "zigzag",
                   scale: float | None = None, check: bool = True) -> torch.Tensor:
    """Attention over the whole sequence from this rank's shards (:func:`shard_sequence`'s layout):
    q (..., h, s/cp, d), k and v (..., h_kv, s/cp, d) -> this rank's output (..., h, s/cp, d).

    ``group``: the context-parallel group (None: the default group); ``check``: refuse bad shards,
    including shapes that differ across the group (one small all-reduce)."""
    check_bool("causal", causal)
    check_choice("layout", layout, LAYOUTS)
    check_bool("check", check)
    if check:
        check_ring_inputs(q, k, v, layout, dist.get_world_size(group) if dist.is_initialized() else None)
        _check_same_across_group(q, k, group)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale)
    return RingAttention.apply(q, k, v, group, causal, layout, scale)
