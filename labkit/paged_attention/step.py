"""One forward's view of a paged cache (:class:`labkit.model.KVCacheProtocol`): positions, slots,
block tables, and attention through them (Kwon et al. 2023, Sec. 4.1-4.2); MLA's latent rows too."""

from __future__ import annotations

import torch

from ..validate import check_int
from .attention import gather_blocks, paged_attention, write_kv, write_slots
from .contiguous import check_kind

__all__ = ["PagedStep"]


class PagedStep:
    """What ``GPT.forward(idx, kv_cache=...)`` needs (:class:`labkit.model.KVCacheProtocol`):
    ``begin`` gives positions, ``attend`` writes the new keys and values into their slots and
    runs :func:`paged_attention`. Block tables and lengths are checked once here, from Python
    integers, so no layer waits on the device."""

    def __init__(self, cache: PagedKVCache, seq_ids, num_new: int):
        if not cache.k:
            raise ValueError("this cache was built with store=False: it holds no keys or values")
        check_int("num_new", num_new, 1)
        self.cache, self.T, bs = cache, num_new, cache.block_size
        lens = [cache.length(s) for s in seq_ids]
        if min(lens) < num_new:
            raise ValueError(f"num_new={num_new}: every sequence must have reserved its "
                             f"{num_new} new slots, lengths are {lens}")
        device = cache.k[0].device
        self.tables = cache.block_tables_tensor(seq_ids, device)  # (B, max_blocks)
        self.context_lens = torch.tensor(lens, dtype=torch.long, device=device)  # (B,)
        positions = [range(n - num_new, n) for n in lens]
        self.positions = torch.tensor([list(p) for p in positions], device=device)  # (B, T)
        slots = [cache.tables[s][p // bs] * bs + p % bs
                 for s, ps in zip(seq_ids, positions) for p in ps]
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)  # (B * T,)

    def begin(self, idx):
        if tuple(idx.shape) != tuple(self.positions.shape):
            raise ValueError(f"idx has shape {tuple(idx.shape)}; this step reserved "
                             f"{tuple(self.positions.shape)}")
        return self.positions  # (B, T)

    def attend(self, layer, q, k, v):
        check_kind(self.cache.latent, False)
        B, n_kv, T, hs = k.shape
        write_kv(self.cache.k[layer], self.cache.v[layer], self.slots,
                 k.transpose(1, 2).reshape(B * T, n_kv, hs),  # (B * T, n_kv, hs)
                 v.transpose(1, 2).reshape(B * T, n_kv, hs), check=False)  # slots built in range here
        return paged_attention(q, self.cache.k[layer], self.cache.v[layer], self.tables,
                               self.context_lens, check=False)

    def attend_latent(self, layer, c_kv, k_rope, attend):
        """MLA: write [c_kv; k_rope] (B, T, c + d_rope) into the slots, hand every row of the
        tables to ``attend`` (query i of sequence b at position context_lens[b] - T + i)."""
        check_kind(self.cache.latent, True)
        row = torch.cat([c_kv, k_rope], dim=-1)  # (B, T, c + d_rope)
        B, T, w = row.shape
        write_slots(self.cache.k[layer], self.slots, row.reshape(B * T, 1, w), check=False)
        rows = gather_blocks(self.cache.k[layer], self.tables)[:, 0]  # (B, n, c + d_rope)
        return attend(rows, self.context_lens - self.T, self.cache.absorb)  # (B, nh, T, d_v)
