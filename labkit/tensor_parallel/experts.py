"""A mixture of experts under tensor parallelism of the attention: the MoE layer replicated over "tp".

Experts are not split by t (expert_tensor_parallel_size=1; "ep" shards them): each tp rank keeps
the whole MoE layer and runs it on the same replicated input, so its parameters get the same full
gradient on every rank and need no sum over "tp". The cost: t times the layer's weights, FLOPs and
activations in a tensor-parallel group. Under sequence parallelism the (B, T/t, C) input is
gathered first (the whole sequence: one process's routing, capacity and load-balancing loss) and
each rank keeps its positions of the output; backward mirrors both. Routing the local shard alone
would spare the t-fold compute but change the capacity's N and the loss's means: not done here.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from .comm import GroupRef, all_gather_seq

__all__ = ["replicate_moe"]


class _GatherReplicated(torch.autograd.Function):
    """(B, T/t, C) -> (B, T, C) on every rank; backward: each rank holds the replicated output's
    whole gradient, so it keeps its positions' slice (no sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_positions(grad, ctx.group), None


class _KeepOwn(torch.autograd.Function):
    """(B, T, C), the same on every rank -> this rank's (B, T/t, C); backward: all-gathered."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_positions(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad.contiguous(), ctx.group), None


def _own_positions(x, group):
    t, r = dist.get_world_size(group), dist.get_rank(group)
    return x.unflatten(1, (t, -1)).select(1, r).contiguous()  # (B, T/t, C)


def _sequence_gathered(self, x):
    """The MoE layer's class forward on the gathered sequence; this rank's positions of its output."""
    group = self._tp_group.group
    return _KeepOwn.apply(type(self).forward(self, _GatherReplicated.apply(x, group)), group)


def replicate_moe(moe, group, sequence_parallel: bool):
    """Keep ``moe`` (a :class:`labkit.moe.MoE`) whole on this tensor-parallel rank; under
    ``sequence_parallel`` gather its input and keep this rank's positions of its output."""
    if sequence_parallel:
        moe._tp_group = GroupRef(group)
        moe.forward = types.MethodType(_sequence_gathered, moe)  # an instance attribute, as the TP forward
    return moe
