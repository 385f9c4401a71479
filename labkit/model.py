"""The tiny GPT used throughout the course: the GPT-2 architecture, sized by a dataclass.

Learned position embeddings, tied input/output embeddings, biases, pre-LayerNorm blocks,
a 4h GELU MLP and dropout (Radford et al. 2019). The attention core is its own module
(:class:`AttentionCore`) so that later chapters can recompute or replace it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import partial
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from .shapes import PRESETS as SHAPES
from .shapes import ModelShape
from .data import check_ids, check_targets
from .validate import ArgumentError, check_bool, check_float, check_int

__all__ = ["GPTConfig", "GPT", "AttentionCore", "KVCacheProtocol", "PRESETS", "get_preset", "count_params",
           "build_model", "training_flops"]


@dataclass(frozen=True)
class GPTConfig:
    """Model shape in the course's notation: L=n_layer, a=n_head, h=d_model, s=seq_len, V=vocab_size."""

    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    seq_len: int = 64
    vocab_size: int = 256
    dropout: float = 0.0

    def __post_init__(self):
        for name in ("n_layer", "n_head", "d_model", "seq_len", "vocab_size"):
            check_int(name, getattr(self, name), 1)
        if self.d_model % self.n_head != 0:
            raise ValueError(f"n_head={self.n_head} must divide d_model={self.d_model}")
        check_float("dropout", self.dropout, 0.0, below=1.0)  # "0.1" is refused here, not at forward

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)


# Published shapes. GPT-2 (Radford et al. 2019), GPT-3 175B (Brown et al. 2020, Table 2.1).
# "llama-7b-like" is approximate: LLaMA-7B's width, depth, heads, context (2048 tokens; 4096 is
# Llama 2's) and vocabulary (Touvron et al. 2023) on our GPT-2 block, which has a 4h GELU MLP instead of SwiGLU,
# LayerNorm instead of RMSNorm, learned positions instead of RoPE and tied embeddings:
# about 6.6B parameters instead of 6.7B.
def _gpt2_block(name: str) -> GPTConfig:
    """A runnable config of a GPT-2-block shape of :data:`labkit.shapes.PRESETS` (one source of shapes)."""
    shape = SHAPES[name]
    return GPTConfig(n_layer=shape.n_layer, n_head=shape.n_head, d_model=shape.d_model,
                     seq_len=shape.seq_len, vocab_size=shape.vocab_size)


PRESETS: dict[str, GPTConfig] = {
    **{name: _gpt2_block(name)
       for name in ("tiny", "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-175b")},
    "llama-7b-like": GPTConfig(n_layer=32, n_head=32, d_model=4096, seq_len=2048, vocab_size=32000),
}


def _check_config(cfg) -> None:
    if not isinstance(cfg, GPTConfig):
        raise ArgumentError(f"cfg={cfg!r} must be a GPTConfig or a preset name (labkit.model.PRESETS)")


def get_preset(name: str, **overrides) -> GPTConfig:
    """Return a named configuration, optionally with fields replaced (e.g. ``dropout=0.1``)."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ArgumentError(f"preset={name!r} is unknown; valid presets: {sorted(PRESETS)}")
    return GPTConfig(**{**PRESETS[name].to_dict(), **overrides})


def count_params(cfg: GPTConfig) -> int:
    """Exact parameter count Ψ of :class:`GPT` for ``cfg`` (tied embeddings counted once).

    Ψ = V h + s h + L (12 h² + 13 h) + 2 h: token and position embeddings; per block
    qkv (3h² + 3h), projection (h² + h), MLP (8h² + 5h), two LayerNorms (4h); final LayerNorm.
    """
    _check_config(cfg)
    return ModelShape.from_config(cfg).num_params()  # the formula lives once, in labkit.shapes


class AttentionCore(nn.Module):
    """softmax(q kᵀ / sqrt(d)) v with a causal mask and dropout on the probabilities.

    q, k, v: (B, nh, T, hs) -> (B, nh, T, hs). The (B, nh, T, T) scores are materialised:
    this is the 5as/h term of Korthikanti et al. (2022) that Chapter 7 removes.
    """

    def __init__(self, causal_mask: torch.Tensor, dropout: float):
        super().__init__()
        self.dropout = dropout
        # (S, S) bool, True above the diagonal; one tensor shared by every layer
        self.register_buffer("causal_mask", causal_mask, persistent=False)

    def forward(self, q, k, v):
        T, hs = q.size(-2), q.size(-1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
        att = att.masked_fill(self.causal_mask[:T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        if self.training and self.dropout > 0:
            att = F.dropout(att, p=self.dropout, training=True)
        return att @ v  # (B, nh, T, hs)


class CausalSelfAttention(nn.Module):
    """Multi-head attention. The number of heads is read from ``c_attn``'s width, so a rank that
    holds a subset of the heads (tensor parallelism, Chapter 5) runs this forward unchanged."""

    def __init__(self, cfg: GPTConfig, causal_mask: torch.Tensor):
        super().__init__()
        self.head_dim, self.dropout = cfg.head_dim, cfg.dropout
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.core = AttentionCore(causal_mask, cfg.dropout)

    def forward(self, x, attend=None):
        """``attend(q, k, v)``, when given, replaces ``core``: a KV cache's attention (Chapter 8)."""
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)  # 3 x (B, T, nh * hs)
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        y = (self.core if attend is None else attend)(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, nh * hs)
        y = self.c_proj(y)
        if self.training and self.dropout > 0:
            y = F.dropout(y, p=self.dropout, training=True)
        return y


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.dropout = cfg.dropout
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x):
        x = self.c_proj(F.gelu(self.c_fc(x)))  # (B, T, 4C) inside, (B, T, C) out
        if self.training and self.dropout > 0:
            x = F.dropout(x, p=self.dropout, training=True)
        return x


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, cfg: GPTConfig, causal_mask: torch.Tensor):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, causal_mask)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x, attend=None):
        x = x + (self.attn(self.ln_1(x)) if attend is None else self.attn(self.ln_1(x), attend))
        x = x + self.mlp(self.ln_2(x))
        return x


