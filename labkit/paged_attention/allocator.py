"""Physical KV blocks handed out from a free list, with reference counts for copy-on-write sharing.

vLLM's block manager in small (Kwon et al. 2023, Sec. 4.2-4.4): a block is free or held by one
or more block tables; ``share`` adds a holder, ``free`` drops one, and the last drop returns the
block to the free list.
"""

from __future__ import annotations

from collections import deque

from ..messages import say
from ..validate import check_int

__all__ = ["BlockAllocator", "OutOfBlocksError"]


class OutOfBlocksError(RuntimeError):
    """No free block is left: the scheduler must wait, preempt or refuse."""


class BlockAllocator:
    """``num_blocks`` blocks of ``block_size`` token slots; ids 0..num_blocks-1."""

    def __init__(self, num_blocks: int, block_size: int):
        check_int("num_blocks", num_blocks, 1)
        check_int("block_size", block_size, 1)
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = deque(range(num_blocks))  # FIFO: a freed block is reused last
        self._refs = [0] * num_blocks
        self.num_shared = 0  # blocks with more than one holder

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def _check(self, block_id):
        check_int("block_id", block_id, 0, self.num_blocks - 1)

    def allocate(self) -> int:
        """A free block with one reference; :class:`OutOfBlocksError` when none is left."""
        if not self._free:
            raise OutOfBlocksError(f"all {self.num_blocks} blocks are in use")
        block_id = self._free.popleft()
        self._refs[block_id] = 1
        return block_id

    def reclaim(self, block_id: int) -> int:
        """Take back one particular free block (its contents kept: a cached prefix) with one reference."""
        self._check(block_id)
        if self._refs[block_id] != 0:
            raise ValueError(f"block_id={block_id} is in use: share it instead")
        self._free.remove(block_id)
        self._refs[block_id] = 1
        return block_id

    def share(self, block_id: int) -> int:
        """One more holder of a block in use (a forked sequence, a shared prefix)."""
        self._check(block_id)
        if self._refs[block_id] == 0:
            raise ValueError(f"block_id={block_id} is free: only a block in use can be shared")
        self._refs[block_id] += 1
        self.num_shared += self._refs[block_id] == 2
        return block_id

    def free(self, block_id: int) -> None:
        """Drop one holder; at zero the block returns to the free list."""
        self._check(block_id)
        if self._refs[block_id] == 0:
            raise ValueError(say("raise.double_free", block_id=block_id))
        self._refs[block_id] -= 1
        self.num_shared -= self._refs[block_id] == 1
        if self._refs[block_id] == 0:
            self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        self._check(block_id)
        return self._refs[block_id]
