"""Published model shapes, torch-free: GPT-2's block and the Llama family, with exact parameter counts.

A :class:`ModelShape` is what a memory estimate needs to know of a model: L = ``n_layer``, h =
``d_model``, a = ``n_head``, n_kv = ``n_kv_head`` (grouped-query attention when n_kv < a), the MLP
width ``d_ff``, V = ``vocab_size``, s = ``seq_len``, and the block's kind (LayerNorm or RMSNorm,
GELU or SwiGLU MLP, learned or rotary positions, tied or untied embeddings, biases or none).
:mod:`labkit.model` builds runnable ``GPTConfig`` s from the same presets; this module imports
no torch, so the estimator and the calculators in the book read it anywhere.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from .validate import check_bool, check_choice, check_float, check_int

__all__ = ["ModelShape", "ShapeProperties", "PRESETS", "preset", "HF_CONFIG_FIELDS"]


class ShapeProperties:
    """What follows from a shape's fields: shared by :class:`ModelShape` and ``labkit.model.GPTConfig``."""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """n_kv: key-value heads (n_head for multi-head attention)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn_dim(self) -> int:
        """The MLP's inner width: ``d_ff``, or 4 h for GPT-2's block."""
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    def step_flops(self, global_batch: int, recompute: bool = False) -> int:
        """Matmul FLOPs of one training step on ``global_batch`` sequences of seq_len (Narayanan et
        al. 2021b, Appendix; ``labkit.model.training_flops`` documents the count and its checks)."""
        check_int("global_batch", global_batch, 1)
        check_bool("recompute", recompute)
        B, s, h, L, V = global_batch, self.seq_len, self.d_model, self.n_layer, self.vocab_size
        weights = (2 * h + 2 * self.kv_heads * self.head_dim) * h  # W_q, W_o; W_k, W_v
        weights += (3 if self.mlp == "swiglu" else 2) * h * self.ffn_dim  # 8 h² for GPT-2's MLP
        layer_forward = 2 * B * s * weights + 4 * B * s * s * h
        return (4 if recompute else 3) * L * layer_forward + 6 * B * s * h * V


