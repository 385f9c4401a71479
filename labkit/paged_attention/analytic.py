"""The KV cache's size and the blocks a paged cache needs (Kwon et al. 2023, Sec. 2-4).

Bytes per token: 2 (a key and a value) x n_layer x n_kv_heads x head_dim x dtype bytes. With
grouped-query attention n_kv_heads < n_head (Ainslie et al. 2023); multi-head attention has
n_kv_heads = n_head. Multi-head latent attention (DeepSeek-V2, Sec. 2.1) keeps no key or value:
n_layer x (kv_lora_rank + qk_rope_head_dim) x dtype bytes, its latent and rotary key.
"""

from __future__ import annotations

import math

from ..shapes import PRESETS
from ..validate import check_int

__all__ = ["DEFAULT_BLOCK_SIZE", "PUBLISHED_MODELS", "kv_bytes_per_token", "mla_kv_bytes_per_token",
           "kv_bytes_per_token_of", "cached_tokens",
           "kv_bytes", "blocks_for_tokens", "slots_wasted_in_last_block"]

DEFAULT_BLOCK_SIZE = 16  # tokens per block: vLLM's default (Kwon et al. 2023, Sec. 7.2)

# Published shapes, read from labkit.shapes.PRESETS (each cited there): (n_layer, n_kv_heads,
# head_dim, the most tokens one sequence caches). Llama-2-70B and Mistral-7B use grouped-query
# attention with 8 key-value heads; Mistral-7B's sliding window of 4096 lets a rolling buffer
# cache at most 4096 tokens' keys and values, whatever its context.
_PUBLISHED = {"OPT-13B": "opt-13b", "Llama-2-7B": "llama-2-7b", "Llama-2-70B (GQA)": "llama-2-70b",
              "Mistral-7B (GQA)": "mistral-7b"}


def _cache_shape(shape) -> tuple[int, int, int, int]:
    return (shape.n_layer, shape.kv_heads, shape.head_dim, cached_tokens(shape, shape.seq_len))


def cached_tokens(shape, context_len: int) -> int:
    """Tokens whose keys and values one sequence of ``context_len`` tokens keeps: all of them,
    or the last ``sliding_window`` (a rolling buffer, Jiang et al. 2023)."""
    check_int("context_len", context_len, 1)
    window = getattr(shape, "sliding_window", None)
    return context_len if window is None else min(window, context_len)


PUBLISHED_MODELS: dict[str, tuple[int, int, int, int]] = {
    name: _cache_shape(PRESETS[key]) for name, key in _PUBLISHED.items()}


def kv_bytes_per_token(n_layer: int, n_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of keys and values one token keeps in the cache: 2 L n_kv head_dim e."""
    for name, value in [("n_layer", n_layer), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                        ("dtype_bytes", dtype_bytes)]:
        check_int(name, value, 1)
    return 2 * n_layer * n_kv_heads * head_dim * dtype_bytes


def mla_kv_bytes_per_token(n_layer: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype_bytes: int) -> int:
    """Bytes MLA keeps a token: L (c + d_rope) e, the latent c^KV and the rotary key k^R a layer
    (DeepSeek-V2, Sec. 2.1.4: (d_c + d_h^R) l elements), whatever the number of heads."""
    for name, value in [("n_layer", n_layer), ("kv_lora_rank", kv_lora_rank),
                        ("qk_rope_head_dim", qk_rope_head_dim), ("dtype_bytes", dtype_bytes)]:
        check_int(name, value, 1)
    return n_layer * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes


def kv_bytes_per_token_of(cfg, dtype_bytes: int = 2) -> int:
    """:func:`kv_bytes_per_token` of a labkit ``GPTConfig`` or a ``ModelShape``: n_kv_heads is its
    ``kv_heads`` (n_head for multi-head attention, fewer with grouped-query attention); with
    MLA (``kv_lora_rank`` > 0), :func:`mla_kv_bytes_per_token`."""
    if getattr(cfg, "kv_lora_rank", 0):
        return mla_kv_bytes_per_token(cfg.n_layer, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype_bytes)
    return kv_bytes_per_token(cfg.n_layer, cfg.kv_heads, cfg.head_dim, dtype_bytes)


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
