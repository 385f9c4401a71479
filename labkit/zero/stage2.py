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

from ..collectives import FinishAfterBackward, reduce_scatter_flat
from .stage1 import ShardedOptimizer

__all__ = ["ShardedGradOptimizer"]


class ShardedGradOptimizer(ShardedOptimizer):
    """ZeRO stage 2: ``ShardedGradOptimizer(params, optimizer_cls, **optimizer_kwargs)``.

    Use it without a data-parallel wrapper: it averages the gradients itself, bucket by
    bucket (``bucket_numel`` elements at most) in the order backward produces them.
    Gradient accumulation works: shard gradients add up until ``zero_grad``. A parameter that
    gets no gradient on some ranks counts as zero there (DDP's ``find_unused_parameters``).
    """

    def __init__(self, params, optimizer_cls, *, group=None, bucket_numel: int | None = 2 ** 18,
                 init_sync: str = "broadcast", **optimizer_kwargs):
        super().__init__(params, optimizer_cls, group=group, reduce_grads=True, bucket_numel=bucket_numel,
                         init_sync=init_sync, **optimizer_kwargs)
        self._filling = {}  # bucket index -> (full gradients (P,), used flags) while backward fills it
        self._next = 0  # the bucket to reduce next: all ranks reduce them in the same order
        self._after_backward = FinishAfterBackward(self.finish_grad_sync)
        for bi, b in enumerate(self._buckets):
            for i, p in enumerate(b.params):
                p.register_post_accumulate_grad_hook(partial(self._grad_ready, bi, i))

    def _bucket_order(self, named):
        return named[::-1]  # backward reaches the last parameters first

    def _grad_ready(self, bi, i, p):
        """Backward accumulated ``p.grad``: add it into its bucket and free it."""
        self._after_backward.arm()  # whatever backward leaves unreduced is reduced at its end
        bucket = self._buckets[bi]
        if bi not in self._filling:
            self._filling[bi] = (torch.zeros_like(bucket.flat), [False] * len(bucket.params))  # (P,)
        grad_full, used = self._filling[bi]
        off, n = bucket.layout.offsets[i], p.numel()
        grad_full[off:off + n].add_(p.grad.reshape(-1))
        p.grad = None  # the full gradient lives only until its bucket is reduced
        used[i] = True
        # buckets go out in index order on every rank, whatever order they fill in here
        while self._next in self._filling and all(self._filling[self._next][1]):
            self._reduce_bucket(self._next)

    def _reduce_bucket(self, bi):
        bucket = self._buckets[bi]
        grad_full, used = self._filling.pop(bi, None) or (torch.zeros_like(bucket.flat), [False] * len(bucket.params))
        self._next = bi + 1
        grad_full.div_(self.world_size)  # the mean over ranks, as DDP takes it
        shard = reduce_scatter_flat(grad_full, self.world_size, self.group)  # (S,)
        for i, u in enumerate(used):
            lo, hi = bucket.shard_coords(i)
            # no gradient here counts as zero; another rank's gradient still reaches the slice
            if u or (hi > lo and bool(shard[lo:hi].any())):
                self._set_slice_grad(bucket, i, shard[lo:hi])

    def finish_grad_sync(self) -> None:
        """Reduce-scatter, in index order, every bucket backward has not: those with parameters
        that got no gradient on this rank (zeros stand in for them; a parameter that got none on
        any rank gets no gradient). Runs by itself at the end of backward and before ``step``."""
        if not self._filling and self._next == 0:
            return  # no backward since the last step (or zero_grad): nothing to reduce
        while self._next < len(self._buckets):
            self._reduce_bucket(self._next)
        self._next = 0  # the next backward (accumulation) starts again at bucket 0

    def slice_of(self, param):
        """This rank's slice of ``param`` (the leaf whose ``.grad`` holds its reduced shard), or None."""
        for b in self._buckets:
            for p, s in zip(b.params, b.slices):
                if p is param:
                    return s
        return None

    def _shard_grads(self):
        self.finish_grad_sync()

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none)
        self._filling, self._next = {}, 0
