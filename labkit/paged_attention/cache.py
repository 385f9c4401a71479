"""The paged KV cache: per-layer block tensors, a block table per sequence, copy-on-write and
prefix sharing (Kwon et al. 2023, Sec. 4.2-4.4).

A sequence's logical block i lives in physical block ``table[i]``; blocks are allocated only when
a token needs one. ``fork`` makes a child that shares every block of its parent; the first write
into a shared block copies it. A full block is also registered under the hash of its tokens and
of everything before it, so a new prompt that starts like a cached one shares those blocks. A hit
is verified, never decided by the hash alone: the block's own tokens must be equal and its
parent must be the block just matched (vLLM and nano-vllm verify the tokens too). A freed block
keeps its registration until it is reallocated, so a later request can still hit it; the
reallocation drops it (avoiding nano-vllm's stale-entry bug, issue 163).
"""

from __future__ import annotations

import torch

from ..validate import check_bool, check_int
from .allocator import BlockAllocator, OutOfBlocksError
from .analytic import DEFAULT_BLOCK_SIZE
from .contiguous import check_latent, latent_width
from .sampling import token_list
from .step import PagedStep

__all__ = ["PagedKVCache", "PagedStep"]


def _check_batch(seq_ids) -> list:
    """A step's sequences: at least one, each once (twice would write its slots twice)."""
    seq_ids = list(seq_ids)
    if not seq_ids:
        raise ValueError("seq_ids is empty: a step needs at least one sequence")
    if len(set(seq_ids)) != len(seq_ids):
        twice = next(s for s in seq_ids if seq_ids.count(s) > 1)
        raise ValueError(f"seq_id={twice!r} appears more than once in seq_ids: a batch holds each "
                         "sequence once")
    return seq_ids


def _block_hash(parent_hash, tokens: tuple) -> int:
    """The key a full block is looked up by: its tokens and its parent's key (vLLM's chain)."""
    return hash((parent_hash, tokens))


