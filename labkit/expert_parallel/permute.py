"""Token permutation: rows grouped by source rank, then by expert, regrouped by expert.

After the dispatch a rank holds, from each source rank s, a block of rows for each of its
E_local experts: (s, j) order. The experts want (j, s) order, one contiguous block each; the
combine wants (s, j) order again. Both are gathers by an index and its inverse.
"""

from __future__ import annotations

import torch

__all__ = ["expert_major_order", "inverse_permutation"]


def expert_major_order(counts: torch.Tensor) -> torch.Tensor:
    """counts (ep, E_local): rows from rank s for expert j, stored in (s, j) order -> index (M,)
    with rows[index] in (j, s) order (each expert's rows contiguous, source ranks in order)."""
    ep, n_local = counts.shape
    flat = counts.reshape(-1)  # (ep E_local,)
    starts = (flat.cumsum(0) - flat).view(ep, n_local)  # where block (s, j) begins
    parts = [torch.arange(int(starts[s, j]), int(starts[s, j] + counts[s, j]), device=counts.device)
             for j in range(n_local) for s in range(ep)]
    return torch.cat(parts) if parts else counts.new_zeros(0)


def inverse_permutation(index: torch.Tensor) -> torch.Tensor:
    """The index ``inv`` with ``x[index][inv] == x``: inv[index[i]] = i."""
    inv = torch.empty_like(index)
    inv[index] = torch.arange(index.numel(), device=index.device)
    return inv
