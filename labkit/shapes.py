"""Published model shapes, torch-free: GPT-2's block, the Llama family and today's released models.

A :class:`ModelShape` is what a memory estimate needs to know of a model: L = ``n_layer``, h =
``d_model``, a = ``n_head``, n_kv = ``n_kv_head``, the head size, the MLP width ``d_ff``, V =
``vocab_size``, s = ``seq_len``, the block's kind, its attention windows, its experts and MLA's
compressed cache. ``from_hf_config`` reads a config.json by its model_type (:mod:`labkit.hf_config`);
the released presets are their config.json files (:mod:`labkit.released_configs`). No torch here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache

from .hf_config import HF_CONFIG_FIELDS, shape_fields
from .released_configs import RELEASED
from .shape_rules import GATED, ShapeProperties, check_shape, features, layer_split
from .validate import ArgumentError, check_int

__all__ = ["ModelShape", "ShapeProperties", "PRESETS", "preset", "HF_CONFIG_FIELDS", "layer_split"]


@dataclass(frozen=True)
class ModelShape(ShapeProperties):
    """The shape of a decoder-only transformer in the course's notation (see the module docstring).

    Beside each field, the config.json key it is read from (:mod:`labkit.hf_config`)."""

    n_layer: int  # num_hidden_layers
    d_model: int  # hidden_size
    n_head: int  # num_attention_heads
    vocab_size: int  # vocab_size
    seq_len: int  # max_position_embeddings
    n_kv_head: int | None = None  # num_key_value_heads; None: multi-head attention (n_kv_head = n_head)
    d_ff: int | None = None  # intermediate_size (Llama 4: intermediate_size_mlp); None: 4 h, GPT-2's MLP
    norm: str = "layernorm"
    mlp: str = "gelu"  # "swiglu" (hidden_act silu), "geglu" (gelu_pytorch_tanh: Gemma)
    pos: str = "learned"
    tie_embeddings: bool = True  # tie_word_embeddings
    bias: bool = True  # a bias in every linear layer and LayerNorm (GPT-2)
    sliding_window: int | None = None  # sliding_window (Llama 4: attention_chunk_size); None: all keys
    n_positions: int | None = None  # rows of a learned position table, if not seq_len (OPT: s + 2)
    rope_theta: float = 10000.0  # rope_theta; θ of the rotary angles; no parameter depends on it
    d_head: int | None = None  # head_dim, where it is not d_model / n_head (Qwen3, Gemma, Mistral-Nemo)
    qkv_bias: bool = False  # biases of W_q, W_k, W_v alone (Qwen2's, always; gpt-oss: attention_bias)
    o_bias: bool = False  # a bias on W_o (gpt-oss: attention_bias)
    qk_norm: bool = False  # an RMSNorm of head_dim on q and on k (Qwen3, always)
    ffn_norms: bool = False  # Gemma 2's pre- and post-feed-forward RMSNorms: four norms a block
    attn_sinks: bool = False  # gpt-oss: a learned sink logit a head a layer
    full_attention_every: int | None = None  # layer_types: every k-th layer full, the others windowed
    chunked_attention: bool = False  # Llama 4: the windowed layers attend within fixed chunks
    n_experts: int = 0  # num_local_experts, num_experts, n_routed_experts: routed experts; 0: dense
    experts_per_token: int = 0  # num_experts_per_tok (gpt-oss: experts_per_token): top-k
    d_expert: int | None = None  # moe_intermediate_size (Llama 4: intermediate_size); None: d_ff
    n_shared_experts: int = 0  # n_shared_experts (DeepSeek); 1 for Qwen2-MoE's and Llama 4's
    d_shared: int | None = None  # shared_expert_intermediate_size (Qwen2-MoE); None: d_expert
    shared_gate: bool = False  # Qwen2-MoE's sigmoid gate on its shared expert (a (1, h) weight)
    router_bias: bool = False  # a router bias (gpt-oss; DeepSeek-V3's e_score_correction_bias)
    expert_bias: bool = False  # biases in every expert's matrices (gpt-oss)
    first_dense_layers: int = 0  # first_k_dense_replace: the first layers dense, of width d_ff
    moe_every: int = 1  # decoder_sparse_step, interleave_moe_layer_step: MoE when (i + 1) % k == 0
    dense_layers: tuple = ()  # mlp_only_layers (Qwen MoE): layers kept dense
    kv_lora_rank: int = 0  # kv_lora_rank: MLA's compressed key-value width; 0: no MLA
    q_lora_rank: int = 0  # q_lora_rank: MLA's compressed query width; 0 (null): W_q direct
    qk_rope_head_dim: int = 0  # qk_rope_head_dim: MLA's rotary part of a query/key head
    qk_nope_head_dim: int = 0  # qk_nope_head_dim: MLA's part without positions
    v_head_dim: int = 0  # v_head_dim: MLA's value head size
    n_mtp_layers: int = 0  # num_nextn_predict_layers: multi-token prediction, not in num_params
    weight_format: str | None = None  # quantization_config.quant_method: stored as, not counted as
    source: str = ""  # what was read when not the whole config (a multimodal model's text_config)

    def __post_init__(self):
        check_shape(self)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) routes to experts: past first_dense_layers, every
        moe_every-th, not in dense_layers (DeepSeek's, Qwen's and Llama 4's rules, one rule)."""
        return bool(self.n_experts) and layer >= self.first_dense_layers and \
            (layer + 1) % self.moe_every == 0 and layer not in self.dense_layers

    @property
    def expert_dim(self) -> int:
        return self.ffn_dim if self.d_expert is None else self.d_expert

    @property
    def shared_dim(self) -> int:
        return self.expert_dim if self.d_shared is None else self.d_shared

    @property
    def active_ffn_dim(self) -> int:
        """The widest MLP a token passes through: d_ff in a dense layer; in a MoE layer its k
        experts' and the shared experts' widths summed."""
        moe = self.experts_per_token * self.expert_dim + self.n_shared_experts * self.shared_dim
        dense = any(not self.is_moe_layer(i) for i in range(self.n_layer))
        return max(self.ffn_dim if dense else 0, moe if self.n_experts else 0)

    def layer_params(self, tp_size: int = 1, layer: int = 0) -> int:
        """Parameters of block ``layer`` (on one of ``tp_size`` tensor-parallel ranks): attention,
        MLP or experts, norms. Megatron's split: W_q, W_k, W_v, W_o, the MLPs' and experts'
        matrices and the column-parallel biases are divided by t; the norms, the router, MLA's
        down-projections and the row-parallel biases are whole on every rank."""
        t = self.check_tp_size(tp_size)
        check_int("layer", layer, 0, self.n_layer - 1)
        return self._block_params(t, self.is_moe_layer(layer))

    def _block_params(self, t: int, moe: bool) -> int:
        ffn = self._moe_params(t) if moe else self._mlp_params(self.ffn_dim, t)
        return self._attention_params(t) + ffn + (4 if self.ffn_norms else 2) * self.norm_params()

    def _attention_params(self, t: int) -> int:
        h, hd, a, kv = self.d_model, self.head_dim, self.n_head, self.kv_heads
        if self.kv_lora_rank:  # MLA (DeepSeek-V2, Sec. 2.1): W_DQ, W_UQ; W_DKV (+ the rope key), W_UK, W_UV
            r, c, v = self.qk_rope_head_dim, self.kv_lora_rank, self.v_head_dim
            q = h * a * hd // t if not self.q_lora_rank else \
                self.q_lora_rank * (h + 1) + self.q_lora_rank * a * hd // t  # + its RMSNorm
            return q + h * (c + r) + c + c * a * (self.qk_nope_head_dim + v) // t + a * v * h // t
        n = (h * a * hd + 2 * h * kv * hd + a * hd * h) // t  # W_q, W_k, W_v, W_o
        n += (a * hd + 2 * kv * hd) // t if self.bias or self.qkv_bias else 0
        n += h if self.bias or self.o_bias else 0
        return n + (2 * hd if self.qk_norm else 0) + (a // t if self.attn_sinks else 0)

    def _mlp_params(self, width: int, t: int) -> int:
        """An MLP of ``width``: gate, up, down (gated) or up, down, with GPT-2's biases."""
        gated = self.mlp in GATED
        n = (3 if gated else 2) * self.d_model * width // t
        return n + ((2 * width if gated else width) // t + self.d_model if self.bias else 0)

    def expert_params(self, tp_size: int = 1) -> int:
        """One routed expert's parameters on one of ``tp_size`` ranks (gpt-oss's biases included)."""
        t, h, f = self.check_tp_size(tp_size), self.d_model, self.expert_dim
        return 3 * h * f // t + (2 * f // t + h if self.expert_bias else 0)

    def _moe_params(self, t: int) -> int:
        h, e = self.d_model, self.n_experts
        router = h * e + (e if self.router_bias else 0) + (h if self.shared_gate else 0)
        shared = self.n_shared_experts * 3 * h * self.shared_dim // t
        return router + e * self.expert_params(t) + shared

    def check_tp_size(self, tp_size: int) -> int:
        """``tp_size`` if it divides the heads, the key-value heads and every MLP width, else a
        ValueError naming what it must divide (the vocabulary is padded to a multiple of t)."""
        t = check_int("tp_size", tp_size, 1)
        for name, value in self._tp_split():
            if value % t:
                valid = [d for d in range(1, self.n_head + 1) if self.tp_divides(d)]
                raise ArgumentError(f"tp_size={t} must divide {name}={value} (each rank holds whole heads "
                                    f"and an equal share of d_ff); valid tp_size: {valid}", "tp_divides",
                                    tp_size=t, name=name, value=value, valid=valid)
        return t

    def _tp_split(self) -> list:
        split = [("n_head", self.n_head), ("d_ff", self.ffn_dim)]
        split += [] if self.kv_lora_rank else [("n_kv_head", self.kv_heads)]
        return split + ([("d_expert", self.expert_dim), ("d_shared", self.shared_dim)] if self.n_experts else [])

    def tp_divides(self, t: int) -> bool:
        """Whether t divides the heads, the key-value heads and the MLP widths (see :meth:`check_tp_size`)."""
        return not any(value % t for _, value in self._tp_split())

    def kv_cache_width(self, tp_size: int = 1) -> int:
        """Elements one token caches in one layer on one of ``tp_size`` ranks: a key and a value of
        its n_kv / t heads (one head when t exceeds them, as vLLM replicates them), or under MLA the
        compressed kv_lora_rank + the rope key qk_rope_head_dim, whole on every rank."""
        t = check_int("tp_size", tp_size, 1)
        if self.kv_lora_rank:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * max(1, self.kv_heads // t) * self.head_dim

    def vocab_rows(self, tp_size: int = 1) -> int:
        """Rows of the embedding (and output head) one of ``tp_size`` ranks holds: ceil(V / t), the
        vocabulary padded to a multiple of t."""
        return -(-self.vocab_size // check_int("tp_size", tp_size, 1))

    def norm_params(self) -> int:
        """Parameters of one norm: a scale (RMSNorm), or a scale and a shift (LayerNorm with bias)."""
        return self.d_model * (2 if self.norm == "layernorm" and self.bias else 1)

    def embedding_params(self, tp_size: int = 1) -> int:
        """Token embedding, learned position table, and an untied output head (the vocabulary's
        rows divided over ``tp_size`` ranks; the position table whole on each)."""
        t = self.check_tp_size(tp_size)
        h = self.d_model
        positions = (self.n_positions or self.seq_len) * h if self.pos == "learned" else 0
        return self.vocab_rows(t) * h * (1 if self.tie_embeddings else 2) + positions

    def num_params(self) -> int:
        """Exact parameter count Ψ (tied embeddings counted once; MTP modules not counted)."""
        return self.embedding_params() + self._layers_params(1, 0, self.n_layer) + self.norm_params()

    def active_params(self) -> int:
        """Parameters a token passes through: Ψ less the experts its router does not choose in
        every MoE layer (embedding and head included, as Mixtral's 12.9B and DeepSeek-V3's 37B)."""
        moe = sum(1 for i in range(self.n_layer) if self.is_moe_layer(i))
        return self.num_params() - moe * (self.n_experts - self.experts_per_token) * self.expert_params()

    def _layers_params(self, t: int, start: int, stop: int) -> int:
        moe = sum(1 for i in range(start, stop) if self.is_moe_layer(i)) if self.n_experts else 0
        dense = stop - start - moe
        return (dense * self._block_params(t, False) if dense else 0) + \
            (moe * self._block_params(t, True) if moe else 0)

    @lru_cache(maxsize=8192)  # a shape is frozen and hashable; a planner's sweep asks the same again
    def stage_params(self, tp_size: int = 1, pp_size: int = 1, stage: int = 0, v: int = 1) -> int:
        """Parameters one rank of pipeline ``stage`` holds under tensor parallelism ``tp_size``
        (its ``v`` chunks' layers, :meth:`stage_ranges`).

        The first stage holds the token embedding (and position table), the last the final norm
        and the output head; with tied embeddings and p > 1 the last stage holds its own copy of
        the embedding (Megatron's), kept equal by the tied-gradient exchange. The one formula of
        parameters per rank: tensor parallelism, the planner and the estimator call it.
        """
        t = self.check_tp_size(tp_size)
        p = check_int("pp_size", pp_size, 1, self.n_layer)
        n = sum(self._layers_params(t, start, stop) for start, stop in self.stage_ranges(p, stage, v))
        head = self.vocab_rows(t) * self.d_model  # the output head, or a tied embedding's copy
        if stage == 0:
            n += self.embedding_params(t) - (0 if self.tie_embeddings or p == 1 else head)
        if stage == p - 1:
            n += self.norm_params() + (head if p > 1 else 0)
        return n

    def features(self) -> tuple:
        """What this shape has beyond labkit's GPT block, by name (:func:`labkit.shape_rules.features`)."""
        return features(self)

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **changes) -> "ModelShape":
        """A copy with fields replaced (validated again)."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"unknown ModelShape fields {sorted(unknown)}; valid: {[f.name for f in fields(self)]}")
        return replace(self, **changes)

    @classmethod
    def from_preset(cls, name: str) -> "ModelShape":
        return preset(name)

    @classmethod
    def from_config(cls, cfg) -> "ModelShape":
        """The shape of a ``labkit.model.GPTConfig`` (or any object with the same field names)."""
        names = [f.name for f in fields(cls)]
        return cls(**{n: getattr(cfg, n) for n in names if hasattr(cfg, n)})

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelShape":
        """The shape of a Hugging Face ``config.json`` (as a dict), read by its model_type
        (:func:`labkit.hf_config.shape_fields`: what each family reads, and what is refused)."""
        return cls(**shape_fields(config))


def _llama(L, h, a, kv, f, V, s, **kw) -> ModelShape:
    return ModelShape(n_layer=L, d_model=h, n_head=a, n_kv_head=kv, d_ff=f, vocab_size=V, seq_len=s,
                      norm="rmsnorm", mlp="swiglu", pos="rope", tie_embeddings=False, bias=False, **kw)


# Published shapes, each with its source (references.bib). The exact parameter counts the tests
# check are those of the released checkpoints (the sum of their tensors' sizes).
PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(n_layer=4, d_model=128, n_head=4, vocab_size=256, seq_len=64),
    # GPT-2 (radford2019language, Table 2 and the released checkpoints).
    "gpt2-small": ModelShape(n_layer=12, d_model=768, n_head=12, vocab_size=50257, seq_len=1024),
    "gpt2-medium": ModelShape(n_layer=24, d_model=1024, n_head=16, vocab_size=50257, seq_len=1024),
    "gpt2-large": ModelShape(n_layer=36, d_model=1280, n_head=20, vocab_size=50257, seq_len=1024),
    "gpt2-xl": ModelShape(n_layer=48, d_model=1600, n_head=25, vocab_size=50257, seq_len=1024),
    # GPT-3 175B (brown2020language, Table 2.1: 96 layers, d_model 12288, 96 heads, 2048 tokens).
    "gpt3-175b": ModelShape(n_layer=96, d_model=12288, n_head=96, vocab_size=50257, seq_len=2048),
    # OPT-13B (zhang2022opt, Table 1); its learned position table has 2 extra rows.
    "opt-13b": ModelShape(n_layer=40, d_model=5120, n_head=40, vocab_size=50272, seq_len=2048,
                          n_positions=2050),
    # Llama 2 (touvron2023llama2, Table 1 and Sec. 2.2; 70B uses GQA with 8 key-value heads).
    "llama-2-7b": _llama(32, 4096, 32, 32, 11008, 32000, 4096),
    "llama-2-13b": _llama(40, 5120, 40, 40, 13824, 32000, 4096),
    "llama-2-70b": _llama(80, 8192, 64, 8, 28672, 32000, 4096),
    # Llama 3 and 3.1 (grattafiori2024llama3, Table 3: RoPE base 500,000); Llama 3's context
    # 8192, 3.1's 131072. 3.1's rescaled rotary frequencies (for long context) are not modelled.
    "llama-3-8b": _llama(32, 4096, 32, 8, 14336, 128256, 8192, rope_theta=500000.0),
    "llama-3-70b": _llama(80, 8192, 64, 8, 28672, 128256, 8192, rope_theta=500000.0),
    "llama-3.1-405b": _llama(126, 16384, 128, 8, 53248, 128256, 131072, rope_theta=500000.0),
    # Llama 3.2 1B (meta2024llama32): tied embeddings.
    "llama-3.2-1b": _llama(16, 2048, 32, 8, 8192, 128256, 131072,
                           rope_theta=500000.0).replace(tie_embeddings=True),
    # Mistral 7B (jiang2023mistral, Table 1): GQA with 8 key-value heads, a 4096-token sliding window.
    "mistral-7b": _llama(32, 4096, 32, 8, 14336, 32000, 32768, sliding_window=4096),
    # Released checkpoints read from their config.json files (labkit.released_configs cites each).
    **{name: ModelShape.from_hf_config(config) for name, (_, _, config) in RELEASED.items()},
}


def preset(name: str) -> ModelShape:
    """The published shape called ``name`` (a key of :data:`PRESETS`)."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"preset={name!r} is unknown; valid presets: {sorted(PRESETS)}")
    return PRESETS[name]