class PagedKVCache:
    """KV blocks of shape (num_blocks, n_kv_head, block_size, hs) per layer, for any number of sequences.

    ``n_kv_head``: the key-value heads kept (n_head for multi-head attention, fewer with
    grouped-query attention).
    ``store=False`` keeps the bookkeeping only (no tensors): the engine's accounting runs.
    ``latent``, ``absorb``: MLA's rows (c + d_rope a token a layer) in ``k``, no ``v``, as
    :class:`labkit.paged_attention.contiguous.KVCache` keeps them.
    """

    def __init__(self, n_layer, n_kv_head, head_dim, num_blocks, block_size=DEFAULT_BLOCK_SIZE, *,
                 device="cpu", dtype=torch.float32, store=True, prefix_sharing=True, latent=False,
                 absorb=False):
        for name, value in [("n_layer", n_layer), ("n_kv_head", n_kv_head), ("head_dim", head_dim)]:
            check_int(name, value, 1)
        check_latent(latent, absorb, n_kv_head)
        check_bool("store", store)
        check_bool("prefix_sharing", prefix_sharing)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype={dtype!r} must be a floating torch.dtype: keys and values")
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size, self.prefix_sharing = block_size, prefix_sharing
        shape = (num_blocks, n_kv_head, block_size, head_dim)  # (num_blocks, n_kv, bs, hs)
        n = n_layer if store else 0
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(0 if latent else n)]
        self.latent, self.absorb = latent, absorb
        self.tables: dict[object, list[int]] = {}  # seq_id -> physical block ids
        self.lengths: dict[object, int] = {}  # seq_id -> tokens stored (or reserved this step)
        self.tokens: dict[object, list[int]] = {}  # seq_id -> the token ids of those slots
        self._hashes: dict[object, list[int]] = {}  # seq_id -> hash chain of its full blocks
        self._block_of_hash: dict[int, int] = {}
        self._entry: dict[int, tuple] = {}  # block -> (hash, uid, parent uid, tokens)
        self._uids = iter(range(1, 1 << 62))  # one per registration, never reused
        self.num_copies = 0  # copy-on-write copies made
        self.num_prefix_hits = 0  # blocks shared by content

    @classmethod
    def for_model(cls, model, num_blocks, block_size=DEFAULT_BLOCK_SIZE, **kw):
        cfg, p = model.cfg, next(model.parameters())
        latent = latent_width(cfg, "PagedKVCache")
        n_kv = cfg.kv_heads // getattr(model, "tp_size", 1)  # a tensor-parallel rank: its heads only
        n_kv, head_dim = latent or (n_kv, cfg.head_dim)
        return cls(cfg.n_layer, n_kv, head_dim, num_blocks, block_size,
                   device=p.device, dtype=p.dtype, latent=latent is not None, **kw)

    # --- the narrow interface the engine uses -----------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.allocator.num_used

    @property
    def num_table_entries(self) -> int:
        """Blocks the live block tables name: what the same sequences would hold unshared."""
        return sum(len(t) for t in self.tables.values())

    def __contains__(self, seq_id) -> bool:
        return seq_id in self.tables

    def sequence_ids(self) -> list:
        return list(self.tables)

    def length(self, seq_id) -> int:
        """Tokens stored (or reserved) for ``seq_id``."""
        return self.lengths[self._known(seq_id)]

    def usage_by_block(self) -> dict[int, list[tuple[object, int]]]:
        """Each block in use -> its holders as (seq_id, logical block index)."""
        holders: dict[int, list] = {}
        for sid, table in self.tables.items():
            for i, b in enumerate(table):
                holders.setdefault(b, []).append((sid, i))
        return holders

    def _known(self, seq_id):
        if seq_id not in self.tables:
            raise ValueError(f"seq_id={seq_id!r} is not in the cache ({len(self.tables)} "
                             f"sequences are)")
        return seq_id

    # --- sequences ----------------------------------------------------------------------------
    def add_sequence(self, seq_id, tokens) -> int:
        """Register a sequence whose prompt is ``tokens``; share the full blocks of its prefix
        already cached, never the block of its last token, which is always computed. Returns
        the tokens shared."""
        if seq_id in self.tables:
            raise ValueError(f"seq_id={seq_id!r} is already in the cache")
        tokens = token_list(tokens, "tokens")
        bs, table, hashes, h, uid = self.block_size, [], [], None, None
        for i in range((len(tokens) - 1) // bs if self.prefix_sharing else 0):
            own = tuple(tokens[i * bs:(i + 1) * bs])
            h = _block_hash(h, own)
            block = self._block_of_hash.get(h)
            entry = self._entry.get(block)
            if entry is None or entry[0] != h or entry[2] != uid or entry[3] != own:
                break  # a miss, or a hash that matches other tokens: share nothing more
            if self.allocator.ref_count(block) == 0:
                self.allocator.reclaim(block)  # freed but not yet reused: its keys are intact
            else:
                self.allocator.share(block)
            table.append(block)
            hashes.append(h)
            uid = entry[1]
            self.num_prefix_hits += 1
        shared = len(table) * bs
        self.tables[seq_id], self.lengths[seq_id] = table, shared
        self.tokens[seq_id], self._hashes[seq_id] = tokens[:shared], hashes
        return shared

    def blocks_needed(self, seq_id, num_new: int) -> int:
        """Free blocks ``reserve(seq_id, num_new tokens)`` would take (a copy-on-write included)."""
        check_int("num_new", num_new, 0)
        table, n, bs = self.tables[self._known(seq_id)], self.lengths[seq_id], self.block_size
        grow = -(-(n + num_new) // bs) - len(table)
        copy = int(n % bs != 0 and num_new > 0 and self.allocator.ref_count(table[-1]) > 1)
        return grow + copy

    def reserve(self, seq_id, tokens) -> list[int]:
        """Make room for new ``tokens`` at the end of a sequence and return their slots.

        Allocates blocks on demand; copies a shared last block before writing to it. Raises
        :class:`OutOfBlocksError` and changes nothing when the free blocks do not suffice.
        """
        tokens = token_list(tokens, "tokens")
        need = self.blocks_needed(seq_id, len(tokens))
        if need > self.allocator.num_free:
            raise OutOfBlocksError(f"seq_id={seq_id!r} needs {need} blocks, "
                                   f"{self.allocator.num_free} are free")
        table, n, bs = self.tables[seq_id], self.lengths[seq_id], self.block_size
        if n % bs != 0 and tokens and self.allocator.ref_count(table[-1]) > 1:  # copy-on-write
            old, new = table[-1], self._new_block()
            for cache in self.k + self.v:
                cache[new].copy_(cache[old])
            self.allocator.free(old)
            table[-1] = new
            self.num_copies += 1
        while len(table) * bs < n + len(tokens):
            table.append(self._new_block())
        self.tokens[seq_id].extend(tokens)
        self.lengths[seq_id] = n + len(tokens)
        self._register_full_blocks(seq_id)
        return [table[p // bs] * bs + p % bs for p in range(n, n + len(tokens))]

    def _new_block(self) -> int:
        """A free block for new contents: its old registration, if any, is dropped."""
        block = self.allocator.allocate()
        entry = self._entry.pop(block, None)
        if entry is not None and self._block_of_hash.get(entry[0]) == block:
            del self._block_of_hash[entry[0]]
        return block

    def _register_full_blocks(self, seq_id):
        table, hashes, toks = self.tables[seq_id], self._hashes[seq_id], self.tokens[seq_id]
        bs = self.block_size
        for i in range(len(hashes), self.lengths[seq_id] // bs):  # blocks that just became full
            own = tuple(toks[i * bs:(i + 1) * bs])
            hashes.append(_block_hash(hashes[-1] if hashes else None, own))
            if not self.prefix_sharing or table[i] in self._entry:
                continue
            parent = self._entry.get(table[i - 1]) if i else None
            if i and parent is None:
                continue  # its parent is not findable, so neither is it
            old = self._block_of_hash.get(hashes[-1])
            if old is not None:  # the key is taken: keep a true twin, replace anything else
                e = self._entry[old]
                if e[2] == (parent[1] if parent else None) and e[3] == own:
                    continue
                del self._entry[old]
            self._block_of_hash[hashes[-1]] = table[i]
            self._entry[table[i]] = (hashes[-1], next(self._uids),
                                     parent[1] if parent else None, own)

    def fork(self, parent, child) -> None:
        """``child`` shares every block of ``parent`` (reference counts + 1), copied on first write."""
        if child in self.tables:
            raise ValueError(f"child={child!r} is already in the cache")
        self.tables[child] = [self.allocator.share(b) for b in self.tables[self._known(parent)]]
        self.lengths[child] = self.lengths[parent]
        self.tokens[child] = list(self.tokens[parent])
        self._hashes[child] = list(self._hashes[parent])

    def free_sequence(self, seq_id) -> None:
        """Drop a sequence's references; blocks no other table holds return to the free list
        (keeping their registration until they are reused)."""
        for block in self.tables.pop(self._known(seq_id)):
            self.allocator.free(block)
        del self.lengths[seq_id], self.tokens[seq_id], self._hashes[seq_id]

    # --- views ----------------------------------------------------------------------------------
    def block_tables_tensor(self, seq_ids, device="cpu") -> torch.Tensor:
        """(B, max_blocks) int64, padded with block 0 (masked out by the context lengths)."""
        _check_batch(seq_ids)
        width = max(len(self.tables[self._known(s)]) for s in seq_ids)
        rows = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in seq_ids]
        return torch.tensor(rows, dtype=torch.long, device=device)

    def step(self, seq_ids, num_new: int) -> "PagedStep":
        """The model's view of one forward over ``seq_ids``, whose last ``num_new`` slots were
        just reserved."""
        return PagedStep(self, _check_batch(list(seq_ids)), num_new)

    def used_blocks(self) -> set[int]:
        return {b for table in self.tables.values() for b in table}
