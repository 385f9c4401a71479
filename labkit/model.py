"""The course's model: GPT-2's block by default (Radford et al. 2019: learned positions, tied
embeddings, biases, pre-LayerNorm, a 4h GELU MLP, dropout); the Llama family and Mistral by their
config's fields (:mod:`labkit.layers`), experts (:mod:`labkit.moe`), MLA (:mod:`labkit.mla`). The
attention core is its own module (:class:`AttentionCore`), for later chapters to replace."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from functools import partial
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from .shapes import PRESETS as SHAPES
from .shapes import ModelShape, ShapeProperties
from .data import check_ids, check_targets
from .attention import causal_mask
from .layers import MLP, AttentionCore, Block, CausalSelfAttention, Rotary, make_norm
from .layers import repeat_kv
from .mla import MultiHeadLatentAttention, check_mla_config
from .moe.analytic import training_step_flops
from .moe.layer import MoE, check_moe_config, moe_layers, set_aux_grad_scale, with_aux_loss
from .validate import ArgumentError, check_float

__all__ = ["GPTConfig", "GPT", "AttentionCore", "KVCacheProtocol", "PRESETS", "get_preset", "count_params",
           "build_model", "training_flops", "check_gpt2_block", "Block", "CausalSelfAttention", "MLP", "repeat_kv"]


@dataclass(frozen=True)
class GPTConfig(ShapeProperties):
    """Model shape in the course's notation: L=n_layer, a=n_head, h=d_model, s=seq_len, V=vocab_size."""

    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    seq_len: int = 64
    vocab_size: int = 256
    dropout: float = 0.0
    # The block's kind (labkit.shapes.ModelShape's fields; the defaults are GPT-2's block)
    n_kv_head: int | None = None  # key-value heads; None (or n_head): multi-head attention
    d_ff: int | None = None  # the MLP's inner width; None: 4 h
    norm: str = "layernorm"  # or "rmsnorm"
    mlp: str = "gelu"  # or "swiglu"
    pos: str = "learned"  # or "rope"
    rope_theta: float = 10000.0  # θ of the rotary angles (pos="rope")
    tie_embeddings: bool = True
    bias: bool = True  # biases in every linear layer and LayerNorm
    sliding_window: int | None = None  # keys a query sees at most, itself included; None: all
    n_positions: int | None = None  # rows of the learned position table; None: seq_len
    norm_eps: float = 1e-5
    # Experts (labkit.moe; ModelShape's names): n_experts > 0 makes the MLP of each MoE layer
    # (ModelShape.is_moe_layer: past first_dense_layers, every moe_every-th) a mixture of experts
    n_experts: int = 0  # routed experts E; 0: dense
    experts_per_token: int = 0  # k of the top-k
    d_expert: int | None = None  # an expert's width; None: d_ff
    n_shared_experts: int = 0  # DeepSeek's always-on experts, one SwiGLU of width n_shared · d_shared
    d_shared: int | None = None  # None: d_expert
    router_bias: bool = False  # DeepSeek-V3's selection bias (a buffer: update_expert_bias moves it)
    first_dense_layers: int = 0  # DeepSeek's first_k_dense_replace
    moe_every: int = 1
    router_score: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = True  # renormalise the k weights (Mixtral: yes; Switch with k=1: no)
    routed_scaling_factor: float = 1.0  # the routed weights' scale (DeepSeek-V3: 2.5)
    capacity_factor: float | None = None  # None: dropless; else C = ceil(cf · N k / E) rows an expert
    aux_loss_coef: float = 0.0  # the load-balancing loss's weight in the training loss
    # Multi-head latent attention (labkit.mla; ModelShape's names): kv_lora_rank > 0 makes it MLA
    kv_lora_rank: int = 0  # the compressed key-value latent's width c; 0: no MLA
    q_lora_rank: int = 0  # the compressed query's width; 0: W^UQ and W^QR read h
    qk_rope_head_dim: int = 0  # the decoupled rotary part of a query and key head
    qk_nope_head_dim: int = 0  # the part of a query and key head without positions
    v_head_dim: int = 0  # a value head's size

    def __post_init__(self):
        ModelShape.from_config(self)  # the shape's fields, checked where they are defined
        check_float("dropout", self.dropout, 0.0, below=1.0)  # "0.1" is refused here, not at forward
        check_float("norm_eps", self.norm_eps, above=0.0)
        if self.pos == "rope" and self.head_dim % 2 and not self.kv_lora_rank:
            raise ArgumentError(f"pos='rope' needs an even head_dim, not d_model/n_head={self.head_dim}")
        check_moe_config(self)
        check_mla_config(self)

    def to_dict(self) -> dict:
        return asdict(self)


