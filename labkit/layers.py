"""The transformer block and its parts, for GPT-2 and the Llama family.

GPT-2 (Radford et al. 2019): LayerNorm, a GELU MLP, learned positions. Llama (Touvron et al.
2023): RMSNorm (Zhang and Sennrich 2019), a SwiGLU MLP (Shazeer 2020), rotary position
embeddings (Su et al. 2021), grouped-query attention (Ainslie et al. 2023). Mistral 7B (Jiang
et al. 2023) adds a sliding window to the causal mask. :class:`Block` assembles them as its
config asks; :mod:`labkit.model` builds the model (and re-exports the block's classes).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import causal_mask as visible_keys
from .attention import reference_attention

__all__ = ["RMSNorm", "make_norm", "MLP", "SwiGLU", "make_mlp", "Rotary", "repeat_kv",
           "make_causal_mask", "AttentionCore", "CausalSelfAttention", "Block"]


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · g: a scale and no shift, no mean subtracted (Zhang and Sennrich 2019).

    x (..., C) -> (..., C). Computed in at least float32 (a bf16 input is upcast, as Llama's own
    code does), then cast back before the scale.
    """

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x):
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., C)
        return self.weight * y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}"


def make_norm(cfg) -> nn.Module:
    """The block's norm: LayerNorm (with a shift only when ``cfg.bias``) or RMSNorm."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


class MLP(nn.Module):
    """GPT-2's MLP: c_proj(gelu(c_fc(x))), inner width d_ff (4h by default)."""

    def __init__(self, cfg):
        super().__init__()
        self.dropout = cfg.dropout
        self.c_fc = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)

    def forward(self, x):
        x = self.c_proj(F.gelu(self.c_fc(x)))  # (B, T, d_ff) inside, (B, T, C) out
        if self.training and self.dropout > 0:
            x = F.dropout(x, p=self.dropout, training=True)
        return x


class SwiGLU(nn.Module):
    """Llama's MLP: c_proj(silu(c_gate(x)) * c_fc(x)) (Shazeer 2020), inner width d_ff.

    gate, up, down are ``c_gate``, ``c_fc``, ``c_proj`` (Hugging Face: gate_proj, up_proj,
    down_proj; Meta: w1, w3, w2). x (B, T, C) -> (B, T, C).
    """

    def __init__(self, cfg):
        super().__init__()
        self.dropout = cfg.dropout
        self.c_gate = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.c_fc = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)

    def forward(self, x):
        x = self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x))  # (B, T, d_ff) inside
        if self.training and self.dropout > 0:
            x = F.dropout(x, p=self.dropout, training=True)
        return x


def make_mlp(cfg) -> nn.Module:
    return SwiGLU(cfg) if cfg.mlp == "swiglu" else MLP(cfg)


class Rotary(nn.Module):
    """Rotary position embeddings (Su et al. 2021), in Hugging Face's half-split layout.

    Dimension i of a head is paired with i + hs/2 and the pair is rotated by the angle
    p · θ^(-2i/hs) of the token's absolute position p (``interleaved``: dimensions 2i and 2i + 1
    are paired, the layout of Su et al. and DeepSeek's code). The (S, hs/2) cos and sin tables
    are computed in float64 and stored in the model's dtype; one instance serves every layer.
    """

    def __init__(self, head_dim: int, seq_len: int, theta: float, interleaved: bool = False):
        super().__init__()
        self.interleaved = interleaved
        half = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim  # (hs/2,)
        angle = torch.arange(seq_len, dtype=torch.float64)[:, None] * theta ** -half  # (S, hs/2)
        dtype = torch.get_default_dtype()
        self.register_buffer("cos", angle.cos().to(dtype), persistent=False)  # (S, hs/2)
        self.register_buffer("sin", angle.sin().to(dtype), persistent=False)  # (S, hs/2)

    def forward(self, q, k, pos=None):
        """Rotate q (B, nh, T, hs) and k (B, n_kv, T, hs); ``pos``: positions (T,) or (B, T),
        by default 0..T-1."""
        T = q.size(-2)
        cos, sin = (self.cos[:T], self.sin[:T]) if pos is None else (self.cos[pos], self.sin[pos])
        if cos.dim() == 3:  # per-sequence positions (B, T, hs/2) -> (B, 1, T, hs/2)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rotate = _rotate_pairs if self.interleaved else _rotate
        return rotate(q, cos, sin), rotate(k, cos, sin)


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)  # 2 x (B, nh, T, hs/2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (B, nh, T, hs)


