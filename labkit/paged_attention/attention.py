"""PagedAttention: attention whose keys and values sit in fixed-size blocks found by a block table.

Kwon et al. (2023), Sec. 4.1, Eq. 4: the keys of a sequence are cut into blocks K_j of
``block_size`` tokens; the attention score A_ij = exp(q_i K_j^T / sqrt(d)) / sum_t exp(...) is
computed block by block, wherever each block lives. Here every block of a sequence is gathered
through its block table in one indexing operation, then the softmax runs over the gathered keys
(:func:`labkit.attention.reference_attention`). Blocks hold the n_kv key-value heads only: with
grouped-query attention each serves nh / n_kv query heads.
"""

from __future__ import annotations

import torch

from ..attention import reference_attention
from ..validate import check_bool, check_int

__all__ = ["paged_attention", "write_kv", "write_slots", "gather_blocks", "slot_mapping"]


def slot_mapping(block_table, positions, block_size):
    """Physical slots of logical ``positions`` of one sequence: block_table[p // bs] * bs + p % bs."""
    check_int("block_size", block_size, 1)
    table = torch.as_tensor(block_table, dtype=torch.long, device=positions.device)
    if table.numel() and int(table.min()) < 0:
        raise ValueError(f"block_table holds block id {int(table.min())}: ids are >= 0")
    if positions.is_floating_point() or positions.dtype == torch.bool:
        raise TypeError(f"positions.dtype={positions.dtype} must be an integer dtype")
    n = table.numel() * block_size
    if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < n:
        bad = int(positions.min()) if int(positions.min()) < 0 else int(positions.max())
        raise ValueError(f"position {bad} is outside the block table's [0, {n}) slots (a negative "
                         "position would read from the end)")
    return table[positions // block_size] * block_size + positions % block_size  # (T,)


def write_kv(k_cache, v_cache, slots, k, v, *, check=True):
    """Store new keys and values at ``slots`` (N,) of the paged caches.

    k_cache, v_cache: (num_blocks, n_kv, block_size, hs); k, v: (N, n_kv, hs). ``check=False`` skips
    the range check of the slots, which reads them on the host (as in :func:`paged_attention`).
    """
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be "
                         "one shape, (num_blocks, n_kv, block_size, hs)")
    want = (slots.numel(), k_cache.size(1), k_cache.size(3))
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (N, n_kv, hs) = {want}")
    write_slots(k_cache, slots, k, check=check)
    write_slots(v_cache, slots, v, check=False)  # the same slots, checked once


def write_slots(cache, slots, x, *, check=True):
    """Store rows x (N, n_kv, hs) at ``slots`` (N,) of one paged cache (num_blocks, n_kv,
    block_size, hs): keys, values, or MLA's latent rows. ``check``: as in :func:`write_kv`."""
    if check and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= cache.size(0) * cache.size(2):
            raise ValueError(f"slot {lo if lo < 0 else hi} is outside the cache's "
                             f"[0, {cache.size(0) * cache.size(2)}) slots (a negative slot "
                             "would write from the end)")
    bs = cache.size(2)
    cache[slots // bs, :, slots % bs] = x  # advanced indices first: (N, n_kv, hs)


def gather_blocks(cache, block_tables):
    """Every block of each sequence's table, in order: (num_blocks, n_kv, bs, hs) through
    (B, max_blocks) -> (B, n_kv, max_blocks * bs, hs), in one indexing operation."""
    B, n_kv, hs = block_tables.size(0), cache.size(1), cache.size(3)
    return cache[block_tables].permute(0, 2, 1, 3, 4).reshape(B, n_kv, -1, hs)  # (B, n_kv, n, hs)


def _check_shapes(q, k_cache, v_cache, block_tables, context_lens) -> None:
    """Shapes, dtypes and devices only: nothing is read from the device."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("block_tables", block_tables), ("context_lens", context_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be (B, nh, T, hs), got shape {tuple(q.shape)}")
    B, nh, T, hs = q.shape
    if (k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.size(3) != hs
            or nh % k_cache.size(1)):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be "
                         f"(num_blocks, n_kv, block_size, hs={hs}) with n_kv dividing nh={nh}, as q "
                         f"{tuple(q.shape)} is")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"q, k_cache, v_cache dtypes {q.dtype}, {k_cache.dtype}, {v_cache.dtype} "
                         "must be the same")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.is_floating_point() or t.dtype == torch.bool:
            raise TypeError(f"{name}.dtype={t.dtype} must be an integer dtype (int64)")
    if block_tables.dim() != 2 or block_tables.size(0) != B:
        raise ValueError(f"block_tables must be (B={B}, max_blocks), got {tuple(block_tables.shape)}")
    if context_lens.shape != (B,):
        raise ValueError(f"context_lens must be (B={B},), got {tuple(context_lens.shape)}")


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, *, check=True):
    """Attention of new queries over keys and values gathered through block tables.

    q: (B, nh, T, hs), the T newest tokens of each sequence (T = 1 for a decode step);
    k_cache, v_cache: (num_blocks, n_kv, block_size, hs), n_kv dividing nh (grouped-query
    attention: query head i reads kv head i // (nh / n_kv)); block_tables: (B, max_blocks) int64,
    padded with any valid block id; context_lens: (B,) tokens stored per sequence, the new T
    included. Query i of sequence b sits at position context_lens[b] - T + i and sees keys
    0..that position. Returns (B, nh, T, hs). ``check=False`` skips the range checks, which
    read the tables on the host: for a caller that has checked them once per step.
    """
    check_bool("check", check)
    _check_shapes(q, k_cache, v_cache, block_tables, context_lens)
    B, nh, T, hs = q.shape
    bs = k_cache.size(2)
    n = block_tables.size(1) * bs  # gathered key slots per sequence
    if check:
        if int(context_lens.max()) > n or int(context_lens.min()) < T:
            raise ValueError(f"context_lens must lie in [T={T}, max_blocks * block_size={n}]")
        lo, hi = (int(x) for x in block_tables.aminmax())
        if lo < 0 or hi >= k_cache.size(0):
            raise ValueError(f"block_tables hold block id {lo if lo < 0 else hi}: valid ids are "
                             f"0..{k_cache.size(0) - 1} (a negative id would read from the end)")
    keys, values = gather_blocks(k_cache, block_tables), gather_blocks(v_cache, block_tables)  # (B, n_kv, n, hs)
    # query i of sequence b sits at position context_lens[b] - T + i; keys past it (the padding
    # of the last block, the blocks of the table's padding) are hidden by the causal mask
    return reference_attention(q, keys, values, causal=True, q_offset=context_lens - T,
                               softmax_dtype=q.dtype)  # (B, nh, T, hs)
