"""Gradient accumulation: one large batch as k micro-batches and one optimizer step (Chapter 4).

The window-normalised loss, exact for token losses of any lengths, stands next to the naive
mean per micro-batch (the 2024 bug); a micro-batch size is chosen from a memory budget; under
DDP the gradients are all-reduced once per window (``no_sync``) or, naively, every micro-step.
Notation: k = ``num_microbatches``, N_i = real tokens of micro-batch i, N = Σ_i N_i.

Padding is marked in the *targets* by ``ignore_index`` (default -100, as ``F.cross_entropy`` and
:func:`labkit.data.get_padded_batch` use): such positions carry no loss and are not counted in N.
Every function here takes ``ignore_index``; a caller who pads targets with another value (0, say)
must pass it, or the padding counts as real tokens and the loss is silently wrong.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .memory.meter import MemoryMeter, MemoryReport, train_step
from .validate import check_int

__all__ = [
    "IGNORE_INDEX", "split_microbatches", "count_tokens", "token_loss_sum",
    "accumulate_gradients", "accumulate_gradients_naive", "accumulation_step", "accumulation_step_naive",
    "global_token_count", "accumulate_gradients_ddp", "accumulate_gradients_ddp_naive",
    "measure_microbatch", "microbatch_for_budget", "TokenMLP",
]

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
    k = len(microbatches)
    counts = [count_tokens(y, ignore_index) for _, y in microbatches]
    if 0 in counts:
        raise ValueError(f"micro-batch {counts.index(0)} has no real tokens: its mean is undefined")
    return _accumulate(model, microbatches, [1.0 / (k * n) for n in counts], _no_context, ignore_index)


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


# -- data parallel ------------------------------------------------------------------------------

def global_token_count(microbatches, group=None, ignore_index: int = IGNORE_INDEX) -> int:
    """N over every rank of ``group`` (torch's default group when None): one all-reduce of one int."""
    n = torch.tensor([sum(count_tokens(y, ignore_index) for _, y in microbatches)], dtype=torch.int64,
                     device=microbatches[0][1].device)
    dist.all_reduce(n, group=group)
    if int(n) == 0:
        raise ValueError("the accumulation window has no real tokens on any rank")
    return int(n)


def accumulate_gradients_ddp(ddp_model, microbatches, num_tokens: int, world_size: int,
                             ignore_index: int = IGNORE_INDEX) -> float:
    """Accumulate on a DDP model with one gradient all-reduce per window; return this rank's loss share.

    Micro-steps 1..k-1 run under ``no_sync()``, the last one synchronises. DDP averages over
    ranks, so each rank scales by world_size / N with N = :func:`global_token_count`.
    """
    check_int("num_tokens", num_tokens, 1)
    check_int("world_size", world_size, 1)
    k = len(microbatches)
    sync = (lambda i: ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext())
    return _accumulate(ddp_model, microbatches, [world_size / num_tokens] * k, sync, ignore_index) / world_size


def accumulate_gradients_ddp_naive(ddp_model, microbatches, num_tokens: int, world_size: int,
                                   ignore_index: int = IGNORE_INDEX) -> float:
    """Like :func:`accumulate_gradients_ddp` but all-reducing on every micro-step: k rounds, same result."""
    check_int("num_tokens", num_tokens, 1)
    check_int("world_size", world_size, 1)
    k = len(microbatches)
    return _accumulate(ddp_model, microbatches, [world_size / num_tokens] * k, _no_context, ignore_index) / world_size


# -- micro-batch size from a memory budget -----------------------------------------------------

def measure_microbatch(model: nn.Module, make_optimizer, micro_batch_size: int, seq_len: int,
                       vocab_size: int | None = None) -> MemoryReport:
    """Measured memory of a steady-state accumulation window at micro-batch ``micro_batch_size``.

    ``model(x, y)`` must return the loss (as :class:`labkit.model.GPT` does). On a copy of
    ``model`` with ``make_optimizer(params)``: one warm-up step (so the optimizer
    states exist), then the measured window: two micro-steps (the second runs with the gradients
    of the first allocated, as every later one does) and the optimizer step.
    """
    check_int("micro_batch_size", micro_batch_size, 1)
    check_int("seq_len", seq_len, 1)
    vocab_size = vocab_size or model.cfg.vocab_size
    probe = copy.deepcopy(model)
    optimizer = make_optimizer(probe.parameters())
    device = next(probe.parameters()).device
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(vocab_size, (micro_batch_size, seq_len), generator=gen).to(device)  # (B, T)
    y = torch.randint(vocab_size, (micro_batch_size, seq_len), generator=gen).to(device)  # (B, T)
    train_step(probe, optimizer, (x, y))  # warm-up: the optimizer states now exist
    with MemoryMeter(probe, optimizer) as meter:
        train_step(probe, None, (x, y), meter=meter)  # micro-step 1: forward and backward
        train_step(probe, optimizer, (x, y), meter=meter)  # micro-step 2 beside its gradients, the step
    return meter.report()


def microbatch_for_budget(peak_bytes, global_batch_size: int, budget_bytes: int) -> tuple[int, int]:
    """The largest micro-batch b <= B whose ``peak_bytes(b)`` fits ``budget_bytes``, and k = ceil(B / b).

    ``peak_bytes`` maps a micro-batch size to a measured peak (e.g. via :func:`measure_microbatch`)
    and must not decrease with b; binary search calls it about log2(B) + 1 times.
    """
    check_int("global_batch_size", global_batch_size, 1)
    check_int("budget_bytes", budget_bytes, 1)
    one = peak_bytes(1)
    if one > budget_bytes:
        raise ValueError(f"budget_bytes={budget_bytes:,} is below the peak of one sample, {one:,} bytes: "
                         "no micro-batch fits; the model states alone need a larger budget or sharding")
    lo, hi = 1, global_batch_size  # invariant: peak(lo) fits; the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if peak_bytes(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo, -(-global_batch_size // lo)


# -- a probe for normalisation layers ----------------------------------------------------------

class TokenMLP(nn.Module):
    """embedding -> Linear -> norm -> GELU -> Linear: idx (B, T) -> logits (B, T, V).

    ``norm="batch"`` normalises each feature over all B·T tokens of the (micro-)batch (Ioffe and
    Szegedy 2015); ``norm="layer"`` over each token's own features (Ba et al. 2016).
    """

    def __init__(self, vocab_size: int, d_model: int, norm: str):
        super().__init__()
        if norm not in ("batch", "layer"):
            raise ValueError(f"norm={norm!r} must be 'batch' or 'layer'")
        self.wte = nn.Embedding(vocab_size, d_model)
        self.fc = nn.Linear(d_model, d_model)
        self.norm = nn.BatchNorm1d(d_model) if norm == "batch" else nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx):
        B, T = idx.shape
        h = self.fc(self.wte(idx)).view(B * T, -1)  # (B*T, C)
        h = F.gelu(self.norm(h)).view(B, T, -1)  # (B, T, C)
        return self.head(h)  # (B, T, V)
