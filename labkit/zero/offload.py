"""ZeRO-Offload: the optimizer states and the optimizer step on the CPU.

Ren et al. (2021) keep the 16-bit parameters and the forward and backward passes on the GPU
and move the gradients, the fp32 master weights, the Adam moments and the update to the CPU:
each step sends this rank's gradient shard to the host as backward produces it and its
updated parameter shard back, 2Ψ/N_d elements over PCIe. Only the 2Ψ bytes of 16-bit
parameters stay on each GPU (with ZeRO-2), so one 32 GB GPU trains 13B parameters.
``OffloadOptimizer`` is stage 2 whose slices live on ``offload_device``; on a machine without a
GPU the same copies run from CPU to CPU, and :func:`labkit.zero.offload_savings` says what they
would save.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .stage2 import ShardedGradOptimizer

__all__ = ["OffloadOptimizer"]


class OffloadOptimizer(ShardedGradOptimizer):
    """ZeRO-2 with the master slices, the optimizer states and ``step`` on ``offload_device``."""

    def __init__(self, params, optimizer_cls, *, group=None, offload_device="cpu",
                 bucket_numel: int | None = 2 ** 18, init_sync: str = "broadcast", **optimizer_kwargs):
        self.offload_device = torch.device(offload_device)  # read by _new_slice while buckets are built
        super().__init__(params, optimizer_cls, group=group, bucket_numel=bucket_numel,
                         init_sync=init_sync, **optimizer_kwargs)

    def _new_slice(self, part):
        """The master slice: a copy on ``offload_device``, not a view of the device's parameters."""
        return nn.Parameter(part.to(self.offload_device, copy=True))

    def _set_slice_grad(self, bucket, i, grad_part):
        # device -> host copy of this rank's gradient slice
        super()._set_slice_grad(bucket, i, grad_part.to(bucket.slices[i].device, copy=True))

    def _gather_params(self):
        with torch.no_grad():
            for b in self._buckets:  # host -> device copy of the updated master slices
                mine = b.flat[b.start:b.start + b.S]
                for i, s in enumerate(b.slices):
                    lo, hi = b.shard_coords(i)
                    mine[lo:hi].copy_(s.detach())
        super()._gather_params()

    def state_tensors(self) -> list[torch.Tensor]:
        """The inner optimizer's states and the master slices, which live on ``offload_device``."""
        return super().state_tensors() + [s for b in self._buckets for s in b.slices]

    @torch.no_grad()
    def load_entry_values(self, values: dict) -> None:
        super().load_entry_values(values)
        for b in self._buckets:
            for name, s, (a, c) in zip(b.names, b.slices, b.bounds):
                s.copy_(values[name][a:c])
