"""Multi-head latent attention (MLA; DeepSeek-V2, Sec. 2.1): keys and values from one latent.

Eq. 9-11: c^KV = W^DKV h, kv_lora_rank wide (an RMSNorm follows it in the released model);
k^C = W^UK c^KV and v^C = W^UV c^KV, per head. Eq. 12-13: the query, optionally low-rank,
c^Q = W^DQ h (and its RMSNorm), q^C = W^UQ c^Q. Eq. 14-17, the decoupled rotary key: q^R =
RoPE(W^QR c^Q) per head, k^R = RoPE(W^KR h) one for every head; q = [q^C; q^R], k = [k^C; k^R],
softmax scale 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim). A cache keeps [c^KV; k^R] per token
and layer, kv_lora_rank + qk_rope_head_dim elements (``ModelShape.kv_cache_width``). Decoding
may absorb W^UK into the query and W^UV into the output (Sec. 2.1.2): attention then runs over
the cached [c^KV; k^R] as one key head shared by every query head, its first kv_lora_rank
entries the value. Rotary pairs are interleaved (dimensions 2i, 2i + 1), DeepSeek's layout.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import reference_attention
from .layers import AttentionCore, RMSNorm
from .validate import ArgumentError, check_bool

__all__ = ["LATENT_NORM_EPS", "MultiHeadLatentAttention", "check_mla_config"]

LATENT_NORM_EPS = 1e-6  # eps of the two latent RMSNorms in DeepSeek's released code (not rms_norm_eps)


def check_mla_config(cfg) -> None:
    """What labkit's MLA models of a config (ModelShape checks the sizes): rotary positions, an
    even rotary head, no sliding window, no biases (DeepSeek-V2's projections have none)."""
    if not cfg.kv_lora_rank:
        return
    checks = (("pos", cfg.pos == "rope"), ("sliding_window", cfg.sliding_window is None), ("bias", cfg.bias is False))
    bad = [f"{name}={getattr(cfg, name)!r}" for name, ok in checks if not ok]
    if bad:
        raise ArgumentError(f"MLA (kv_lora_rank={cfg.kv_lora_rank}) is modelled with pos='rope', "
                            f"sliding_window=None and bias=False only; this config has {', '.join(bad)}")
    if cfg.qk_rope_head_dim % 2:
        raise ArgumentError(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even (rotary pairs)")


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek-V2's attention (module docstring), with the paper's matrices by name.

    ``forward(x, attend=None, pos=None)``: x (B, T, C) -> (B, T, C). ``attend``, when given, is a
    cache's ``attend_latent(c_kv, k_rope, attend)`` (:class:`labkit.model.KVCacheProtocol`)."""

    def __init__(self, cfg, causal_mask: torch.Tensor, rope: nn.Module):
        super().__init__()
        h, a, c = cfg.d_model, cfg.n_head, cfg.kv_lora_rank
        self.d_nope, self.d_rope, self.d_v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.scale, self.dropout = (self.d_nope + self.d_rope) ** -0.5, cfg.dropout
        self.w_dq = nn.Linear(h, cfg.q_lora_rank, bias=False) if cfg.q_lora_rank else None  # W^DQ
        self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS) if cfg.q_lora_rank else None
        q_in = cfg.q_lora_rank or h  # without a compressed query, W^UQ and W^QR read h (W^Q)
        self.w_uq = nn.Linear(q_in, a * self.d_nope, bias=False)  # W^UQ
        self.w_qr = nn.Linear(q_in, a * self.d_rope, bias=False)  # W^QR
        self.w_dkv = nn.Linear(h, c, bias=False)  # W^DKV
        self.kv_norm = RMSNorm(c, LATENT_NORM_EPS)
        self.w_kr = nn.Linear(h, self.d_rope, bias=False)  # W^KR
        self.w_uk = nn.Linear(c, a * self.d_nope, bias=False)  # W^UK
        self.w_uv = nn.Linear(c, a * self.d_v, bias=False)  # W^UV
        self.c_proj = nn.Linear(a * self.d_v, h, bias=False)  # W^O
        self.rope = rope  # one interleaved Rotary of qk_rope_head_dim, shared by every layer
        self.core = AttentionCore(causal_mask, cfg.dropout)

    def forward(self, x, attend=None, pos=None):
        B, T, _ = x.shape
        c_q = x if self.w_dq is None else self.q_norm(self.w_dq(x))  # (B, T, q_lora_rank or C)
        q_c = self.w_uq(c_q).view(B, T, -1, self.d_nope).transpose(1, 2)  # (B, nh, T, d_nope)
        q_r = self.w_qr(c_q).view(B, T, -1, self.d_rope).transpose(1, 2)  # (B, nh, T, d_rope)
        c_kv = self.kv_norm(self.w_dkv(x))  # (B, T, c): what a cache keeps
        k_r = self.w_kr(x).unsqueeze(1)  # (B, 1, T, d_rope): one rotary key for every head
        q_r, k_r = self.rope(q_r, k_r, pos)  # rotated by their absolute positions
        if attend is None:
            y = self.core(*self.expand(q_c, q_r, c_kv, k_r))  # (B, nh, T, d_v)
        else:
            y = attend(c_kv, k_r.squeeze(1), partial(self.attend_latent, q_c, q_r))  # (B, nh, T, d_v)
        y = self.c_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, nh d_v) -> (B, T, C)
        if self.training and self.dropout > 0:
            y = F.dropout(y, p=self.dropout, training=True)
        return y

    def expand(self, q_c, q_r, c_kv, k_r):
        """Eq. 10-11 and 16-17: per-head q, k (B, nh, ., d_nope + d_rope) and v (B, nh, S, d_v)
        from the latent c_kv (B, S, c) and the shared rotary key k_r (B, 1, S, d_rope)."""
        B, S, _ = c_kv.shape
        k_c = self.w_uk(c_kv).view(B, S, -1, self.d_nope).transpose(1, 2)  # (B, nh, S, d_nope)
        v = self.w_uv(c_kv).view(B, S, -1, self.d_v).transpose(1, 2)  # (B, nh, S, d_v)
        k = torch.cat([k_c, k_r.expand(-1, k_c.size(1), -1, -1)], dim=-1)  # (B, nh, S, d_nope + d_rope)
        return torch.cat([q_c, q_r], dim=-1), k, v

    def attend_latent(self, q_c, q_r, latent, q_offset, absorb: bool = False):
        """Attention of the new queries over a cache's ``latent`` (B, S, c + d_rope) = [c^KV; k^R],
        query i at position q_offset + i (an int, or (B,) per sequence). ``absorb``: W^UK folded
        into the query and W^UV applied after attention (Sec. 2.1.2), never forming k or v."""
        check_bool("absorb", absorb)
        c = self.w_dkv.out_features
        if not absorb:
            q, k, v = self.expand(q_c, q_r, latent[..., :c], latent[..., c:].unsqueeze(1))
            return reference_attention(q, k, v, causal=True, q_offset=q_offset, scale=self.scale,
                                       softmax_dtype=q.dtype)  # (B, nh, T, d_v)
        nh = q_c.size(1)
        w_uk = self.w_uk.weight.view(nh, self.d_nope, c)  # (nh, d_nope, c)
        q = torch.cat([torch.einsum("bhtd,hdc->bhtc", q_c, w_uk), q_r], dim=-1)  # (B, nh, T, c + d_rope)
        kv = latent.unsqueeze(1)  # (B, 1, S, c + d_rope): one key head; its first c entries the value
        o = reference_attention(q, kv, kv[..., :c], causal=True, q_offset=q_offset, scale=self.scale,
                                softmax_dtype=q.dtype)  # (B, nh, T, c)
        w_uv = self.w_uv.weight.view(nh, self.d_v, c)  # (nh, d_v, c)
        return torch.einsum("bhtc,hvc->bhtv", o, w_uv)  # (B, nh, T, d_v)
