"""The paged KV cache: per-layer block tensors, a block table per sequence, copy-on-write and prefix sharing.

Kwon et al. (2023), Sec. 4.2-4.4. A sequence's logical block i lives in physical block
``block_tables[seq][i]``; blocks are allocated only when a token needs one. ``fork`` makes a
child that shares every block of its parent; the first write into a shared block copies it.
Full blocks are also found by the hash of their content and of everything before them, so a
new sequence whose prompt starts like a cached one shares those blocks (prefix sharing).
"""

from __future__ import annotations

import torch

from .allocator import BlockAllocator, OutOfBlocksError
from .analytic import DEFAULT_BLOCK_SIZE
from .attention import paged_attention, slot_mapping, write_kv

__all__ = ["PagedKVCache", "PagedStep"]


class PagedKVCache:
    """KV blocks of shape (num_blocks, nh, block_size, hs) per layer, for any number of sequences.

    ``store=False`` keeps the bookkeeping only (no tensors): the engine's accounting runs.
    """

    def __init__(self, n_layer, n_head, head_dim, num_blocks, block_size=DEFAULT_BLOCK_SIZE, *,
                 device="cpu", dtype=torch.float32, store=True, prefix_sharing=True):
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size, self.prefix_sharing = block_size, prefix_sharing
        shape = (num_blocks, n_head, block_size, head_dim)  # (num_blocks, nh, bs, hs)
        n = n_layer if store else 0
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n)]
        self.tables: dict[object, list[int]] = {}  # seq_id -> physical block ids
        self.lengths: dict[object, int] = {}  # seq_id -> tokens stored (or reserved this step)
        self.tokens: dict[object, list[int]] = {}  # seq_id -> the token ids of those slots
        self._hashes: dict[object, list[int]] = {}  # seq_id -> hash of each full block
        self._block_of_hash: dict[int, int] = {}
        self._hash_of_block: dict[int, int] = {}
        self.num_copies = 0  # copy-on-write copies made
        self.num_prefix_hits = 0  # blocks shared by content hash

    @classmethod
    def for_model(cls, model, num_blocks, block_size=DEFAULT_BLOCK_SIZE, **kw):
        cfg, p = model.cfg, next(model.parameters())
        return cls(cfg.n_layer, cfg.n_head, cfg.head_dim, num_blocks, block_size,
                   device=p.device, dtype=p.dtype, **kw)

    # --- sequences ------------------------------------------------------------------------------
    def add_sequence(self, seq_id, tokens) -> int:
        """Register a sequence whose prompt is ``tokens``; share the full blocks of its prefix
        already in the cache (never the block of its last token). Returns the tokens shared."""
        if seq_id in self.tables:
            raise ValueError(f"seq_id={seq_id!r} is already in the cache")
        bs, table, hashes, h = self.block_size, [], [], None
        if self.prefix_sharing:
            for i in range((len(tokens) - 1) // bs):
                h = hash((h, tuple(tokens[i * bs:(i + 1) * bs])))
                block = self._block_of_hash.get(h)
                if block is None:
                    break
                table.append(self.allocator.share(block))
                hashes.append(h)
                self.num_prefix_hits += 1
        shared = len(table) * bs
        self.tables[seq_id], self.lengths[seq_id] = table, shared
        self.tokens[seq_id], self._hashes[seq_id] = list(tokens[:shared]), hashes
        return shared

    def blocks_needed(self, seq_id, num_new: int) -> int:
        """Free blocks ``reserve(seq_id, num_new tokens)`` would take (a copy-on-write included)."""
        table, n, bs = self.tables[seq_id], self.lengths[seq_id], self.block_size
        grow = -(-(n + num_new) // bs) - len(table)
        copy = int(n % bs != 0 and num_new > 0 and self.allocator.ref_count(table[-1]) > 1)
        return grow + copy

    def reserve(self, seq_id, tokens) -> list[int]:
        """Make room for new ``tokens`` at the end of a sequence and return their slots.

        Allocates blocks on demand; copies a shared last block before writing to it. Raises
        :class:`OutOfBlocksError` and changes nothing when the free blocks do not suffice.
        """
        table, n, bs = self.tables[seq_id], self.lengths[seq_id], self.block_size
        if self.blocks_needed(seq_id, len(tokens)) > self.allocator.num_free:
            raise OutOfBlocksError(f"seq_id={seq_id!r} needs {self.blocks_needed(seq_id, len(tokens))} "
                                   f"blocks, {self.allocator.num_free} are free")
        if n % bs != 0 and tokens and self.allocator.ref_count(table[-1]) > 1:  # copy-on-write
            old, new = table[-1], self.allocator.allocate()
            for cache in self.k + self.v:
                cache[new].copy_(cache[old])
            self._release(old)
            table[-1] = new
            self.num_copies += 1
        while len(table) * bs < n + len(tokens):
            table.append(self.allocator.allocate())
        seq_tokens, hashes = self.tokens[seq_id], self._hashes[seq_id]
        seq_tokens.extend(int(t) for t in tokens)
        self.lengths[seq_id] = n + len(tokens)
        for i in range(len(hashes), (n + len(tokens)) // bs):  # blocks that just became full
            hashes.append(hash((hashes[-1] if hashes else None, tuple(seq_tokens[i * bs:(i + 1) * bs]))))
            if self.prefix_sharing and hashes[-1] not in self._block_of_hash:
                self._block_of_hash[hashes[-1]] = table[i]
                self._hash_of_block[table[i]] = hashes[-1]
        return [table[p // bs] * bs + p % bs for p in range(n, n + len(tokens))]

    def fork(self, parent, child) -> None:
        """``child`` shares every block of ``parent`` (reference counts + 1), copied on first write."""
        if child in self.tables:
            raise ValueError(f"child={child!r} is already in the cache")
        self.tables[child] = [self.allocator.share(b) for b in self.tables[parent]]
        self.lengths[child] = self.lengths[parent]
        self.tokens[child] = list(self.tokens[parent])
        self._hashes[child] = list(self._hashes[parent])

    def free_sequence(self, seq_id) -> None:
        """Drop a sequence's references; blocks no other table holds return to the free list."""
        for block in self.tables.pop(seq_id):
            self._release(block)
        del self.lengths[seq_id], self.tokens[seq_id], self._hashes[seq_id]

    def _release(self, block):
        self.allocator.free(block)
        if self.allocator.ref_count(block) == 0 and block in self._hash_of_block:
            del self._block_of_hash[self._hash_of_block.pop(block)]

    # --- views ----------------------------------------------------------------------------------
    def block_tables_tensor(self, seq_ids, device="cpu") -> torch.Tensor:
        """(B, max_blocks) int64, padded with block 0 (masked out by the context lengths)."""
        width = max(len(self.tables[s]) for s in seq_ids)
        rows = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in seq_ids]
        return torch.tensor(rows, dtype=torch.long, device=device)

    def step(self, seq_ids, num_new: int) -> "PagedStep":
        """The model's view of one forward over ``seq_ids``, whose last ``num_new`` slots were just reserved."""
        return PagedStep(self, list(seq_ids), num_new)

    def used_blocks(self) -> set[int]:
        return {b for table in self.tables.values() for b in table}


class PagedStep:
    """What ``GPT.forward(idx, kv_cache=...)`` needs: ``begin`` gives positions, ``attend`` runs
    :func:`paged_attention` after writing the new keys and values into their slots."""

    def __init__(self, cache: PagedKVCache, seq_ids, num_new: int):
        if not cache.k:
            raise ValueError("this cache was built with store=False: it holds no keys or values")
        self.cache, self.T = cache, num_new
        device = cache.k[0].device
        self.tables = cache.block_tables_tensor(seq_ids, device)  # (B, max_blocks)
        lens = [cache.lengths[s] for s in seq_ids]
        self.context_lens = torch.tensor(lens, dtype=torch.long, device=device)  # (B,)
        self.positions = self.context_lens[:, None] - num_new + torch.arange(num_new, device=device)  # (B, T)
        bs = cache.block_size
        self.slots = torch.cat([slot_mapping(cache.tables[s], self.positions[i], bs)
                                for i, s in enumerate(seq_ids)])  # (B * T,)

    def begin(self, idx):
        if tuple(idx.shape) != tuple(self.positions.shape):
            raise ValueError(f"idx has shape {tuple(idx.shape)}; this step reserved {tuple(self.positions.shape)}")
        return self.positions  # (B, T)

    def attend(self, layer, q, k, v):
        B, nh, T, hs = k.shape
        write_kv(self.cache.k[layer], self.cache.v[layer], self.slots,
                 k.transpose(1, 2).reshape(B * T, nh, hs), v.transpose(1, 2).reshape(B * T, nh, hs))
        return paged_attention(q, self.cache.k[layer], self.cache.v[layer], self.tables, self.context_lens)
