"""PagedAttention and a small serving engine (Chapter 8): the KV cache in fixed-size blocks.

``analytic``: bytes per token and blocks per sequence; ``contiguous``: the contiguous KV cache
of incremental decoding and greedy ``generate`` (the baseline); ``allocator``: the free list and
reference counts; ``attention``: attention through block tables; ``cache``: the paged KV cache
with copy-on-write and prefix sharing; ``step``: one forward's view of it; ``sampling``: requests, greedy, sampling and beam search;
``reservation``: contiguous reservation and the accounting of waste; ``scheduler``: arrivals,
admission and preemption; ``engine``: continuous batching; ``timing``: a decode step's time against the batch;
``traces``: synthetic traces.

``analytic`` imports no torch and is loaded at once; the rest on first use.
"""

from .._lazy import lazy_exports
from .analytic import (DEFAULT_BLOCK_SIZE, PUBLISHED_MODELS, blocks_for_tokens,
                       kv_bytes, kv_bytes_per_token, kv_bytes_per_token_of,
                       mla_kv_bytes_per_token, slots_wasted_in_last_block)

__all__ = [
    "DEFAULT_BLOCK_SIZE", "PUBLISHED_MODELS", "kv_bytes", "kv_bytes_per_token",
    "kv_bytes_per_token_of", "mla_kv_bytes_per_token", "blocks_for_tokens", "slots_wasted_in_last_block",
    "BlockAllocator", "OutOfBlocksError", "paged_attention", "slot_mapping", "write_kv",
    "write_slots", "gather_blocks",
    "PagedKVCache", "PagedStep", "KVCache", "generate", "Request", "Sequence", "Decision",
    "decide", "ContiguousAllocator", "Waste", "Scheduler", "Group", "Batch", "RESERVATIONS",
    "Engine", "ServeResult", "decode_step_seconds", "SHAREGPT", "ALPACA", "LengthDistribution", "synthetic_trace",
]

# the torch side loads on first use
__getattr__, __dir__ = lazy_exports(__name__, {
    ".allocator": ("BlockAllocator", "OutOfBlocksError"),
    ".attention": ("paged_attention", "slot_mapping", "write_kv", "write_slots", "gather_blocks"),
    ".cache": ("PagedKVCache",),
    ".step": ("PagedStep",),
    ".contiguous": ("KVCache", "generate"),
    ".engine": ("RESERVATIONS", "Engine", "ServeResult"),
    ".reservation": ("ContiguousAllocator", "Waste"),
    ".sampling": ("Decision", "Request", "Sequence", "decide"),
    ".scheduler": ("Batch", "Group", "Scheduler"),
    ".timing": ("decode_step_seconds",),
    ".traces": ("ALPACA", "SHAREGPT", "LengthDistribution", "synthetic_trace"),
})
