"""ZeRO stage 2: the gradients are sharded too.

As soon as backward has produced every gradient of a bucket, the bucket is reduce-scattered
and the full gradients are freed: each rank keeps only the averaged gradients of its own
slices (Rajbhandari et al. 2020, Section 5.2: P_os+g, 2Ψ + 14Ψ/N_d bytes with mixed
precision). The step is stage 1's: the inner optimizer on the slices, then an all-gather.
Communication stays 2Ψ: Ψ reduce-scattered in backward, Ψ all-gathered after the step.
"""

from __future__ import annotations

from functools import partial

import torch

from .comm import queue_after_backward, reduce_scatter_flat
from .stage1 import ShardedOptimizer

__all__ = ["ShardedGradOptimizer"]


class ShardedGradOptimizer(ShardedOptimizer):
    """ZeRO stage 2: ``ShardedGradOptimizer(params, optimizer_cls, **optimizer_kwargs)``.

    Use it without a data-parallel wrapper: it averages the gradients itself, bucket by
    bucket (``bucket_numel`` elements at most) in the order backward produces them.
    Gradient accumulation works: shard gradients add up until ``zero_grad``. As for DDP
    without ``find_unused_parameters``, a parameter must get a gradient on all ranks or none.
    """

    _reverse_buckets = True  # backward reaches the last parameters first

    def __init__(self, params, optimizer_cls, *, group=None, bucket_numel: int | None = 2 ** 18,
                 offload_device=None, **optimizer_kwargs):
        super().__init__(params, optimizer_cls, group=group, reduce_grads=True, bucket_numel=bucket_numel,
                         offload_device=offload_device, **optimizer_kwargs)
        self._hooks = [p.register_post_accumulate_grad_hook(partial(self._grad_ready, b, i))
                       for b in self._buckets for i, p in enumerate(b.params)]
        self._callback_queued = False

    def _grad_ready(self, bucket, i, p):
        """Backward accumulated ``p.grad``: move it into the bucket and free it."""
        if not self._callback_queued:  # whatever backward leaves unreduced, reduce at its end
            queue_after_backward(self.finish_grad_sync)
            self._callback_queued = True
        if bucket.grad_full is None:
            bucket.grad_full = torch.zeros_like(bucket.flat)  # (P,)
            bucket.used = [False] * len(bucket.params)
        off, n = bucket.layout.offsets[i], p.numel()
        bucket.grad_full[off:off + n].add_(p.grad.reshape(-1))
        p.grad = None  # the full gradient lives only until its bucket is reduced
        bucket.used[i] = True
        if all(bucket.used):
            self._reduce_bucket(bucket)

    def _reduce_bucket(self, bucket):
        flat_grad = bucket.grad_full.div_(self.world_size)  # the mean over ranks, as DDP takes it
        shard = reduce_scatter_flat(flat_grad, self.world_size, self.group)  # (S,)
        for i, used in enumerate(bucket.used):
            if used:
                lo, hi = bucket.shard_coords(i)
                self._set_slice_grad(bucket, i, shard[lo:hi])
        bucket.grad_full, bucket.used = None, None

    def finish_grad_sync(self) -> None:
        """Reduce-scatter the buckets that backward left incomplete (parameters without a
        gradient); runs by itself at the end of backward and again before ``step``."""
        self._callback_queued = False
        for b in self._buckets:
            if b.grad_full is not None:
                self._reduce_bucket(b)

    def _shard_grads(self):
        self.finish_grad_sync()

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the parameters."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
