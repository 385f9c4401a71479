"""Plain data parallelism, the baseline ZeRO removes the redundancy of.

Every rank holds the whole model and optimizer; after backward the gradients are averaged
with all-reduce, 2Ψ elements per rank per step. ``DataParallelNaive`` all-reduces each
gradient on its own, as soon as backward produces it, and waits for it. ``DataParallelBucketed``
copies gradients into buckets of about ``bucket_numel`` elements and launches an asynchronous
all-reduce as soon as a bucket is complete, so communication overlaps the rest of backward
(Li et al. 2020, the design of torch's DistributedDataParallel).
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn as nn

from .comm import all_reduce_mean_, check_same_across_ranks, queue_after_backward

__all__ = ["DataParallelNaive", "DataParallelBucketed"]


class DataParallelNaive(nn.Module):
    """All-reduce every parameter's gradient, one synchronous collective per parameter."""

    def __init__(self, module: nn.Module, *, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.world_size = dist.get_world_size(group)
        check_same_across_ranks(module.named_parameters(), group)
        self._hooks = [p.register_post_accumulate_grad_hook(self._all_reduce)
                       for p in module.parameters() if p.requires_grad]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _all_reduce(self, p):
        all_reduce_mean_(p.grad, self.world_size, self.group)

    def finish_grad_sync(self) -> None:
        """Nothing is left in flight: every all-reduce finished inside backward."""


class DataParallelBucketed(nn.Module):
    """Bucketed, overlapped all-reduce; the gradients end up as views of the buckets.

    Parameters fill buckets in reverse order, the order backward produces their gradients.
    ``launched_in_backward`` counts the buckets whose all-reduce started while backward ran.
    """

    def __init__(self, module: nn.Module, *, group=None, bucket_numel: int = 2 ** 18):
        super().__init__()
        if not isinstance(bucket_numel, int) or bucket_numel < 1:
            raise ValueError(f"bucket_numel={bucket_numel!r} must be an int >= 1")
        self.module, self.group = module, group
        self.world_size = dist.get_world_size(group)
        check_same_across_ranks(module.named_parameters(), group)
        params = [p for p in module.parameters() if p.requires_grad]
        self._buckets, current, size = [], [], 0
        for p in reversed(params):
            if current and size + p.numel() > bucket_numel:
                self._buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel()
        if current:
            self._buckets.append(current)
        self._where = {id(p): (b, i) for b, ps in enumerate(self._buckets) for i, p in enumerate(ps)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        self._reset()
        self.launched_in_backward = 0

    def _reset(self):
        self._flat = [None] * len(self._buckets)  # (Σ numel,) per bucket while it fills
        self._ready = [set() for _ in self._buckets]
        self._works = []
        self._callback_queued = False

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, p):
        if not self._callback_queued:
            queue_after_backward(self.finish_grad_sync)
            self._callback_queued = True
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
