"""The end-of-backward sum of the gradients of parameters used on sequence shards.

Under sequence parallelism the LayerNorms, the row-parallel biases and the position embeddings
see T/t positions on each rank, so each rank's gradient is a partial sum (Korthikanti et al.
2022, Section 4.2.2). :class:`SequenceParallelGradSync` sums them over the group by itself,
in one all-reduce at the end of every backward pass, as labkit's DDP does with its hook: a
plain ``zero_grad(); loss.backward(); optimizer.step()`` is then correct, with or without
gradient accumulation over several backward passes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives import GradSumAfterBackward

__all__ = ["SequenceParallelGradSync", "sync_sequence_parallel_grads", "is_reduced", "mark_reduced"]


def mark_reduced(p: torch.Tensor) -> None:
    """Remember that ``p.grad``, as it is now, already holds the sum over the group."""
    p._sp_reduced = (p.grad.data_ptr(), p.grad._version)


def is_reduced(p: torch.Tensor) -> bool:
    """Whether ``p.grad`` is unchanged since :func:`mark_reduced` (accumulating changes it)."""
    return p.grad is None or getattr(p, "_sp_reduced", None) == (p.grad.data_ptr(), p.grad._version)


class SequenceParallelGradSync(GradSumAfterBackward):
    """Sums each backward pass's gradient of ``params`` over ``group`` when that pass ends
    (labkit.collectives' :class:`GradSumAfterBackward`), and marks each summed ``.grad``
    (:func:`mark_reduced`), so that :func:`sync_sequence_parallel_grads` does not sum it again."""

    def _summed(self, p: torch.Tensor) -> None:
        mark_reduced(p)


@torch.no_grad()
def sync_sequence_parallel_grads(model: torch.nn.Module, group) -> None:
    """Sum over ``group`` the gradients of ``model``'s sequence-parallel parameters not yet summed.

    ``apply_tensor_parallel`` does this by itself at the end of each backward pass, so calling it
    again changes nothing; it serves layers used outside ``apply_tensor_parallel``.
    """
    grads = [p for p in model.parameters()
             if getattr(p, "sequence_parallel", False) and p.grad is not None and not is_reduced(p)]
    if not grads:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in grads])  # (n,)
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in grads:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()
        mark_reduced(p)
