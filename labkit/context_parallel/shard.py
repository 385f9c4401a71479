"""Cutting a sequence into context-parallel shards and putting it back together.

``"contiguous"``: rank i holds the i-th of cp equal chunks. ``"zigzag"``: the sequence is cut into
2 cp chunks and rank i holds chunks i and 2cp - 1 - i, one early and one late, so that under a
causal mask every rank has the same work (:func:`labkit.context_parallel.analytic.causal_pairs`).
"""

from __future__ import annotations

import torch

from ..validate import check_int
from .analytic import _n_chunks, check_cp_seq_len, chunks_of_rank

__all__ = ["shard_sequence", "unshard_sequence", "shard_positions"]


def shard_sequence(x: torch.Tensor, cp_size: int, rank: int, *, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """This rank's shard of ``x`` along ``dim``: (..., s, ...) -> (..., s / cp, ...), a copy."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = check_int("dim", dim, -x.dim(), x.dim() - 1) % x.dim()
    check_cp_seq_len(x.size(dim), cp_size, layout, name=f"x.size({dim})")
    chunks = x.chunk(_n_chunks(cp_size, layout), dim=dim)  # 2cp (zigzag) or cp views
    return torch.cat([chunks[c] for c in chunks_of_rank(rank, cp_size, layout)], dim=dim)


def unshard_sequence(shards, *, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard, given in rank order: the inverse of
    :func:`shard_sequence`."""
    shards = list(shards)
    if not shards or not all(isinstance(s, torch.Tensor) for s in shards):
        raise TypeError("shards must be a non-empty list of tensors, one per rank in rank order")
    cp = len(shards)
    dim = check_int("dim", dim, -shards[0].dim(), shards[0].dim() - 1) % shards[0].dim()
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) > 1:
        raise ValueError(f"shards have mismatched shapes {sorted(shapes)}: every rank's shard must have one shape")
    per_chunk = _n_chunks(cp, layout) // cp  # chunks a rank holds: 1 or 2
    check_cp_seq_len(shards[0].size(dim) * cp, cp, layout, name=f"shards' total length along dim {dim}")
    out = [None] * (per_chunk * cp)
    for r, s in enumerate(shards):
        for piece, c in zip(s.chunk(per_chunk, dim=dim), chunks_of_rank(r, cp, layout)):
            out[c] = piece
    return torch.cat(out, dim=dim)


def shard_positions(seq_len: int, cp_size: int, rank: int, *, layout: str = "zigzag",
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions (s / cp,) int64 of the tokens rank holds of a ``seq_len``-token sequence."""
    check_cp_seq_len(seq_len, cp_size, layout)
    return shard_sequence(torch.arange(seq_len, device=device), cp_size, rank, layout=layout, dim=0)