class KVCacheProtocol(Protocol):
    """What ``GPT.forward(idx, kv_cache=...)`` calls (Chapter 8: contiguous and paged caches)."""

    def begin(self, idx: torch.Tensor) -> torch.Tensor:
        """Positions (T,) or (B, T) of the T new tokens of idx (B, T)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store layer's new keys and values, attend q over all kept: (B, nh, T, hs) each."""


class GPT(nn.Module):
    """GPT-2. ``forward(idx)``: idx (B, T) int64 -> logits (B, T, V);
    ``forward(idx, targets)``: the mean cross-entropy loss over positions whose target is not -100."""

    def __init__(self, cfg: GPTConfig):
        _check_config(cfg)
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        mask = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).triu(diagonal=1)  # (S, S)
        self.blocks = nn.ModuleList(Block(cfg, mask) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    # The model's parts, in order, so that it can be cut into pipeline stages (Chapter 6):
    # embed -> blocks -> head -> loss. forward() is exactly their composition.
    def embed(self, idx, pos=None):
        """Token plus position embeddings (and dropout): idx (B, T) int64 -> x (B, T, C).
        ``pos``: positions, (T,) or (B, T); by default 0..T-1 (a KV cache passes its offsets).
        Ids and positions are range-checked where that is free (labkit.data.check_ids)."""
        check_ids("idx", idx, self.cfg.vocab_size)
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds seq_len={self.cfg.seq_len}")
        if pos is None:
            pos = torch.arange(T, device=idx.device)  # (T,)
        else:
            check_ids("pos", pos, self.cfg.seq_len, ndim=None, what="position", bound="seq_len")
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        if self.training and self.cfg.dropout > 0:
            x = F.dropout(x, p=self.cfg.dropout, training=True)
        return x

    def head(self, x):
        """Final LayerNorm and the (tied) output projection: x (B, T, C) -> logits (B, T, V)."""
        return self.lm_head(self.ln_f(x))

    @staticmethod
    def loss(logits, targets):
        """Mean cross-entropy over positions whose target is not -100: (B, T, V), (B, T) -> ().

        Where the targets are on the host, a target outside [0, V) and a batch whose every target
        is -100 (a mean over no tokens: torch returns nan) raise a ValueError."""
        check_targets(targets, logits)
        B, T = targets.shape
        return F.cross_entropy(logits.view(B * T, -1), targets.view(B * T), ignore_index=-100)

    def forward(self, idx, targets=None, kv_cache: KVCacheProtocol | None = None):
        """``kv_cache``: a :class:`KVCacheProtocol` (``begin`` gives positions, ``attend`` attends)."""
        pos = None if kv_cache is None else kv_cache.begin(idx)  # positions of the new tokens
        x = self.embed(idx, pos)  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x) if kv_cache is None else block(x, partial(kv_cache.attend, i))
        logits = self.head(x)  # (B, T, V)
        if targets is None:
            return logits
        return self.loss(logits, targets)


def build_model(cfg: GPTConfig | str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> GPT:
    """Build :class:`GPT` from a config or a preset name, on ``device`` (``"meta"`` allocates nothing).

    The weights are drawn on the CPU's generator, so a seed gives the same model on CPU and CUDA.
    """
    if isinstance(cfg, str):
        cfg = get_preset(cfg)
    _check_config(cfg)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ArgumentError(f"dtype={dtype!r} must be None or a floating torch.dtype (torch.bfloat16)")
    device = torch.device(device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or previous)  # create parameters in their final dtype
    try:
        if device.type in ("cpu", "meta"):
            with torch.device(device):
                return GPT(cfg)
        # Initialise on the CPU so a seed gives the same weights on every device, then move;
        # .to() copies a shared buffer once per module, so share the causal mask again.
        model = GPT(cfg).to(device)
        mask = model.blocks[0].attn.core.causal_mask
        for block in model.blocks:
            block.attn.core.causal_mask = mask
        return model
    finally:
        torch.set_default_dtype(previous)


def training_flops(cfg: GPTConfig, global_batch: int, recompute: bool = False) -> int:
    """Matmul FLOPs of one training step of :class:`GPT` on ``global_batch`` sequences of seq_len.

    Narayanan et al. (2021b), Appendix: per layer forward 24 B s h² + 4 B s² h, backward twice
    that, full recomputation one more forward; the logit layer 2 B s h V forward, 4 B s h V back:
    72 B s L h² (1 + s/(6h) + V/(12 L h)), or 96 B s L h² (1 + s/(6h) + V/(16 L h)) recomputing.
    """
    _check_config(cfg)
    check_int("global_batch", global_batch, 1)
    check_bool("recompute", recompute)
    B, s, h, L, V = global_batch, cfg.seq_len, cfg.d_model, cfg.n_layer, cfg.vocab_size
    layer_forward = 24 * B * s * h * h + 4 * B * s * s * h
    return (4 if recompute else 3) * L * layer_forward + 6 * B * s * h * V
