"""Megatron's conjugate operators as ``autograd.Function``s, each taking its process group.

``copy_to_tp`` is f (identity forward, all-reduce backward) and ``reduce_from_tp`` is g
(all-reduce forward, identity backward): Shoeybi et al. (2019), Figure 3. With sequence
parallelism (Korthikanti et al. 2022, Figure 5) the pair becomes their g (all-gather along the
sequence forward, reduce-scatter backward) and ``reduce_scatter_to_sp``
(their g-bar: reduce-scatter forward, all-gather backward); the all-gather that re-enters a
region is fused into the linear layer after it (``layers._GatherLinear``). ``gather_from_tp``
assembles the vocabulary-split logits for generation. Activations are (B, T, C); the sequence
is dimension 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives import all_gather_flat, reduce_scatter_flat
from .rules import check_sequence_parallel

__all__ = ["copy_to_tp", "reduce_from_tp", "reduce_scatter_to_sp", "gather_from_tp", "all_gather_seq",
           "reduce_scatter_seq", "check_seq_divisible", "check_group", "GroupRef"]


def check_group(group, what: str) -> tuple[int, int]:
    """(rank, tp_size) of this process in ``group`` (None: the default group), or a clear error:
    torch.distributed not started, a group that is not a ProcessGroup, a rank outside the group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{what} needs torch.distributed started on every rank (labkit.dist.launch, "
                         "torchrun or init_process_group) before it is called")
    outside = type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER  # new_group's answer there
    if group is not None and not outside and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group={group!r} must be a torch.distributed ProcessGroup or None (the default group)")
    rank = -1 if outside else dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{what}: this process (global rank {dist.get_rank()}) is not a member of group; "
                         "call it only on the ranks of the group")
    return rank, dist.get_world_size(group)


class GroupRef:
    """A process group held by a module. A process group cannot be copied, so a deep copy of the
    module (``copy.deepcopy(model)``) shares this one: the copy talks to the same ranks."""

    __slots__ = ("group",)

    def __init__(self, group):
        self.group = group

    def __deepcopy__(self, memo):
        return self


def check_seq_divisible(seq_len: int, tp_size: int) -> None:
    """:func:`labkit.tensor_parallel.rules.check_sequence_parallel`'s divisibility, for a sequence
    that sequence parallelism splits."""
    if tp_size > 1:
        check_sequence_parallel(True, tp_size, seq_len)


def all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/t, C) on every rank -> (B, T, C): rank r's positions land at [r T/t, (r+1) T/t)."""
    t = dist.get_world_size(group)
    xt = x.transpose(0, 1).contiguous()  # (T/t, B, C): the sequence outermost, so a flat gather works
    out = all_gather_flat(xt.view(-1), t, group)  # (t * T/t * B * C,)
    return out.view(t * xt.size(0), *xt.shape[1:]).transpose(0, 1)  # (B, T, C)


def reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, C) partial sums on every rank -> rank r's (B, T/t, C) slice of their sum."""
    t = dist.get_world_size(group)
    check_seq_divisible(x.size(1), t)
    xt = x.transpose(0, 1).contiguous()  # (T, B, C)
    out = reduce_scatter_flat(xt.view(-1), t, group)  # (T/t * B * C,)
    return out.view(xt.size(0) // t, *xt.shape[1:]).transpose(0, 1)  # (B, T/t, C)


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; backward, the partial input gradients of the ranks are summed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: the ranks' partial outputs are summed forward; the gradient passes through."""

    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)  # in place: x is a fresh partial sum nobody else keeps
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceScatterToSP(torch.autograd.Function):
    """Korthikanti's g-bar: reduce-scatter partial sums forward, all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    """All-gather the last dimension forward; backward, each rank keeps its own columns' gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.rank, ctx.width = dist.get_rank(group), x.size(-1)
        t = dist.get_world_size(group)
        out = all_gather_flat(x.contiguous().view(-1), t, group)  # (t * N * V/t,)
        parts = out.view(t, *x.shape).movedim(0, -2)  # (..., t, V/t)
        return parts.reshape(*x.shape[:-1], t * x.size(-1))  # (..., V): rank r's columns at r V/t

    @staticmethod
    def backward(ctx, grad):
        start = ctx.rank * ctx.width
        return grad[..., start:start + ctx.width].contiguous(), None


def copy_to_tp(x, group):
    """Megatron's f: enters a tensor-parallel region with a replicated input."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    """Megatron's g: leaves a tensor-parallel region by summing the ranks' partial outputs."""
    return _ReduceFromTP.apply(x, group)


def reduce_scatter_to_sp(x, group):
    """Leaves a tensor-parallel region into a sequence shard (B, T, C) partial -> (B, T/t, C)."""
    return _ReduceScatterToSP.apply(x, group)


def gather_from_tp(x, group):
    """(..., V/t) column shards on every rank -> (..., V) on every rank: the logits for sampling."""
    return _GatherFromTP.apply(x, group)
