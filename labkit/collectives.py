"""Collectives every parallel technique is built from, with the group passed explicitly.

Flat all-gather and reduce-scatter of 1-D shards, an in-place all-reduce mean, broadcasting
rank 0's tensors, the check that every rank holds the same tensors, running a callback
once the current backward pass has finished (``FinishAfterBackward``), summing a backward
pass's gradients over a group when it ends (``GradSumAfterBackward``), making every rank start
from rank 0's state (``sync_initial_state``) and cutting tensors into communication buckets
(``buckets_by_numel``). Data parallelism, ZeRO (Chapter 2), tensor parallelism (Chapter 5),
context parallelism (Chapter 10) and 3D parallelism (labkit.parallel) import these; no technique
imports another. The pipeline's point-to-point sends and receives are its own.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.distributed as dist

from .validate import check_bool, check_choice, check_int

__all__ = ["all_gather_flat", "reduce_scatter_flat", "all_reduce_mean_", "broadcast_from_rank0",
           "check_same_across_ranks", "queue_after_backward", "group_src", "FinishAfterBackward",
           "GradSumAfterBackward", "INIT_SYNCS", "check_init_sync", "sync_initial_state", "buckets_by_numel"]

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single; older
# releases (Colab's torch, say) only have the old names. Both run the same c10d op.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(shard: torch.Tensor, world_size: int, group=None, out: torch.Tensor | None = None,
                    async_op: bool = False):
    """Concatenate every rank's 1-D ``shard`` (S,) into (world_size * S,) on every rank.

    Returns the output tensor, or ``(output, work)`` when ``async_op``.
    """
    check_int("world_size", world_size, 1)
    check_bool("async_op", async_op)
    if out is None:
        out = torch.empty(world_size * shard.numel(), dtype=shard.dtype, device=shard.device)
    work = _all_gather(out, shard.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_flat(full: torch.Tensor, world_size: int, group=None, out: torch.Tensor | None = None,
                        async_op: bool = False):
    """Sum (world_size * S,) tensors over ranks; rank r keeps elements [r S, (r + 1) S) as (S,).

    Returns the output tensor, or ``(output, work)`` when ``async_op``.
    """
    check_int("world_size", world_size, 1)
    check_bool("async_op", async_op)
    if full.numel() % world_size:
        raise ValueError(f"full.numel()={full.numel()} must be divisible by world_size={world_size}: pad it")
    if out is None:
        out = torch.empty(full.numel() // world_size, dtype=full.dtype, device=full.device)
    work = _reduce_scatter(out, full.contiguous(), op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return (out, work) if async_op else out


def all_reduce_mean_(t: torch.Tensor, world_size: int, group=None, async_op: bool = False):
    """Average ``t`` over ranks in place: divide by world_size first, then sum (as DDP does)."""
    check_int("world_size", world_size, 1)
    t.div_(world_size)
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def group_src(group) -> int:
    """The global rank of ``group``'s rank 0 (0 for the default group)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


@torch.no_grad()
def check_same_across_ranks(named_tensors, group=None, what: str = "parameters") -> None:
    """Raise ValueError on every rank unless all ranks hold bit-identical tensors.

    Each tensor is compared with group rank 0's copy (a broadcast per tensor, once, at wrap
    time); a flag all-reduce then tells every rank, so that all of them raise together.
    """
    named_tensors = list(named_tensors)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    first_bad = 0
    for i, (_, t) in enumerate(named_tensors):
        theirs = t.detach().clone()
        dist.broadcast(theirs, src=group_src(group), group=group)
        if first_bad == 0 and not torch.equal(theirs, t.detach()):
            first_bad = i + 1
    flags = torch.zeros(world_size, dtype=torch.int64,
                        device=named_tensors[0][1].device if named_tensors else "cpu")
    flags[rank] = first_bad
    dist.all_reduce(flags, group=group)
    bad = [(r, int(f) - 1) for r, f in enumerate(flags.tolist()) if f]
    if bad:
        r, i = bad[0]
        raise ValueError(f"module {what} differ across ranks at wrap time: {named_tensors[i][0]!r} on rank {r} "
                         f"differs from rank 0 (ranks that differ: {[b[0] for b in bad]}); build the model "
                         "with the same seed on every rank, or broadcast rank 0's parameters, before wrapping")


@torch.no_grad()
def broadcast_from_rank0(tensors, group=None) -> None:
    """Overwrite ``tensors`` on every rank with group rank 0's copy, in place (as DDP does at wrap time)."""
    src = group_src(group)
    for t in tensors:
        dist.broadcast(t.detach(), src=src, group=group)


