"""ZeRO's communication pieces: stage 3's gather as an autograd ``Function``, and the hook that
finishes a gradient synchronisation once backward is over.

``sync_initial_state`` makes every rank start from rank 0's parameters (or checks that they do).
The collectives themselves are the core's (:mod:`labkit.collectives`); what they move per step,
measured and analytic, is in :mod:`labkit.zero.analytic`.
"""

from __future__ import annotations

import torch

from ..collectives import broadcast_from_rank0, check_same_across_ranks, queue_after_backward
from ..validate import check_choice

__all__ = ["AllGatherParams", "FinishAfterBackward", "INIT_SYNCS", "check_init_sync", "sync_initial_state"]

# How a wrapper makes the ranks start from the same state: copy rank 0's parameters and buffers
# to every rank (torch's DistributedDataParallel does this), or refuse ranks that differ.
INIT_SYNCS = ("broadcast", "check")


def check_init_sync(init_sync: str) -> str:
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