# Published shapes (labkit.shapes, each with its source), as runnable configs. "llama-7b-like"
# is approximate: LLaMA-7B's width, depth, heads, context (2048 tokens; 4096 is Llama 2's) and
# vocabulary (Touvron et al. 2023) on GPT-2's block: about 6.6B parameters instead of 6.7B.
# "opt-13b" counts exactly but runs GELU where OPT has ReLU, positions 0.. where OPT's start at 2.
def _from_shape(name: str) -> GPTConfig:
    """The runnable config of :data:`labkit.shapes.PRESETS`' ``name`` (one source of shapes)."""
    shape, names = SHAPES[name], {f.name for f in fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in shape.to_dict().items() if k in names})


PRESETS: dict[str, GPTConfig] = {  # the shapes labkit's block builds (none with experts, MLA, ...)
    **{name: _from_shape(name) for name, shape in SHAPES.items() if not shape.features()},
    "llama-7b-like": GPTConfig(n_layer=32, n_head=32, d_model=4096, seq_len=2048, vocab_size=32000),
}


# What GPT-2's block is, field by field: a technique that implements only this block refuses the rest.
_GPT2_BLOCK = {"norm": "layernorm", "mlp": "gelu", "pos": "learned", "n_kv_head": None, "d_ff": None,
               "tie_embeddings": True, "bias": True, "sliding_window": None, "n_positions": None,
               "n_experts": 0, "kv_lora_rank": 0}  # experts, MLA: refused where not yet tried


