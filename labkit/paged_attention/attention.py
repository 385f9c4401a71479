"""PagedAttention: attention whose keys and values sit in fixed-size blocks found by a block table.

Kwon et al. (2023), Sec. 4.1, Eq. 4: the keys of a sequence are cut into blocks K_j of
``block_size`` tokens; the attention score A_ij = exp(q_i K_j^T / sqrt(d)) / sum_t exp(...) is
computed block by block, wherever each block lives. Here every block of a sequence is gathered
through its block table in one indexing operation, then the softmax runs over the gathered keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["paged_attention", "write_kv", "slot_mapping"]


def slot_mapping(block_table, positions, block_size):
    """Physical slots of logical ``positions`` of one sequence: block_table[p // bs] * bs + p % bs."""
    table = torch.as_tensor(block_table, dtype=torch.long, device=positions.device)
    if table.numel() and int(table.min()) < 0:
        raise ValueError(f"block_table holds block id {int(table.min())}: ids are >= 0")
    return table[positions // block_size] * block_size + positions % block_size  # (T,)


def write_kv(k_cache, v_cache, slots, k, v):
    """Store new keys and values at ``slots`` (N,) of the paged caches.

    k_cache, v_cache: (num_blocks, nh, block_size, hs); k, v: (N, nh, hs).
    """
    bs = k_cache.size(2)
    blocks, offsets = slots // bs, slots % bs  # (N,), (N,)
    k_cache[blocks, :, offsets] = k  # advanced indices first: (N, nh, hs)
    v_cache[blocks, :, offsets] = v


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, *, check=True):
    """Attention of new queries over keys and values gathered through block tables.

    q: (B, nh, T, hs), the T newest tokens of each sequence (T = 1 for a decode step);
    k_cache, v_cache: (num_blocks, nh, block_size, hs); block_tables: (B, max_blocks) int64,
    padded with any valid block id; context_lens: (B,) tokens stored per sequence, the new T
    included. Query i of sequence b sits at position context_lens[b] - T + i and sees keys
    0..that position. Returns (B, nh, T, hs). ``check=False`` skips the range checks, which
    read the tables on the host: for a caller that has checked them once per step.
    """
    if not isinstance(check, bool):
        raise TypeError(f"check={check!r} must be a bool")
    if q.dim() != 4:
        raise ValueError(f"q must be (B, nh, T, hs), got shape {tuple(q.shape)}")
    B, nh, T, hs = q.shape
    if block_tables.dim() != 2 or block_tables.size(0) != B:
        raise ValueError(f"block_tables must be (B={B}, max_blocks), got {tuple(block_tables.shape)}")
    if context_lens.shape != (B,):
        raise ValueError(f"context_lens must be (B={B},), got {tuple(context_lens.shape)}")
    bs = k_cache.size(2)
    n = block_tables.size(1) * bs  # gathered key slots per sequence
    if check:
        if int(context_lens.max()) > n or int(context_lens.min()) < T:
            raise ValueError(f"context_lens must lie in [T={T}, max_blocks * block_size={n}]")
        lo, hi = (int(x) for x in block_tables.aminmax())
        if lo < 0 or hi >= k_cache.size(0):
            raise ValueError(f"block_tables hold block id {lo if lo < 0 else hi}: valid ids are "
                             f"0..{k_cache.size(0) - 1} (a negative id would read from the end)")
    keys = k_cache[block_tables].permute(0, 2, 1, 3, 4).reshape(B, nh, n, hs)  # (B, nh, n, hs)
    values = v_cache[block_tables].permute(0, 2, 1, 3, 4).reshape(B, nh, n, hs)  # (B, nh, n, hs)
    att = (q @ keys.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, n)
    q_pos = context_lens[:, None] - T + torch.arange(T, device=q.device)[None, :]  # (B, T)
    hidden = torch.arange(n, device=q.device)[None, None, :] > q_pos[:, :, None]  # (B, T, n)
    att = F.softmax(att.masked_fill(hidden[:, None], float("-inf")), dim=-1)
    return att @ values  # (B, nh, T, hs)
