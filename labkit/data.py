"""The training corpus shipped with labkit, a byte-level tokenizer and a batch loader.

The corpus is an excerpt (about 200 kB) of Shakespeare's plays, which are in the public
domain. Tokens are bytes, so ``vocab_size`` is 256 and no tokenizer is downloaded.
"""

from __future__ import annotations

from importlib import resources

import torch

__all__ = ["VOCAB_SIZE", "load_corpus", "encode", "decode", "get_batch", "batches"]

VOCAB_SIZE = 256


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as an int64 tensor of token ids in [0, 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens) -> str:
    """Inverse of :func:`encode` (invalid byte sequences are replaced)."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def load_corpus() -> torch.Tensor:
    """The shipped corpus as a 1-D int64 tensor of byte tokens."""
    text = resources.files("labkit").joinpath("corpus/shakespeare.txt").read_text(encoding="utf-8")
    return encode(text)


def get_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator | None = None,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the corpus: inputs x (B, T) and next-token targets y (B, T)."""
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size} must be positive")
    if not 0 < seq_len < len(tokens):
        raise ValueError(f"seq_len={seq_len} must be in [1, {len(tokens) - 1}] for this corpus")
    starts = torch.randint(len(tokens) - seq_len, (batch_size,), generator=generator)  # (B,)
    offsets = torch.arange(seq_len)  # (T,)
    x = tokens[starts[:, None] + offsets]  # (B, T)
    y = tokens[starts[:, None] + offsets + 1]  # (B, T)
    return x.to(device), y.to(device)


def batches(batch_size: int, seq_len: int, seed: int = 0, device: str | torch.device = "cpu",
            tokens: torch.Tensor | None = None):
    """An endless, reproducible stream of (x, y) batches from the shipped corpus."""
    tokens = load_corpus() if tokens is None else tokens
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield get_batch(tokens, batch_size, seq_len, generator=gen, device=device)


def get_padded_batch(tokens: torch.Tensor, lengths, seq_len: int | None = None,
                     generator: torch.Generator | None = None, device: str | torch.device = "cpu",
                     pad_id: int = 0, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of the corpus of the given real ``lengths``, right-padded to T = ``seq_len`` (or max).

    Returns x (B, T) with ``pad_id`` after each sequence and targets y (B, T) with
    ``ignore_index`` there, so a loss over y != ignore_index counts real tokens only.
    """
    lengths = [int(n) for n in lengths]
    if not lengths:
        raise ValueError("lengths=[] must name at least one sequence length")
    T = max(lengths) if seq_len is None else seq_len
    if not 0 < T < len(tokens):
        raise ValueError(f"seq_len={T} must be in [1, {len(tokens) - 1}] for this corpus")
    if min(lengths) < 1 or max(lengths) > T:
        raise ValueError(f"lengths={lengths} must each be in [1, seq_len={T}]")
    x, y = get_batch(tokens, len(lengths), T, generator=generator)  # (B, T), (B, T)
    real = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T) bool
    x = x.masked_fill(~real, pad_id)
    y = y.masked_fill(~real, ignore_index)
    return x.to(device), y.to(device)


__all__.append("get_padded_batch")