def check_gpt2_block(cfg: GPTConfig, technique: str, *, supports: tuple[str, ...] = ()) -> None:
    """Raise ValueError if ``cfg`` uses a Llama-family field ``technique`` does not implement yet."""
    def plain(k):  # multi-head written out (n_kv_head == n_head), or d_ff == 4h, are GPT-2's block too
        return (getattr(cfg, k) == _GPT2_BLOCK[k] or (k == "n_kv_head" and cfg.kv_heads == cfg.n_head)
                or (k == "d_ff" and cfg.ffn_dim == 4 * cfg.d_model))
    bad = [f"{k}={getattr(cfg, k)!r}" for k in _GPT2_BLOCK if k not in supports and not plain(k)]
    if bad:
        raise ValueError(f"{technique} implements GPT-2's block only so far; this model has {', '.join(bad)} "
                         f"(supported here: {', '.join(supports) or 'none of the Llama-family fields'})")


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

    GPT-2's block: Ψ = V h + s h + L (12 h² + 13 h) + 2 h: embeddings; per block qkv (3h² + 3h),
    projection (h² + h), MLP (8h² + 5h), two LayerNorms (4h); final LayerNorm. Every other block:
    :meth:`labkit.shapes.ModelShape.num_params`.
    """
    _check_config(cfg)
    return ModelShape.from_config(cfg).num_params()  # the formula lives once, in labkit.shapes


class KVCacheProtocol(Protocol):
    """What ``GPT.forward(idx, kv_cache=...)`` calls (Chapter 8: contiguous and paged caches).

    A model with a sliding window takes only a cache whose ``sliding_window`` attribute equals
    its own: one that lets each query see its last ``sliding_window`` keys only."""

    def begin(self, idx: torch.Tensor) -> torch.Tensor:
        """Positions (T,) or (B, T) of the T new tokens of idx (B, T)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store layer's new keys and values, attend q over all kept: q (B, nh, T, hs), k and v
        (B, n_kv, T, hs) (query head i reads key-value head i // (nh / n_kv): ``repeat_kv``;
        with rotary positions they come rotated), output (B, nh, T, hs)."""

    def attend_latent(self, layer: int, c_kv: torch.Tensor, k_rope: torch.Tensor, attend) -> torch.Tensor:
        """MLA: store [c_kv (B, T, c); rotated k_rope (B, T, d_rope)], return ``attend(latent,
        q_offset, absorb)``, latent (B, S, c + d_rope) of all kept, q_offset an int or (B,)."""


class GPT(nn.Module):
    """GPT-2, or a Llama-family model. ``forward(idx)``: idx (B, T) int64 -> logits (B, T, V);
    ``forward(idx, targets)``: the mean cross-entropy loss over positions whose target is not -100."""

    def __init__(self, cfg: GPTConfig):
        _check_config(cfg)
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        learned = cfg.pos == "learned"  # else rotary: no position table, q and k are rotated
        self.wpe = nn.Embedding(cfg.n_positions or cfg.seq_len, cfg.d_model) if learned else None
        mask = causal_mask(cfg.seq_len, cfg.seq_len, sliding_window=cfg.sliding_window)  # (S, S) visible
        mla = bool(cfg.kv_lora_rank)  # MLA's rotary part is its own, its pairs interleaved
        rope = None if learned else Rotary(cfg.qk_rope_head_dim if mla else cfg.head_dim, cfg.seq_len,
                                           cfg.rope_theta, interleaved=mla)
        shape = ModelShape.from_config(cfg)
        self.blocks = nn.ModuleList(Block(cfg, mask, rope, mlp=MoE(cfg) if shape.is_moe_layer(i) else None,
                                          attn=MultiHeadLatentAttention(cfg, mask, rope) if mla else None)
                                    for i in range(cfg.n_layer))
        self.ln_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
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
        With rotary positions there is no position table: the blocks rotate q and k.
        Ids and positions are range-checked where that is free (labkit.data.check_ids)."""
        check_ids("idx", idx, self.cfg.vocab_size)
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds seq_len={self.cfg.seq_len}")
        if pos is None:
            pos = torch.arange(T, device=idx.device)  # (T,)
        else:
            check_ids("pos", pos, self.cfg.seq_len, ndim=None, what="position", bound="seq_len")
        x = self.wte(idx) if self.wpe is None else self.wte(idx) + self.wpe(pos)  # (B, T, C)
        if self.training and self.cfg.dropout > 0:
            x = F.dropout(x, p=self.cfg.dropout, training=True)
        return x

    def head(self, x):
        """Final norm and the (tied or not) output projection: x (B, T, C) -> logits (B, T, V)."""
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
        window = self.cfg.sliding_window
        if kv_cache is not None and window is not None and getattr(kv_cache, "sliding_window", None) != window:
            raise ValueError(f"kv_cache={type(kv_cache).__name__} does not declare sliding_window={window}: "
                             "a cache for this model must attend within the window (KVCacheProtocol)")
        attend = "attend_latent" if self.cfg.kv_lora_rank else "attend"  # MLA's cache keeps the latent
        if kv_cache is not None and not callable(getattr(kv_cache, attend, None)):
            raise ValueError(f"kv_cache={type(kv_cache).__name__} has no {attend}(), which this model needs")
        pos = None if kv_cache is None else kv_cache.begin(idx)  # positions of the new tokens
        layers = moe_layers(self) if self.cfg.n_experts else []
        set_aux_grad_scale(layers, None)  # no aux gradient unless the loss below is differentiated
        x = self.embed(idx, pos)  # (B, T, C)
        rope_pos = pos if self.wpe is None else None  # rotary positions act in each block
        for i, block in enumerate(self.blocks):
            x = block(x) if kv_cache is None else block(x, partial(getattr(kv_cache, attend), i), rope_pos)
        logits = self.head(x)  # (B, T, V)
        if targets is None:
            return logits
        # plus aux_loss_coef times the MoE layers' load-balancing losses (labkit.moe: their
        # gradients join at the layers, scaled as this loss's backward is; none in eval)
        return with_aux_loss(self.loss(logits, targets), layers)


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
    Other blocks: 2 B s per weight of the layer's matmuls in place of 24 B s h² (GQA's smaller k and v,
    SwiGLU's three d_ff matrices; a sliding window's skipped scores still counted); a MoE layer: its
    router, k experts and shared experts a token (dropless). The formula: ``labkit.moe.analytic``."""
    _check_config(cfg)
    return training_step_flops(cfg, global_batch, recompute)