@dataclass(frozen=True)
class ModelShape(ShapeProperties):
    """The shape of a decoder-only transformer in the course's notation (see the module docstring)."""

    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    seq_len: int
    n_kv_head: int | None = None  # None: multi-head attention (n_kv_head = n_head)
    d_ff: int | None = None  # None: 4 h, GPT-2's MLP
    norm: str = "layernorm"
    mlp: str = "gelu"
    pos: str = "learned"
    tie_embeddings: bool = True
    bias: bool = True
    sliding_window: int | None = None  # keys a query sees at most (Mistral's window); None: all
    n_positions: int | None = None  # rows of a learned position table, if not seq_len (OPT: s + 2)
    rope_theta: float = 10000.0  # θ of the rotary angles (pos="rope"); no parameter depends on it

    def __post_init__(self):
        for name in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len"):
            check_int(name, getattr(self, name), 1)
        for name in ("n_kv_head", "d_ff", "sliding_window", "n_positions"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        check_choice("norm", self.norm, ("layernorm", "rmsnorm"))
        check_choice("mlp", self.mlp, ("gelu", "swiglu"))
        check_choice("pos", self.pos, ("learned", "rope"))
        for name in ("tie_embeddings", "bias"):
            check_bool(name, getattr(self, name))
        check_float("rope_theta", self.rope_theta, above=0.0)
        if self.d_model % self.n_head:
            raise ValueError(f"n_head={self.n_head} must divide d_model={self.d_model}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")

    def layer_params(self, tp_size: int = 1) -> int:
        """Parameters of one block (on one of ``tp_size`` tensor-parallel ranks): attention, MLP,
        two norms. Megatron's split: W_q, W_k, W_v, W_o, the MLP's matrices and the column-parallel
        biases are divided by t; the norms and the two row-parallel biases are whole on every rank."""
        t = self.check_tp_size(tp_size)
        h, hd, a, kv, f = self.d_model, self.head_dim, self.n_head, self.kv_heads, self.ffn_dim
        attn = (h * a * hd + 2 * h * kv * hd + a * hd * h) // t  # W_q, W_k, W_v, W_o
        mlp = (3 if self.mlp == "swiglu" else 2) * h * f // t  # gate, up, down (SwiGLU) or up, down
        if self.bias:
            attn += (a * hd + 2 * kv * hd) // t + h
            mlp += (2 * f if self.mlp == "swiglu" else f) // t + h
        return attn + mlp + 2 * self.norm_params()

    def check_tp_size(self, tp_size: int) -> int:
        """``tp_size`` if it divides the heads, the key-value heads and d_ff, else a ValueError
        naming what it must divide (the vocabulary is padded to a multiple of t, as Megatron does)."""
        t = check_int("tp_size", tp_size, 1)
        for name, value in (("n_head", self.n_head), ("n_kv_head", self.kv_heads), ("d_ff", self.ffn_dim)):
            if value % t:
                raise ValueError(f"tp_size={t} must divide {name}={value} (each rank holds whole heads "
                                 f"and an equal share of d_ff); valid tp_size: "
                                 f"{[d for d in range(1, self.n_head + 1) if self.tp_divides(d)]}")
        return t

    def tp_divides(self, t: int) -> bool:
        """Whether t divides the heads, the key-value heads and d_ff (see :meth:`check_tp_size`)."""
        return not (self.n_head % t or self.kv_heads % t or self.ffn_dim % t)

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
        """Exact parameter count Ψ (tied embeddings counted once)."""
        return self.embedding_params() + self.n_layer * self.layer_params() + self.norm_params()

    def stage_layers(self, pp_size: int = 1, stage: int = 0) -> int:
        """Blocks of pipeline ``stage`` of ``pp_size``: n_layer / p, the first n_layer mod p stages
        one more (with v chunks a rank, the same total)."""
        p = check_int("pp_size", pp_size, 1, self.n_layer)
        check_int("stage", stage, 0, p - 1)
        return self.n_layer // p + (1 if stage < self.n_layer % p else 0)

    def stage_params(self, tp_size: int = 1, pp_size: int = 1, stage: int = 0) -> int:
        """Parameters one rank of pipeline ``stage`` holds under tensor parallelism ``tp_size``.

        The first stage holds the token embedding (and position table), the last the final norm
        and the output head; with tied embeddings and p > 1 the last stage holds its own copy of
        the embedding (Megatron's), kept equal by the tied-gradient exchange. The one formula of
        parameters per rank: tensor parallelism, the planner and the estimator call it.
        """
        t = self.check_tp_size(tp_size)
        p = check_int("pp_size", pp_size, 1, self.n_layer)
        n = self.stage_layers(p, stage) * self.layer_params(t)
        head = self.vocab_rows(t) * self.d_model  # the output head, or a tied embedding's copy
        if stage == 0:
            n += self.embedding_params(t) - (0 if self.tie_embeddings or p == 1 else head)
        if stage == p - 1:
            n += self.norm_params() + (head if p > 1 else 0)
        return n

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
        """The shape of a Hugging Face ``config.json`` (as a dict) of a Llama-, Mistral- or GPT-2-style model."""
        return _from_hf(cls, config)


# The fields read from a Hugging Face config.json, and the ModelShape field each fills.
HF_CONFIG_FIELDS = {
    "num_hidden_layers": "n_layer", "hidden_size": "d_model", "num_attention_heads": "n_head",
    "vocab_size": "vocab_size", "max_position_embeddings": "seq_len",
    "num_key_value_heads": "n_kv_head", "intermediate_size": "d_ff",
}
_HF_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size",
                "max_position_embeddings", "intermediate_size")


def _from_hf(cls, config: dict) -> ModelShape:
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict (a parsed config.json), not {type(config).__name__}")
    missing = [k for k in _HF_REQUIRED if k not in config]
    if missing:
        raise ValueError(f"config.json is missing {missing}; a Llama-style config needs {list(_HF_REQUIRED)}")
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act={act!r}: only SwiGLU models (hidden_act 'silu') are read from config.json")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ValueError(f"{key}={config[key]!r}: only bias-free Llama-style blocks are read from config.json")
    kw = {field: config[key] for key, field in HF_CONFIG_FIELDS.items() if config.get(key) is not None}
    if config.get("rope_theta") is not None:
        kw["rope_theta"] = config["rope_theta"]
    return cls(**kw, norm="rmsnorm", mlp="swiglu", pos="rope", bias=False,
               tie_embeddings=bool(config.get("tie_word_embeddings", False)),
               sliding_window=config.get("sliding_window"))


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
}


def preset(name: str) -> ModelShape:
    """The published shape called ``name`` (a key of :data:`PRESETS`)."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"preset={name!r} is unknown; valid presets: {sorted(PRESETS)}")
    return PRESETS[name]
