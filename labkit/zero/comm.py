"""ZeRO's communication piece: stage 3's gather as an autograd ``Function``.

The hook that finishes a gradient synchronisation once backward is over (``FinishAfterBackward``)
and the initial sync of the ranks (``sync_initial_state``) are the core's, shared with data
parallelism, as are the collectives themselves: :mod:`labkit.collectives`. What they move per
step, measured and analytic, is in :mod:`labkit.zero.analytic`.
"""

from __future__ import annotations

import torch

__all__ = ["AllGatherParams"]


class AllGatherParams(torch.autograd.Function):
    """Stage 3's gather of one unit: forward all-gathers the shards into the full parameters,
    backward reduce-scatters their gradients (Rajbhandari et al. 2020, Section 5.3).

    ``unit`` supplies ``gather() -> (P,)``, ``layout`` and ``reduce_scatter_grads(grad_full, used)``;
    ``slices`` are this rank's shard parameters, the leaves autograd differentiates.
    Returns one view of the gathered buffer per parameter, shaped like it.
    """

    @staticmethod
    def forward(ctx, unit, *slices):
        ctx.unit = unit
        ctx.set_materialize_grads(False)  # an unused parameter gets None, not zeros
        full = unit.gather()  # (P,) in the compute dtype
        return tuple(unit.layout.views(full))

    @staticmethod
    def backward(ctx, *grads):
        unit = ctx.unit
        used = [g is not None for g in grads]
        grad_full = unit.layout.flatten(list(grads), unit.world_size, dtype=unit.compute_dtype,
                                        device=unit.device)  # (P,), zeros where unused
        unit.reduce_scatter_grads(grad_full, used)  # launches the reduce-scatter
        return (None,) * (1 + len(grads))  # the shard gradients arrive in finish_grad_sync
