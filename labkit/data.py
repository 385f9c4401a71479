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
    text = resources.files("labkit").joinpath("data/shakespeare.txt").read_text(encoding="utf-8")
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
