"""PagedAttention and a small serving engine (Chapter 8): the KV cache in fixed-size blocks.

``analytic``: bytes per token and blocks per sequence; ``contiguous``: the contiguous KV cache
of incremental decoding and greedy ``generate`` (the baseline); ``allocator``: the free list and
reference counts; ``attention``: attention through block tables; ``cache``: the paged KV cache
with copy-on-write and prefix sharing; ``sampling``: requests, greedy, sampling and beam search;
``reservation``: contiguous reservation and the accounting of waste; ``scheduler``: arrivals,
admission and preemption; ``engine``: continuous batching; ``timing``: a decode step's time against the batch;
``traces``: synthetic traces.

``analytic`` imports no torch and is loaded at once; the rest on first use.
"""

from .analytic import (DEFAULT_BLOCK_SIZE, PUBLISHED_MODELS, blocks_for_tokens,
                       kv_bytes, kv_bytes_per_token, kv_bytes_per_token_of,
                       slots_wasted_in_last_block)

__all__ = [
    "DEFAULT_BLOCK_SIZE", "PUBLISHED_MODELS", "kv_bytes", "kv_bytes_per_token",
    "kv_bytes_per_token_of", "blocks_for_tokens", "slots_wasted_in_last_block",
    "BlockAllocator", "OutOfBlocksError", "paged_attention", "slot_mapping", "write_kv",
    "PagedKVCache", "PagedStep", "KVCache", "generate", "Request", "Sequence", "Decision",
    "decide", "ContiguousAllocator", "Waste", "Scheduler", "Group", "Batch", "RESERVATIONS",
    "Engine", "ServeResult", "decode_step_seconds", "SHAREGPT", "ALPACA", "LengthDistribution", "synthetic_trace",
]
_SUBMODULES = ('allocator', 'attention', 'cache', 'contiguous', 'engine', 'reservation', 'sampling', 'scheduler', 'timing', 'traces')


def _load() -> dict:
    """Import the torch-side submodules and return their exports."""
    from .allocator import BlockAllocator, OutOfBlocksError
    from .attention import paged_attention, slot_mapping, write_kv
    from .cache import PagedKVCache, PagedStep
    from .contiguous import KVCache, generate
    from .engine import RESERVATIONS, Engine, ServeResult
    from .reservation import ContiguousAllocator, Waste
    from .sampling import Decision, Request, Sequence, decide
    from .scheduler import Batch, Group, Scheduler
    from .timing import decode_step_seconds
    from .traces import ALPACA, SHAREGPT, LengthDistribution, synthetic_trace
    return locals()


def __getattr__(name: str):
    """Load the torch-side exports (and submodules) on first use."""
    if name in __all__:
        exports = _load()
        globals().update(exports)  # as the eager imports did: an export wins over a submodule of its name
        return exports[name]
    if name in _SUBMODULES:
        globals().update(_load())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
