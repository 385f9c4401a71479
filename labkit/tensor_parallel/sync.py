"""The end-of-backward sum of the gradients of parameters used on sequence shards.

Under sequence parallelism the LayerNorms, the row-parallel biases and the position embeddings
see T/t positions on each rank, so each rank's gradient is a partial sum (Korthikanti et al.
2022, Section 4.2.2). :class:`SequenceParallelGradSync` sums them over the group by itself,
in one all-reduce at the end of every backward pass, as labkit's DDP does with its hook: a
plain ``zero_grad(); loss.backward(); optimizer.step()`` is then correct, with or without
gradient accumulation over several backward passes.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.distributed as dist

from ..collectives import queue_after_backward
from .comm import GroupRef

__all__ = ["SequenceParallelGradSync", "sync_sequence_parallel_grads", "is_reduced", "mark_reduced"]


def mark_reduced(p: torch.Tensor) -> None:
    """Remember that ``p.grad``, as it is now, already holds the sum over the group."""
    p._sp_reduced = (p.grad.data_ptr(), p.grad._version)


def is_reduced(p: torch.Tensor) -> bool:
    """Whether ``p.grad`` is unchanged since :func:`mark_reduced` (accumulating changes it)."""
    return p.grad is None or getattr(p, "_sp_reduced", None) == (p.grad.data_ptr(), p.grad._version)


class SequenceParallelGradSync:
    """Sums each backward pass's gradient of ``params`` over ``group`` when that pass ends.

    A hook keeps each parameter's gradient of the pass (and ``.grad`` as it was before); at the
    end of the pass one all-reduce of them, flattened in a fixed order, gives ``.grad = before +
    sum over ranks``, the unsharded model's accumulation. ``torch.autograd.grad`` is left alone.
    """

    def __init__(self, params, group):
        self.params, self._group = list(params), GroupRef(group)
        self._local, self._before, self._accumulated = {}, {}, set()
        self.armed, self.reductions = False, 0
        for i, p in enumerate(self.params):
            p.register_hook(partial(self._on_grad, i))
            p.register_post_accumulate_grad_hook(partial(self._on_accumulated, i))

    def __deepcopy__(self, memo):
        # hooks are not deep-copied with a tensor: a copied model gets its own, on its own parameters
        return SequenceParallelGradSync([copy.deepcopy(p, memo) for p in self.params], self._group.group)

    def _on_grad(self, i, grad):
        p = self.params[i]
        self._local[i] = grad
        self._before[i] = None if p.grad is None else p.grad.detach().clone()
        if not self.armed:
            self.armed = True
            queue_after_backward(self._finish)
        return grad

    def _on_accumulated(self, i, _param):
        self._accumulated.add(i)

    @torch.no_grad()
    def _finish(self) -> None:
        self.armed = False
        if not self._local:
            return  # every rank of the group runs the same backward: all of them return here
        flat = torch.cat([self._local[i].reshape(-1) if i in self._local else torch.zeros_like(p).reshape(-1)
                          for i, p in enumerate(self.params)])  # (n,): a fixed size on every rank
        dist.all_reduce(flat, group=self._group.group)
        offset = 0
        for i, p in enumerate(self.params):
            total = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if i in self._accumulated and p.grad is not None:
                before = self._before.get(i)
                p.grad.copy_(total if before is None else before + total)
                mark_reduced(p)
        self._local, self._before, self._accumulated = {}, {}, set()
        self.reductions += 1


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
