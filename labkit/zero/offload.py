"""ZeRO-Offload: the optimizer states and the optimizer step on the CPU.

Ren et al. (2021) keep the 16-bit parameters and the forward and backward passes on the GPU
and move the gradients, the fp32 master weights, the Adam moments and the update to the CPU:
each step sends this rank's gradient shard to the host as backward produces it and its
updated parameter shard back, 2Ψ/N_d elements over PCIe. Only the 2Ψ bytes of 16-bit
parameters stay on each GPU (with ZeRO-2), so one 32 GB GPU trains 13B parameters.
``OffloadOptimizer`` is stage 2 with its slices on ``offload_device``; on a machine without a
GPU the same copies run from CPU to CPU, and :func:`offload_savings` says what they would save.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory.analytic import zero_model_state_bytes
from ..precision import _check
from .flat import shard_numel
from .stage2 import ShardedGradOptimizer

__all__ = ["OffloadOptimizer", "OffloadSavings", "offload_savings"]


class OffloadOptimizer(ShardedGradOptimizer):
    """ZeRO-2 with the master slices, the optimizer states and ``step`` on ``offload_device``."""

    def __init__(self, params, optimizer_cls, *, group=None, offload_device="cpu",
                 bucket_numel: int | None = 2 ** 18, **optimizer_kwargs):
        super().__init__(params, optimizer_cls, group=group, bucket_numel=bucket_numel,
                         offload_device=offload_device, **optimizer_kwargs)


@dataclass(frozen=True)
class OffloadSavings:
    """Per-rank bytes: on the GPU with and without offload, on the CPU, and over PCIe per step."""

    gpu_bytes_without: int
    gpu_bytes_with: int
    cpu_bytes: int
    pcie_bytes_per_step: int

    @property
    def saved_fraction(self) -> float:
        return 1 - self.gpu_bytes_with / self.gpu_bytes_without


def offload_savings(n_params: int, world_size: int = 1, precision: str = "mixed",
                    optimizer: str = "adam") -> OffloadSavings:
    """What offloading a ZeRO-2 run saves on each GPU (Ren et al. 2021).

    The gradient shard and the optimizer bytes (master weights and states) move to the CPU;
    per step the gradient shard goes down and the parameter shard comes back, both in the
    parameters' dtype. Model states only: activations and transient buckets come on top.
    """
    _check(precision, optimizer)
    zero2 = zero_model_state_bytes(n_params, world_size, 2, precision, optimizer)
    elem = 4 if precision == "fp32" else 2
    return OffloadSavings(gpu_bytes_without=zero2.total, gpu_bytes_with=zero2.params,
                          cpu_bytes=zero2.grads + zero2.optimizer,
                          pcie_bytes_per_step=2 * elem * shard_numel(n_params, world_size))
