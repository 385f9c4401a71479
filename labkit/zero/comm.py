"""The collectives ZeRO is built from, and what they move.

Pure functions over ``torch.distributed`` with the group passed explicitly, the autograd
``Function`` that gathers a stage-3 unit's parameters (all-gather forward, reduce-scatter
backward), the check that every rank starts from the same parameters, and the communication
volume of a step: measured (from :class:`labkit.dist.CommCounter`) and analytic
(Rajbhandari et al. 2020, Section 7: 2Ψ for data parallelism and stages 1-2, 3Ψ for stage 3).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives import (all_gather_flat, all_reduce_mean_, check_same_across_ranks,
                           queue_after_backward, reduce_scatter_flat)
from .flat import padded_numel

__all__ = ["all_gather_flat", "reduce_scatter_flat", "all_reduce_mean_", "check_same_across_ranks",
           "AllGatherParams", "VOLUME_WEIGHT", "comm_volume", "analytic_comm_volume", "queue_after_backward"]

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


# -- communication volume -------------------------------------------------------------------

# Elements moved per rank, per element of the full-size tensor (the paper's convention: an
# all-reduce is a reduce-scatter plus an all-gather; the (N-1)/N factor of a ring is dropped).
VOLUME_WEIGHT = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1}


def comm_volume(numel_by_kind: dict) -> int:
    """Elements a rank communicated, from a CommCounter's ``stats.numel`` (2 per all-reduced one)."""
    unknown = set(k for k, v in numel_by_kind.items() if v) - set(VOLUME_WEIGHT)
    if unknown:
        raise ValueError(f"numel_by_kind has collectives {sorted(unknown)}; "
                         f"valid kinds: {sorted(VOLUME_WEIGHT)}")
    return sum(VOLUME_WEIGHT[k] * v for k, v in numel_by_kind.items())


def analytic_comm_volume(n_params: int, stage: int, world_size: int = 1, group_numels=None) -> int:
    """Elements each rank communicates per step: 2Ψ for stages 0-2 (an all-reduce, or a
    reduce-scatter plus an all-gather), 3Ψ for stage 3 (a second all-gather in backward).

    ``group_numels``: the sizes of the flat groups a sharded stage pads separately to multiples
    of ``world_size``; with them the padded Ψ is used (stage 0 never pads).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} must be one of [0, 1, 2, 3]")
    if not isinstance(n_params, int) or isinstance(n_params, bool) or n_params < 0:
        raise ValueError(f"n_params={n_params!r} must be an int >= 0")
    psi = n_params
    if group_numels is not None and stage > 0:
        group_numels = list(group_numels)
        if sum(group_numels) != n_params:
            raise ValueError(f"group_numels sum to {sum(group_numels)}, not n_params={n_params}")
        psi = sum(padded_numel(n, world_size) for n in group_numels)
    return (3 if stage == 3 else 2) * psi