def _rotate_pairs(x, cos, sin):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)  # 2 x (B, nh, T, hs/2): dimensions 2i, 2i + 1
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)  # (B, nh, T, hs)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Grouped-query attention: (B, n_kv, T, hs) -> (B, n_kv · n_rep, T, hs); query head i
    reads key-value head i // n_rep (Ainslie et al. 2023)."""
    if n_rep == 1:
        return x
    B, n_kv, T, hs = x.shape
    return x[:, :, None].expand(B, n_kv, n_rep, T, hs).reshape(B, n_kv * n_rep, T, hs)


def make_causal_mask(seq_len: int, sliding_window: int | None = None) -> torch.Tensor:
    """(S, S) bool, True where query i may not see key j: j > i, and with a sliding window
    also j <= i - window (each query sees its last ``window`` tokens, itself included).
    The complement of :func:`labkit.attention.causal_mask`, which the model's core keeps."""
    return ~visible_keys(seq_len, seq_len, sliding_window=sliding_window)  # (S, S)


class AttentionCore(nn.Module):
    """softmax(q kᵀ / sqrt(d)) v with a causal mask and dropout on the probabilities.

    q, k, v: (B, nh, T, hs) -> (B, nh, T, hs), by :func:`labkit.attention.reference_attention`
    with the softmax in the activations' dtype. The (B, nh, T, T) scores are materialised: this
    is the 5as/h term of Korthikanti et al. (2022) that Chapter 7 removes.
    """

    def __init__(self, causal_mask: torch.Tensor, dropout: float):
        super().__init__()
        self.dropout = dropout
        # (S, S) bool, True where a key is visible (labkit.attention.causal_mask: the past and
        # present, within a sliding window); one tensor shared by every layer, so the slice the
        # backward keeps is no new activation
        self.register_buffer("causal_mask", causal_mask, persistent=False)

    def forward(self, q, k, v):
        T = q.size(-2)
        return reference_attention(q, k, v, mask=self.causal_mask[:T, :T], softmax_dtype=q.dtype,
                                   dropout_p=self.dropout if self.training else 0.0)  # (B, nh, T, hs)


class CausalSelfAttention(nn.Module):
    """Multi-head or grouped-query attention, rotary positions optional.

    ``c_attn`` projects to [q; k; v], nh heads of queries and n_kv of keys and values. Head
    counts are read from ``c_attn``'s width and the ratio nh / n_kv, so that a rank holding a
    subset of the heads (tensor parallelism, Chapter 5) runs this forward unchanged."""

    def __init__(self, cfg, causal_mask: torch.Tensor, rope: Rotary | None = None):
        super().__init__()
        self.head_dim, self.dropout = cfg.head_dim, cfg.dropout
        self.q_per_kv = cfg.n_head // cfg.kv_heads  # query heads per key-value head
        self.c_attn = nn.Linear(cfg.d_model, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.rope = rope  # one Rotary shared by every layer, or None (learned positions)
        self.core = AttentionCore(causal_mask, cfg.dropout)

    def forward(self, x, attend=None, pos=None):
        """``attend(q, k, v)``, when given, replaces ``core``: a KV cache's attention (Chapter 8);
        it receives the n_kv key-value heads, rotated. ``pos``: the positions rope rotates by."""
        B, T, _ = x.shape
        qkv = self.c_attn(x)  # (B, T, (nh + 2 n_kv) hs)
        kv_width = qkv.size(-1) // (self.q_per_kv + 2)  # n_kv hs
        q, k, v = qkv.split([self.q_per_kv * kv_width, kv_width, kv_width], dim=-1)
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hs)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_kv, T, hs)
        if self.rope is not None:
            q, k = self.rope(q, k, pos)  # rotated by their absolute positions
        if attend is None:
            k, v = repeat_kv(k, self.q_per_kv), repeat_kv(v, self.q_per_kv)  # (B, nh, T, hs)
            y = self.core(q, k, v)  # (B, nh, T, hs)
        else:
            y = attend(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, nh * hs)
        y = self.c_proj(y)
        if self.training and self.dropout > 0:
            y = F.dropout(y, p=self.dropout, training=True)
        return y


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)).

    ``mlp``, ``attn``: modules in place of the config's MLP and attention (the model passes a
    mixture of experts, multi-head latent attention)."""

    def __init__(self, cfg, causal_mask: torch.Tensor, rope: Rotary | None = None, mlp: nn.Module | None = None,
                 attn: nn.Module | None = None):
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg, causal_mask, rope) if attn is None else attn
        self.ln_2 = make_norm(cfg)
        self.mlp = make_mlp(cfg) if mlp is None else mlp

    def forward(self, x, attend=None, pos=None):
        h = self.ln_1(x)
        if pos is not None:
            x = x + self.attn(h, attend, pos)
        else:  # called as before rotary positions, for attention modules that take (x, attend)
            x = x + (self.attn(h) if attend is None else self.attn(h, attend))
        x = x + self.mlp(self.ln_2(x))
        return x
