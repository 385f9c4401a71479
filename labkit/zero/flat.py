"""Flat, padded layouts: how a list of parameters is cut into ``world_size`` equal shards.

The tensors of a group are laid end to end in one flat buffer of Ψ_g elements, padded with
zeros to ``world_size * shard_numel`` (ceil division), and rank r owns the contiguous range
``[r * shard_numel, (r + 1) * shard_numel)`` (Rajbhandari et al. 2020, Section 5: each rank
owns 1/N_d of the states). A rank may own only padding when ``world_size`` exceeds Ψ_g.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validate import check_int
from .analytic import padded_numel, shard_numel  # torch-free, so the estimator reads them

__all__ = ["shard_numel", "padded_numel", "shard_range", "param_slice", "FlatLayout"]


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """The real (unpadded) elements ``[start, stop)`` of a flat buffer that ``rank`` owns.

    ``stop - start`` is ``shard_numel`` for all but the last ranks, which own the padding;
    a rank that owns only padding gets an empty range ``(numel, numel)``.
    """
    check_int("world_size", world_size, 1)
    check_int("rank", rank, 0, world_size - 1)
    s = shard_numel(numel, world_size)
    return min(rank * s, numel), min((rank + 1) * s, numel)


def param_slice(offset: int, numel: int, start: int, stop: int) -> tuple[int, int]:
    """The part ``[a, b)`` of a tensor at ``[offset, offset + numel)`` that falls in ``[start, stop)``,
    in the tensor's own flat coordinates (``a == b`` when they do not meet)."""
    a = min(max(start - offset, 0), numel)
    b = max(min(stop - offset, numel), a)
    return a, b


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a group sits in the flat buffer: names, shapes and offsets."""

    names: tuple
    shapes: tuple
    offsets: tuple
    numel: int  # Ψ_g, without padding

    @classmethod
    def of(cls, names, tensors) -> "FlatLayout":
        kinds = sorted({f"{t.dtype} on {t.device}" for t in tensors})
        if len(kinds) > 1:  # one flat buffer has one dtype: a silent cast would change the model
            raise ValueError(f"the tensors of one flat group must share dtype and device, got {kinds}; "
                             "give them parameter groups (stages 1-2) or units (stage 3) of their own")
        shapes = tuple(tuple(t.shape) for t in tensors)
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += t.numel()
        return cls(tuple(names), shapes, tuple(offsets), total)

    def numels(self) -> list[int]:
        return [torch.Size(s).numel() for s in self.shapes]

    def flatten(self, tensors, world_size: int, dtype=None, device=None) -> torch.Tensor:
        """Concatenate ``tensors`` (None counts as zeros) into a zero-padded flat buffer."""
        ref = next((t for t in tensors if t is not None), None)
        dtype = dtype or (ref.dtype if ref is not None else torch.float32)
        device = device or (ref.device if ref is not None else "cpu")
        flat = torch.zeros(padded_numel(self.numel, world_size), dtype=dtype, device=device)
        for t, off, n in zip(tensors, self.offsets, self.numels()):
            if t is not None:
                flat[off:off + n].copy_(t.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The tensors of the group as views into ``flat`` (no copies)."""
        return [flat[off:off + n].view(shape)
                for off, n, shape in zip(self.offsets, self.numels(), self.shapes)]
