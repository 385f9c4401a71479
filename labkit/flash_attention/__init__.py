"""FlashAttention (Chapter 7): attention in tiles that never writes the (s_q, s_k) scores.

``reference``: standard attention and the input checks; ``tiled``: FlashAttention-2's forward and
backward on PyTorch tiles (:class:`FlashAttention`, :func:`flash_attention`); ``triton_kernels``:
the same as Triton kernels (:class:`FlashAttentionTriton`, imported on first use, so that labkit
imports without Triton); ``analytic``: HBM accesses and FLOPs; ``apply``: the GPT's core swapped.
"""

from .analytic import AttentionCost, attention_flops, flash_block_size, hbm_accesses  # noqa: F401
from .apply import IMPLS, FlashAttentionCore, apply_flash_attention  # noqa: F401
from .reference import causal_mask, check_inputs, standard_attention  # noqa: F401
from .tiled import FlashAttention, IOCounter, flash_attention  # noqa: F401

_LAZY = ("FlashAttentionTriton", "flash_attention_triton")


def __getattr__(name):
    """Import the Triton kernels only when one of them is asked for."""
    if name in _LAZY:
        from . import triton_kernels
        return getattr(triton_kernels, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
