"""FlashAttention (Chapter 7): attention in tiles that never writes the (s_q, s_k) scores.

``reference``: standard attention and the input checks; ``tiled``: FlashAttention-2's forward and
backward on PyTorch tiles (:class:`FlashAttention`, :func:`flash_attention`); ``triton_kernels``:
the same as Triton kernels (:class:`FlashAttentionTriton`, imported on first use, so that labkit
imports without Triton); ``analytic``: HBM accesses and FLOPs; ``apply``: the GPT's core swapped.
"""

from .._lazy import lazy_exports
from .analytic import (TILES, AttentionCost, attention_flops, flash_block_size, hbm_accesses,
                       paper_block_sizes)
from .apply import IMPLS, FlashAttentionCore, apply_flash_attention
from .reference import causal_mask, check_inputs, standard_attention
from .tiled import FlashAttention, IOCounter, flash_attention

__all__ = [
    "IMPLS", "TILES", "AttentionCost", "FlashAttention", "FlashAttentionCore", "IOCounter",
    "apply_flash_attention", "attention_flops", "causal_mask", "check_inputs", "flash_attention",
    "flash_block_size", "hbm_accesses", "paper_block_sizes", "standard_attention",
]

# The Triton kernels are imported only when one of them is asked for; they are reached as
# attributes, not listed in __all__: a star import must not need Triton.
__getattr__, __dir__ = lazy_exports(__name__, {
    ".triton_kernels": ("FlashAttentionTriton", "flash_attention_triton"),
})
