"""Chapter 4's formulas: the loss scale of each micro-batch, the naive window's token weights,
and the number of micro-steps of a global batch. Pure Python, no torch.

Notation: k micro-batches, N_i real tokens in micro-batch i, N = sum_i N_i in the window.
"""

from __future__ import annotations

from ..validate import check_int

__all__ = ["window_loss_scales", "naive_loss_scales", "naive_token_weights", "num_microbatches"]


def _counts(counts) -> list[int]:
    counts = [check_int(f"counts[{i}]", n, 0) for i, n in enumerate(counts)]
    if not counts:
        raise ValueError("counts=[] must hold the real-token count N_i of at least one micro-batch")
    return counts


def window_loss_scales(counts) -> list[float]:
    """1 / N for every micro-batch: sum_i (1/N) sum_{t in i} l_t is the full batch's mean loss."""
    counts = _counts(counts)
    if sum(counts) == 0:
        raise ValueError(f"counts={counts} has no real tokens: the window's mean loss is undefined")
    return [1.0 / sum(counts)] * len(counts)


def naive_loss_scales(counts) -> list[float]:
    """1 / (k N_i): the naive window, the mean of the k micro-batch means."""
    counts = _counts(counts)
    if 0 in counts:
        raise ValueError(f"micro-batch {counts.index(0)} has no real tokens (counts={counts}): "
                         "its mean is undefined")
    return [1.0 / (len(counts) * n) for n in counts]


def naive_token_weights(counts) -> list[float]:
    """N / (k N_i): a token's weight in the naive window relative to its correct weight 1 / N."""
    counts = _counts(counts)
    return [sum(counts) * s for s in naive_loss_scales(counts)]


def num_microbatches(global_batch_size: int, micro_batch_size: int) -> int:
    """k = ceil(B / b): micro-steps that make up a global batch of B at micro-batch b."""
    check_int("global_batch_size", global_batch_size, 1)
    check_int("micro_batch_size", micro_batch_size, 1)
    return -(-global_batch_size // micro_batch_size)
