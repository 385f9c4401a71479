"""The KV cache's size and the blocks a paged cache needs (Kwon et al. 2023, Sec. 2-4).

Bytes per token: 2 (a key and a value) x n_layer x n_kv_heads x head_dim x dtype bytes. With
grouped-query attention n_kv_heads < n_head (Ainslie et al. 2023); multi-head attention has
n_kv_heads = n_head.
"""

from __future__ import annotations

import math

from ..validate import check_int

__all__ = ["DEFAULT_BLOCK_SIZE", "PUBLISHED_MODELS", "kv_bytes_per_token", "kv_bytes_per_token_of",
           "kv_bytes", "blocks_for_tokens", "slots_wasted_in_last_block"]

DEFAULT_BLOCK_SIZE = 16  # tokens per block: vLLM's default (Kwon et al. 2023, Sec. 7.2)

# Published shapes: (n_layer, n_kv_heads, head_dim, the most tokens one sequence caches). OPT-13B
# (Zhang et al. 2022, Table 1: 40 layers, 40 heads, d_model 5120); Llama-2-7B and Llama-2-70B
# (Touvron et al. 2023, Table 1 and Sec. 2.2: 70B uses grouped-query attention with 8 key-value
# heads; d_model 4096 and 8192 with 32 and 64 query heads, so head_dim 128); Mistral-7B (Jiang
# et al. 2023, Table 1 and Sec. 2): its context is 8192 tokens, but its sliding window of 4096
# lets a rolling buffer cache at most 4096 tokens' keys and values.
PUBLISHED_MODELS: dict[str, tuple[int, int, int, int]] = {
    "OPT-13B": (40, 40, 128, 2048),
    "Llama-2-7B": (32, 32, 128, 4096),
    "Llama-2-70B (GQA)": (80, 8, 128, 4096),
    "Mistral-7B (GQA)": (32, 8, 128, 4096),
}


def kv_bytes_per_token(n_layer: int, n_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of keys and values one token keeps in the cache: 2 L n_kv head_dim e."""
    for name, value in [("n_layer", n_layer), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                        ("dtype_bytes", dtype_bytes)]:
        check_int(name, value, 1)
    return 2 * n_layer * n_kv_heads * head_dim * dtype_bytes


def kv_bytes_per_token_of(cfg, dtype_bytes: int = 2) -> int:
    """:func:`kv_bytes_per_token` of a labkit ``GPTConfig`` (multi-head: n_kv_heads = n_head)."""
    return kv_bytes_per_token(cfg.n_layer, cfg.n_head, cfg.head_dim, dtype_bytes)


def kv_bytes(num_tokens: int, n_layer: int, n_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of the KV cache of ``num_tokens`` tokens (summed over every sequence of a batch)."""
    check_int("num_tokens", num_tokens, 0)
    return num_tokens * kv_bytes_per_token(n_layer, n_kv_heads, head_dim, dtype_bytes)


def blocks_for_tokens(num_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Blocks a sequence of ``num_tokens`` tokens occupies: ceil(num_tokens / block_size)."""
    check_int("block_size", block_size, 1)
    check_int("num_tokens", num_tokens, 0)
    return math.ceil(num_tokens / block_size)


def slots_wasted_in_last_block(num_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Empty slots of a sequence's last block: the only internal fragmentation paging leaves."""
    return blocks_for_tokens(num_tokens, block_size) * block_size - num_tokens