def queue_after_backward(callback) -> None:
    """Run ``callback`` once the current backward pass has finished (as FSDP does)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# How a wrapper makes the ranks start from the same state: copy rank 0's parameters and buffers
# to every rank (torch's DistributedDataParallel does this), or refuse ranks that differ.
INIT_SYNCS = ("broadcast", "check")


def check_init_sync(init_sync: str) -> str:
    """Return ``init_sync`` if it is one of :data:`INIT_SYNCS`; else raise ValueError listing them."""
    return check_choice("init_sync", init_sync, INIT_SYNCS)


def sync_initial_state(named_params, named_buffers=(), *, group=None, init_sync: str = "broadcast") -> None:
    """Broadcast rank 0's parameters and buffers to every rank (``"broadcast"``, one collective
    per tensor), or raise ValueError on every rank if the parameters differ (``"check"``)."""
    if check_init_sync(init_sync) == "broadcast":
        broadcast_from_rank0([t for _, t in list(named_params) + list(named_buffers)], group)
    else:
        check_same_across_ranks(named_params, group)


class FinishAfterBackward:
    """``arm()`` from inside backward makes ``callback`` run once, when that backward pass ends.

    Any number of ``arm()`` calls in one pass queue the callback once (as DDP's and FSDP's
    final callbacks do); the next pass arms it again.
    """

    def __init__(self, callback):
        self.callback, self.armed = callback, False

    def arm(self) -> None:
        if not self.armed:
            self.armed = True
            queue_after_backward(self._run)

    def _run(self) -> None:
        self.armed = False
        self.callback()


class GradSumAfterBackward:
    """Sums each backward pass's gradient of ``params`` over ``group`` when that pass ends.

    A hook keeps each parameter's gradient of the pass (and ``.grad`` as it was before); at the
    end of the pass one all-reduce of them, flattened in a fixed order, gives ``.grad = before +
    sum over ranks``, so accumulating over several passes stays right. ``torch.autograd.grad``
    (which accumulates into no ``.grad``) is left alone. Sequence parallelism's norms (Chapter 5)
    and context parallelism's replicated parameters (Chapter 10) are summed so.
    """

    def __init__(self, params, group):
        self.params, self.group = [p for p in params if p.requires_grad], group
        self._local, self._before, self._accumulated, self.reductions = {}, {}, set(), 0
        self._finisher = FinishAfterBackward(self._finish)
        for i, p in enumerate(self.params):
            p.register_hook(partial(self._on_grad, i))
            p.register_post_accumulate_grad_hook(partial(self._on_accumulated, i))

    @property
    def armed(self) -> bool:
        """Whether the sum is queued to run when the current backward pass ends."""
        return self._finisher.armed

    def __deepcopy__(self, memo):
        # hooks are not deep-copied with a tensor, and a process group cannot be copied: a copied
        # model gets its own sum, on its own parameters, over the same group
        return type(self)([copy.deepcopy(p, memo) for p in self.params], self.group)

    def _on_grad(self, i, grad):
        p = self.params[i]
        self._local[i] = grad
        self._before[i] = None if p.grad is None else p.grad.detach().clone()
        self._finisher.arm()
        return grad

    def _on_accumulated(self, i, _param):
        self._accumulated.add(i)

    def _summed(self, p: torch.Tensor) -> None:
        """Called once ``p.grad`` holds the sum; a technique may note it (sequence parallelism does)."""

    def _added(self, i, p) -> torch.Tensor:
        """What this pass added to ``p.grad``: another sum that ended first (sequence parallelism's
        over "tp" before context parallelism's over "cp") is in it, so the two sums compose."""
        if i in self._accumulated and p.grad is not None:
            before = self._before.get(i)
            return p.grad if before is None else p.grad - before
        return self._local[i] if i in self._local else torch.zeros_like(p)

    @torch.no_grad()
    def _finish(self) -> None:
        flat = torch.cat([self._added(i, p).reshape(-1) for i, p in enumerate(self.params)])  # (n,): one size
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for i, p in enumerate(self.params):
            total = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if i in self._accumulated and p.grad is not None:
                before = self._before.get(i)
                p.grad.copy_(total if before is None else before + total)
                self._summed(p)
        self._local, self._before, self._accumulated = {}, {}, set()
        self.reductions += 1


def buckets_by_numel(items, numel, bucket_numel: int | None) -> list[list]:
    """Consecutive runs of ``items`` of at most ``bucket_numel`` elements each (``numel(item)``);
    an item larger than that gets a bucket of its own; None: one bucket for everything."""
    buckets, current, size = [], [], 0
    for item in items:
        n = numel(item)
        if current and bucket_numel is not None and size + n > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(item)
        size += n
    return buckets + ([current] if current else [])
