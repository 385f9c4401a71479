"""Swap the tiny GPT's attention core for FlashAttention (Chapter 7).

``apply_flash_attention(model, impl)`` replaces every block's ``attn.core`` (an
:class:`labkit.model.AttentionCore`) with :class:`FlashAttentionCore`: the PyTorch tiles, the Triton
kernels, or PyTorch's ``F.scaled_dot_product_attention``. None of them implements dropout on the
attention probabilities: in training with dropout > 0 the core raises ValueError.
"""

from __future__ import annotations


import torch.nn as nn
import torch.nn.functional as F

from ..model import check_gpt2_block
from ..validate import check_choice, check_float, check_int
from .tiled import flash_attention

__all__ = ["IMPLS", "FlashAttentionCore", "apply_flash_attention"]

IMPLS = ("pytorch", "triton", "sdpa")


class FlashAttentionCore(nn.Module):
    """Causal attention q, k, v (B, nh, T, hs) -> (B, nh, T, hs) without the (T, T) scores."""

    def __init__(self, impl: str = "pytorch", dropout: float = 0.0, block_q: int = 64, block_k: int = 64):
        super().__init__()
        check_choice("impl", impl, IMPLS)
        check_int("block_q", block_q, minimum=1)
        check_int("block_k", block_k, minimum=1)
        check_float("dropout", dropout, 0.0, 1.0)
        self.impl, self.dropout, self.block_q, self.block_k = impl, dropout, block_q, block_k

    def forward(self, q, k, v):
        if self.training and self.dropout > 0:
            raise ValueError(f"dropout={self.dropout} on the attention probabilities is not implemented by "
                             f"impl={self.impl!r}: train with dropout=0.0 or call model.eval()")
        if self.impl == "pytorch":
            return flash_attention(q, k, v, causal=True, block_q=self.block_q, block_k=self.block_k)
        if self.impl == "triton":
            from .triton_kernels import flash_attention_triton  # imported only when used
            return flash_attention_triton(q, k, v, causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)

    def extra_repr(self) -> str:
        return f"impl={self.impl!r}, block_q={self.block_q}, block_k={self.block_k}"


def apply_flash_attention(model: nn.Module, impl: str = "pytorch", *, block_q: int = 64,
                          block_k: int = 64) -> nn.Module:
    """Replace the attention core of every block of ``model`` (a labkit GPT) in place; returns it."""
    check_choice("impl", impl, IMPLS)
    check_int("block_q", block_q, minimum=1)
    check_int("block_k", block_k, minimum=1)
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError(f"model ({type(model).__name__}) has no .blocks: expected a labkit GPT")
    if getattr(model, "cfg", None) is not None:  # the core takes no window: refuse one
        check_gpt2_block(model.cfg, "apply_flash_attention", supports=(
            "norm", "mlp", "pos", "n_kv_head", "d_ff", "tie_embeddings", "bias", "n_positions"))
    for block in blocks:
        old = block.attn.core
        block.attn.core = FlashAttentionCore(impl, getattr(old, "dropout", 0.0), block_q, block_k)
    return model
