"""What follows from a model shape's fields, and the rules its fields obey (torch-free).

:class:`ShapeProperties` (head size, key-value heads, MLP width, a training step's FLOPs) is
shared by ``labkit.shapes.ModelShape`` and ``labkit.model.GPTConfig``; :func:`check_shape` is
ModelShape's validation, each bad field named with what would be valid; :func:`features` names
what a shape has beyond labkit's GPT block.
"""

from __future__ import annotations

from .validate import ArgumentError, check_bool, check_choice, check_float, check_int

__all__ = ["layer_split", "layer_range", "layer_window", "GATED", "ShapeProperties", "check_shape", "features"]

GATED = ("swiglu", "geglu")  # MLPs with a gate: three matrices


class ShapeProperties:
    """What follows from a shape's fields: shared by :class:`ModelShape` and ``labkit.model.GPTConfig``."""

    @property
    def head_dim(self) -> int:
        """A head's size: ``d_head`` where the config gives one, else d_model / n_head (MLA: the
        query and key head, qk_nope_head_dim + qk_rope_head_dim)."""
        if getattr(self, "kv_lora_rank", 0):
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        d_head = getattr(self, "d_head", None)
        return self.d_model // self.n_head if d_head is None else d_head

    @property
    def kv_heads(self) -> int:
        """n_kv: key-value heads (n_head for multi-head attention)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn_dim(self) -> int:
        """The MLP's inner width: ``d_ff``, or 4 h for GPT-2's block."""
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    def step_flops(self, global_batch: int, recompute: bool = False, *, moe_layers: int = 0,
                   moe_token_flops: int = 0) -> int:
        """Matmul FLOPs of one training step on ``global_batch`` sequences of seq_len (Narayanan et
        al. 2021b, Appendix, with the head size a config gives; ``labkit.model.training_flops``
        documents the count and its checks). With experts, ``moe_layers`` of the layers run
        ``moe_token_flops`` a token in their MLP's place (``labkit.moe.analytic.training_step_flops``
        passes them). MLA: its matrices (:meth:`mla_weights`) and scores q k^T over d_nope + d_rope,
        p v over v_head_dim."""
        if getattr(self, "n_experts", 0) and not moe_token_flops:
            raise ValueError(f"n_experts={self.n_experts}: give moe_layers and moe_token_flops "
                             "(labkit.moe.analytic.training_step_flops counts a mixture of experts)")
        check_int("global_batch", global_batch, 1)
        check_bool("recompute", recompute)
        moe = check_int("moe_layers", moe_layers, 0, self.n_layer)
        B, s, h, L, V = global_batch, self.seq_len, self.d_model, self.n_layer, self.vocab_size
        ahd = self.n_head * self.head_dim  # h, unless the config gives a head size
        weights = (2 * ahd + 2 * self.kv_heads * self.head_dim) * h  # W_q, W_o; W_k, W_v
        scores = self.score_flops(B)
        if getattr(self, "kv_lora_rank", 0):
            weights = self.mla_weights()
        mlp = (3 if self.mlp in GATED else 2) * h * self.ffn_dim  # 8 h² for GPT-2's MLP
        forward = L * (2 * B * s * weights + scores) + (L - moe) * 2 * B * s * mlp
        forward += moe * B * s * moe_token_flops
        return (4 if recompute else 3) * forward + 6 * B * s * h * V

    def score_flops(self, global_batch: int) -> int:
        """Forward FLOPs of one layer's attention core, q k^T and p v: 4 B s^2 a hd (MLA: 2 B s^2 a
        (d_nope + d_rope + v_head_dim)); what selective recomputation runs again."""
        B, s, a = check_int("global_batch", global_batch, 1), self.seq_len, self.n_head
        if getattr(self, "kv_lora_rank", 0):
            return 2 * B * s * s * a * (self.head_dim + self.v_head_dim)
        return 4 * B * s * s * a * self.head_dim

    def mla_weights(self) -> int:
        """The matmul weights of one MLA attention (DeepSeek-V2 eq. 9-17): W^DQ and W^UQ, W^QR (or
        W^Q, W^QR from h without q_lora_rank), W^DKV, W^KR, W^UK, W^UV and W^O; no norms."""
        h, a, c, q = self.d_model, self.n_head, self.kv_lora_rank, self.q_lora_rank or 0
        query = h * q + q * a * self.head_dim if q else h * a * self.head_dim
        return query + h * (c + self.qk_rope_head_dim) + c * a * (self.qk_nope_head_dim + self.v_head_dim) \
            + a * self.v_head_dim * h

    def stage_ranges(self, pp_size: int = 1, stage: int = 0, v: int = 1) -> list[tuple[int, int]]:
        """The layer ranges [start, stop) rank ``stage`` of ``pp_size`` holds: its v chunks, chunk
        j being virtual stage stage + j p of v p, sized by :func:`layer_split` (the first
        n_layer mod v p one layer more)."""
        p = check_int("pp_size", pp_size, 1, self.n_layer)
        check_int("stage", stage, 0, p - 1)
        n = p * check_int("v", v, 1, self.n_layer // p)
        return [layer_range(self.n_layer, n, k) for k in range(stage, n, p)]

    def stage_layers(self, pp_size: int = 1, stage: int = 0, v: int = 1) -> int:
        """Blocks of pipeline ``stage`` of ``pp_size`` (with ``v`` chunks a rank, of all its chunks)."""
        return sum(stop - start for start, stop in self.stage_ranges(pp_size, stage, v))


def check_shape(shape) -> None:
    """Every field of a ``ModelShape`` checked: types, ranges, and what they must agree on."""
    for name in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len"):
        check_int(name, getattr(shape, name), 1)
    for name in ("n_kv_head", "d_ff", "sliding_window", "n_positions", "d_head", "d_expert", "d_shared",
                 "full_attention_every"):
        if getattr(shape, name) is not None:
            check_int(name, getattr(shape, name), 1)
    check_choice("norm", shape.norm, ("layernorm", "rmsnorm"))
    check_choice("mlp", shape.mlp, ("gelu",) + GATED)
    check_choice("pos", shape.pos, ("learned", "rope"))
    for name in ("tie_embeddings", "bias", "qkv_bias", "o_bias", "qk_norm", "ffn_norms", "attn_sinks",
                 "chunked_attention", "shared_gate", "router_bias", "expert_bias"):
        check_bool(name, getattr(shape, name))
    check_float("rope_theta", shape.rope_theta, above=0.0)
    if shape.weight_format is not None and not isinstance(shape.weight_format, str):
        raise TypeError(f"weight_format={shape.weight_format!r} must be None or a string such as 'fp8'")
    if not isinstance(shape.source, str):
        raise TypeError(f"source={shape.source!r} must be a string")
    _check_heads(shape)
    _check_windows(shape)
    _check_experts(shape)


def _check_heads(shape) -> None:
    if shape.kv_lora_rank or shape.q_lora_rank:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            check_int(name, getattr(shape, name), 1)
        check_int("q_lora_rank", shape.q_lora_rank, 0)
        if shape.d_head is not None or shape.n_kv_head is not None:
            raise ArgumentError("MLA (kv_lora_rank > 0) has no d_head or n_kv_head: its head sizes are the qk_* "
                                "and v_head_dim fields, and every head reads the one compressed cache", "mla_heads")
    else:
        for name in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            check_int(name, getattr(shape, name), 0, 0)
    if shape.d_head is None and not shape.kv_lora_rank and shape.d_model % shape.n_head:
        raise ArgumentError(f"n_head={shape.n_head} must divide d_model={shape.d_model} (or give d_head)",
                            "head_divides", n_head=shape.n_head, d_model=shape.d_model)
    if shape.n_head % shape.kv_heads:
        raise ArgumentError(f"n_kv_head={shape.n_kv_head} must divide n_head={shape.n_head}", "kv_divides",
                            n_kv_head=shape.n_kv_head, n_head=shape.n_head)
    check_int("n_mtp_layers", shape.n_mtp_layers, 0)


def _check_windows(shape) -> None:
    if (shape.full_attention_every or shape.chunked_attention) and shape.sliding_window is None:
        raise ValueError("full_attention_every and chunked_attention need a sliding_window (the window's size)")


def _check_experts(shape) -> None:
    e = check_int("n_experts", shape.n_experts, 0)
    check_int("experts_per_token", shape.experts_per_token, min(e, 1), e)
    check_int("n_shared_experts", shape.n_shared_experts, 0)
    check_int("first_dense_layers", shape.first_dense_layers, 0, shape.n_layer)
    check_int("moe_every", shape.moe_every, 1, shape.n_layer)
    if not isinstance(shape.dense_layers, tuple):
        raise TypeError(f"dense_layers={shape.dense_layers!r} must be a tuple of layer indices")
    for layer in shape.dense_layers:
        check_int("dense_layers", layer, 0, shape.n_layer - 1)
    moe_only = ("d_expert", "d_shared", "n_shared_experts", "shared_gate", "router_bias", "expert_bias",
                "first_dense_layers", "dense_layers")
    extra = [n for n in moe_only if not e and getattr(shape, n)] + ([] if e or shape.moe_every == 1 else ["moe_every"])
    if extra:
        raise ValueError(f"{extra} describe experts, but n_experts=0 (a dense model)")


def features(shape) -> tuple:
    """What ``shape`` has beyond labkit's GPT block (``labkit.model``), by name: what a consumer
    that does not model it refuses."""
    named = (("experts", shape.n_experts), ("MLA", shape.kv_lora_rank), ("head size", shape.d_head),
             ("q/k/v biases", shape.qkv_bias and not shape.bias), ("output bias", shape.o_bias and not shape.bias),
             ("qk-norm", shape.qk_norm), ("feed-forward norms", shape.ffn_norms),
             ("attention sinks", shape.attn_sinks), ("GeGLU", shape.mlp == "geglu"),
             ("per-layer windows", shape.full_attention_every), ("chunked attention", shape.chunked_attention))
    return tuple(name for name, present in named if present)


def layer_window(shape, layer: int) -> int | None:
    """The window of block ``layer`` (0-based): None where it attends to every earlier key, else
    ``sliding_window`` (a sliding window, or Llama 4's chunk). With ``full_attention_every`` = k,
    every k-th layer is full and the others windowed (Gemma 2, gpt-oss, Llama 4); without it,
    every layer has the one window or none."""
    check_int("layer", layer, 0, shape.n_layer - 1)
    k = shape.full_attention_every
    return None if k and (layer + 1) % k == 0 else shape.sliding_window


def layer_range(n_layer: int, parts: int, k: int) -> tuple[int, int]:
    """[start, stop) of piece ``k`` of :func:`layer_split`'s ``parts`` pieces of ``n_layer``."""
    size, extra = divmod(n_layer, parts)
    return k * size + min(k, extra), (k + 1) * size + min(k + 1, extra)


def layer_split(n_layer: int, parts: int) -> list[int]:
    """Layers of each of ``parts`` consecutive pieces of ``n_layer`` (pipeline stages, or the v p
    virtual stages of an interleaved schedule): n_layer // parts each, the first n_layer mod
    parts one more. The one rule: the estimator, the planner and ``labkit.pipeline.split_stages``
    (unless given costs) split by it (:func:`layer_range`)."""
    check_int("parts", parts, 1, check_int("n_layer", n_layer, 1))
    return [stop - start for start, stop in (layer_range(n_layer, parts, k) for k in range(parts))]
