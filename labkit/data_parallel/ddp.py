"""Plain data parallelism, the baseline ZeRO removes the redundancy of.

Every rank holds the whole model and optimizer; after backward the gradients are averaged
with all-reduce, 2Ψ elements per rank per step. ``DataParallelNaive`` all-reduces each
gradient on its own, as soon as backward produces it, and waits for it. ``DataParallelBucketed``
copies gradients into buckets of about ``bucket_numel`` elements and launches an asynchronous
all-reduce as soon as a bucket is complete, so communication overlaps the rest of backward
(Li et al. 2020, the design of torch's DistributedDataParallel). Both start every rank from
rank 0's parameters and buffers, and skip the all-reduce inside ``no_sync()``, as DDP does.
``all_reduce_grads()`` averages, at once, what backward passes inside ``no_sync()`` accumulated:
for a step whose backward is several autograd calls (a pipeline schedule runs one per
micro-batch and chunk), as :mod:`labkit.parallel` composes it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from ..collectives import FinishAfterBackward, all_reduce_mean_, buckets_by_numel, sync_initial_state
from ..validate import check_int

__all__ = ["DataParallelNaive", "DataParallelBucketed"]


class _DataParallel(nn.Module):
    """What both variants share: the wrapped module, the initial sync, ``no_sync``."""

    def __init__(self, module: nn.Module, group, init_sync: str):
        super().__init__()
        self.module, self.group = module, group
        self.world_size = dist.get_world_size(group)
        sync_initial_state(module.named_parameters(), module.named_buffers(), group=group, init_sync=init_sync)
        self._sync = True

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_buckets(self) -> list[list[nn.Parameter]]:
        """The parameters whose gradients are averaged together, one list per collective."""
        return [[p] for p in self.module.parameters() if p.requires_grad]

    @torch.no_grad()
    def all_reduce_grads(self) -> None:
        """Average every gradient over the group now, one collective per bucket, waiting for them.

        For gradients accumulated inside ``no_sync()``; every rank of the group must hold
        gradients for the same parameters (a parameter without one is skipped, on every rank).
        """
        works = []
        for params in self._grad_buckets():
            held = [p for p in params if p.grad is not None]
            if held:
                flat = torch.cat([p.grad.reshape(-1) for p in held])
                works.append((held, flat, all_reduce_mean_(flat, self.world_size, self.group, async_op=True)))
        for held, flat, work in works:
            work.wait()
            for p, part in zip(held, flat.split([p.numel() for p in held])):
                p.grad.copy_(part.view_as(p.grad))

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate local gradients; the first one outside
        all-reduces the sum (gradient accumulation, Chapter 4)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous


class DataParallelNaive(_DataParallel):
    """All-reduce every parameter's gradient, one synchronous collective per parameter."""

    def __init__(self, module: nn.Module, *, group=None, init_sync: str = "broadcast"):
        super().__init__(module, group, init_sync)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._all_reduce)

    def _all_reduce(self, p):
        if self._sync:
            all_reduce_mean_(p.grad, self.world_size, self.group)

    def finish_grad_sync(self) -> None:
        """Nothing is left in flight: every all-reduce finished inside backward."""


class DataParallelBucketed(_DataParallel):
    """Bucketed, overlapped all-reduce; the gradients end up as views of the buckets.

    Parameters fill buckets in reverse order, the order backward produces their gradients.
    ``launched_in_backward`` counts the buckets whose all-reduce started while backward ran.
    """

    def __init__(self, module: nn.Module, *, group=None, bucket_numel: int = 2 ** 18,
                 init_sync: str = "broadcast"):
        check_int("bucket_numel", bucket_numel, 1)
        super().__init__(module, group, init_sync)
        params = [p for p in module.parameters() if p.requires_grad]
        self._buckets = buckets_by_numel(params[::-1], torch.Tensor.numel, bucket_numel)
        self._where = {id(p): (b, i) for b, ps in enumerate(self._buckets) for i, p in enumerate(ps)}
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        self._after_backward = FinishAfterBackward(self.finish_grad_sync)
        self._reset()
        self.launched_in_backward = 0

    def _grad_buckets(self) -> list[list[nn.Parameter]]:
        return self._buckets

    def _reset(self):
        self._flat = [None] * len(self._buckets)  # (Σ numel,) per bucket while it fills
        self._ready = [set() for _ in self._buckets]
        self._works = []

    def _grad_ready(self, p):
        if not self._sync:
            return  # no_sync: the gradient accumulates in p.grad until a synced backward
        self._after_backward.arm()
        b, i = self._where[id(p)]
        params = self._buckets[b]
        if self._flat[b] is None:
            self._flat[b] = torch.zeros(sum(q.numel() for q in params), dtype=p.dtype, device=p.device)
        off = sum(q.numel() for q in params[:i])
        view = self._flat[b][off:off + p.numel()].view_as(p)
        view.copy_(p.grad)
        p.grad = view  # the gradient is now a view of the bucket
        self._ready[b].add(i)
        if len(self._ready[b]) == len(params):
            self._launch(b)
            self.launched_in_backward += 1

    def _launch(self, b):
        self._works.append(all_reduce_mean_(self._flat[b], self.world_size, self.group, async_op=True))
        self._flat[b] = None  # the gradients (views) keep the bucket alive

    def finish_grad_sync(self) -> None:
        """Launch the buckets that backward left incomplete and wait for every all-reduce.

        Runs by itself at the end of backward.
        """
        for b, flat in enumerate(self._flat):
            if flat is not None:
                self._launch(b)
        for work in self._works:
            work.wait()
        self._reset()
