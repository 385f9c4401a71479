"""One accumulation window on one process: k micro-batches, one optimizer step (Chapter 4).

The window-normalised loss divides each micro-batch's summed token loss by the window's token
count N, exact for any lengths and padding; the naive variant averages the k micro-batch means
(the 2024 bug). Padding is marked in the targets by ``ignore_index`` (default -100, as
``F.cross_entropy`` and :func:`labkit.data.get_padded_batch` use).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..validate import check_int
from .analytic import naive_loss_scales

__all__ = ["IGNORE_INDEX", "split_microbatches", "count_tokens", "token_loss_sum", "accumulate_gradients",
           "accumulate_gradients_naive", "accumulation_step", "accumulation_step_naive"]

IGNORE_INDEX = -100  # target value of padding: no loss, not counted


def split_microbatches(x: torch.Tensor, y: torch.Tensor, num_microbatches: int) -> list[tuple]:
    """Split x, y (B, ...) along the batch into k = ``num_microbatches`` pieces.

    Sizes differ by at most one when k does not divide B (``torch.tensor_split``).
    """
    check_int("num_microbatches", num_microbatches, 1)
    if num_microbatches > x.size(0):
        raise ValueError(f"num_microbatches={num_microbatches} must be <= batch size {x.size(0)}: "
                         "a micro-batch needs at least one sample")
    if x.size(0) != y.size(0):
        raise ValueError(f"x has {x.size(0)} samples but y has {y.size(0)}")
    return list(zip(x.tensor_split(num_microbatches), y.tensor_split(num_microbatches)))


def count_tokens(y: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """Number of real targets in y: entries != ``ignore_index``."""
    return int((y != ignore_index).sum())


def token_loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                   ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Σ_t ℓ_t: the summed cross-entropy of the real tokens; ``model(x)`` gives logits (B, T, V)."""
    logits = model(x)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=ignore_index, reduction="sum")


def _window_tokens(microbatches, ignore_index) -> int:
    n = sum(count_tokens(y, ignore_index) for _, y in microbatches)
    if n == 0:
        raise ValueError("the accumulation window has no real tokens: every target is ignore_index")
    return n


def _accumulate(model, microbatches, scales, sync_context, ignore_index) -> float:
    """Backward of scale_i · Σ_{t∈i} ℓ_t for each micro-batch i; returns Σ_i of those losses."""
    total = None
    for i, ((x, y), scale) in enumerate(zip(microbatches, scales)):
        with sync_context(i):
            loss = token_loss_sum(model, x, y, ignore_index) * scale
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()  # no host sync per step
    return float(total)


def _no_context(_i):
    return contextlib.nullcontext()


def accumulate_gradients(model: nn.Module, microbatches, ignore_index: int = IGNORE_INDEX) -> float:
    """Add to ``.grad`` the gradient of L = (1/N) Σ_i Σ_{t∈i} ℓ_t over the window; return L.

    Each micro-batch's summed token loss is divided by the window's token count N, so the
    result equals one step on the whole batch for any lengths and padding.
    """
    n = _window_tokens(microbatches, ignore_index)
    return _accumulate(model, microbatches, [1.0 / n] * len(microbatches), _no_context, ignore_index)


def accumulate_gradients_naive(model: nn.Module, microbatches, ignore_index: int = IGNORE_INDEX) -> float:
    """The naive window (the 2024 bug): L_naive = (1/k) Σ_i (1/N_i) Σ_{t∈i} ℓ_t; return it.

    A token of micro-batch i weighs N / (k N_i) times its correct weight: short micro-batches
    count too much. Equal to :func:`accumulate_gradients` only when every N_i = N / k.
    """
    counts = [count_tokens(y, ignore_index) for _, y in microbatches]
    if 0 in counts:
        raise ValueError(f"micro-batch {counts.index(0)} has no real tokens: its mean is undefined")
    return _accumulate(model, microbatches, naive_loss_scales(counts), _no_context, ignore_index)


def accumulation_step(model, optimizer, x, y, num_microbatches: int, ignore_index: int = IGNORE_INDEX) -> float:
    """One optimizer step on batch x, y (B, T) in k micro-batches, window-normalised; returns the loss."""
    microbatches = split_microbatches(x, y, num_microbatches)
    optimizer.zero_grad(set_to_none=True)
    loss = accumulate_gradients(model, microbatches, ignore_index)
    optimizer.step()
    return loss


def accumulation_step_naive(model, optimizer, x, y, num_microbatches: int,
                            ignore_index: int = IGNORE_INDEX) -> float:
    """:func:`accumulation_step` with the naive per-micro-batch mean; returns the naive loss."""
    microbatches = split_microbatches(x, y, num_microbatches)
    optimizer.zero_grad(set_to_none=True)
    loss = accumulate_gradients_naive(model, microbatches, ignore_index)
    optimizer.step()
    return loss
