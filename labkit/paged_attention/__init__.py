"""PagedAttention and a small serving engine (Chapter 8): the KV cache in fixed-size blocks.

``analytic``: bytes per token and blocks per sequence; ``allocator``: the free list and reference
counts; ``attention``: attention through block tables; ``cache``: the paged KV cache with
copy-on-write and prefix sharing; ``sampling``: requests, greedy, sampling and beam search;
``reservation``: contiguous reservation and the accounting of waste; ``engine``: continuous
batching with preemption; ``traces``: synthetic request traces.
"""

from .analytic import (DEFAULT_BLOCK_SIZE, PUBLISHED_MODELS, blocks_for_tokens, kv_bytes,  # noqa: F401
                       kv_bytes_per_token, kv_bytes_per_token_of, slots_wasted_in_last_block)
from .allocator import BlockAllocator, OutOfBlocksError  # noqa: F401
from .attention import paged_attention, slot_mapping, write_kv  # noqa: F401
from .cache import PagedKVCache, PagedStep  # noqa: F401
from .sampling import Request, Sequence  # noqa: F401
from .reservation import ContiguousAllocator, Waste  # noqa: F401
from .engine import RESERVATIONS, Engine, ServeResult  # noqa: F401
from .traces import SHAREGPT, ALPACA, LengthDistribution, synthetic_trace  # noqa: F401
