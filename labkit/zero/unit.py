"""ZeRO-3's unit (:mod:`labkit.zero.stage3`): one flat shard of a group of parameters, gathered
for forward and backward, its gradients reduce-scattered back; and what autograd saves of a
gathered parameter in its place (a handle)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..collectives import all_gather_flat, reduce_scatter_flat
from .comm import AllGatherParams
from .flat import FlatLayout, param_slice, shard_numel

__all__ = ["Unit", "Handle"]


class Unit:
    """One unit's parameters: a flat shard (S,) in the master dtype and a view of it per parameter.

    ``refs[i]`` lists the (module, attribute) pairs through which parameter i is read;
    ``after_backward.arm()`` is called whenever backward reaches the unit; the gradient summed over
    ``group`` is divided by ``divisor`` (default: the group's size, the mean).
    """

    def __init__(self, name, named_params, refs, group, compute_dtype, after_backward, divisor=None):
        names, params = [n for n, _ in named_params], [p for _, p in named_params]
        self.name, self.names, self.refs, self.group = name, names, refs, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.divisor = self.world_size if divisor is None else divisor  # the gradient's: the mean by default
        self.after_backward = after_backward
        self.layout = FlatLayout.of(names, params)
        self.S = shard_numel(self.layout.numel, self.world_size)
        start = self.rank * self.S
        with torch.no_grad():
            flat = self.layout.flatten([p.detach() for p in params], self.world_size)  # (P,)
            self.shard = flat[start:start + self.S].clone()  # (S,)
        self.device, self.master_dtype = self.shard.device, self.shard.dtype
        self.compute_dtype = compute_dtype or self.master_dtype
        self.bounds, self.slices = [], []
        for p, off, n in zip(params, self.layout.offsets, self.layout.numels()):
            a, b = param_slice(off, n, start, start + self.S)
            self.bounds.append((a, b))
            lo = off + a - start
            self.slices.append(nn.Parameter(self.shard[lo:lo + b - a], requires_grad=p.requires_grad))
        self.requires_grad = any(p.requires_grad for p in params)
        self.full_bwd = None  # the parameters gathered again for backward
        self.depth = 0  # how many enclosing calls have the parameters gathered on the modules
        self.pending = []  # (work, shard gradient, full gradient kept alive, used) per reduce-scatter

    def gather(self) -> torch.Tensor:
        """All-gather the full flat parameters (P,) in the compute dtype (no autograd)."""
        send = self.shard if self.compute_dtype == self.master_dtype else self.shard.to(self.compute_dtype)
        return all_gather_flat(send.detach(), self.world_size, self.group)

    def pre_forward(self) -> int:
        """Gather the parameters and put them on their modules; returns their storage's address."""
        if torch.is_grad_enabled() and self.requires_grad:
            views = AllGatherParams.apply(self, *self.slices)
        else:
            with torch.no_grad():
                views = self.layout.views(self.gather())
        for view, refs in zip(views, self.refs):
            for module, attr in refs:
                module.__dict__[attr] = view
        return views[0].untyped_storage().data_ptr()

    def post_forward(self):
        """Drop every reference to the gathered parameters: saved tensors hold handles only."""
        for refs in self.refs:
            for module, attr in refs:
                module.__dict__[attr] = None

    def full_for_backward(self) -> torch.Tensor:
        self.after_backward.arm()
        if self.full_bwd is None:
            with torch.no_grad():
                self.full_bwd = self.gather()
        return self.full_bwd

    def reduce_scatter_grads(self, grad_full, used):
        """Called by AllGatherParams.backward: free the parameters, launch the reduce-scatter."""
        self.after_backward.arm()
        self.full_bwd = None
        grad_full.div_(self.divisor)  # the mean over ranks, as DDP takes it (unless told otherwise)
        shard, work = reduce_scatter_flat(grad_full, self.world_size, self.group, async_op=True)
        self.pending.append((work, shard, grad_full, used))

    def finish(self):
        """Wait for the reduce-scatters; add each slice's gradient (fp32) to its ``.grad``."""
        for work, shard, _, used in self.pending:
            work.wait()
            shard = shard.to(self.master_dtype)
            for s, u, (a, b), off in zip(self.slices, used, self.bounds, self.layout.offsets):
                if u and s.requires_grad:
                    lo = off + a - self.rank * self.S
                    part = shard[lo:lo + b - a]
                    s.grad = part if s.grad is None else s.grad.add_(part)
        self.pending, self.full_bwd = [], None


class Handle:
    """What autograd keeps of a saved gathered parameter: its unit and its geometry."""

    __slots__ = ("unit", "size", "stride", "offset")

    def __init__(self, unit, t):
        self.unit, self.size, self.stride, self.offset = unit, t.size(), t.stride(), t.storage_offset()
