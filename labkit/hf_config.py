"""A Hugging Face config.json read by its ``model_type``: the ``ModelShape`` fields it fills.

``shape_fields(config)`` returns the fields as a dict (``ModelShape.from_hf_config`` builds the
shape). Beside each key read stands the field it fills. A key that is neither read by the family
nor in :data:`HARMLESS` (keys that change neither memory nor FLOPs) is refused by name, as is a
value the shape does not model; an unknown ``model_type`` is refused with the supported ones. A
multimodal config is read for its language model (``text_config``), and ``source`` says so. A
config without ``model_type`` (written by hand, as Lab 9's) is read as a Llama's.
"""

from __future__ import annotations

import json

from .messages import render
from .validate import ArgumentError, check_int

__all__ = ["shape_fields", "read_config_json", "SUPPORTED", "HARMLESS", "REQUIRED", "HF_CONFIG_FIELDS"]

# Keys that change neither parameters, memory nor FLOPs: ids, epsilons, initialisation, dropout,
# caching, routing and rotary constants, soft-capping and attention scales (elementwise work).
HARMLESS = frozenset((
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "bos_token_id",
    "eos_token_id", "pad_token_id", "initializer_range", "rms_norm_eps", "norm_eps", "use_cache",
    "attention_dropout", "resid_pdrop", "embd_pdrop", "rope_scaling", "rope_parameters", "pretraining_tp",
    "auto_map", "router_aux_loss_coef", "output_router_logits", "norm_topk_prob", "router_jitter_noise",
    "original_max_position_embeddings", "partial_rotary_factor", "_attn_implementation_autoset",
    "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "cache_implementation",
    "swiglu_limit", "initial_context_length", "aux_loss_alpha", "seq_aux", "scoring_func", "routed_scaling_factor",
    "n_group", "topk_group", "ep_size", "rope_interleave", "attn_temperature_tuning", "floor_scale", "attn_scale",
    "for_llm_compressor", "max_window_layers", "tokenizer_class"))
# The keys every family reads, and the ModelShape field each fills (each family's others: FAMILIES).
HF_CONFIG_FIELDS = {
    "num_hidden_layers": "n_layer", "hidden_size": "d_model", "num_attention_heads": "n_head",
    "vocab_size": "vocab_size", "max_position_embeddings": "seq_len",
    "num_key_value_heads": "n_kv_head", "intermediate_size": "d_ff", "head_dim": "d_head",
}
REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings",
            "intermediate_size")
# Keys every family reads (the field each fills is set in _common)
_COMMON = REQUIRED + ("num_key_value_heads", "head_dim", "rope_theta", "tie_word_embeddings",
                      "hidden_act", "attention_bias", "mlp_bias", "quantization_config", "layer_types")
_QWEN_WINDOW = ("sliding_window", "use_sliding_window")
_QWEN_MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers")
_DEEPSEEK = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
             "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
             "first_k_dense_replace", "moe_layer_freq", "topk_method", "num_nextn_predict_layers")
# model_type -> (the keys it reads beyond _COMMON, its activation, whether it ties by default)
FAMILIES = {
    "llama": ((), "silu", False),
    "mistral": (("sliding_window",), "silu", False),
    "mixtral": (("sliding_window", "num_local_experts", "num_experts_per_tok"), "silu", False),
    "qwen2": (_QWEN_WINDOW, "silu", False),
    "qwen2_moe": (_QWEN_WINDOW + _QWEN_MOE + ("shared_expert_intermediate_size",), "silu", False),
    "qwen3": (_QWEN_WINDOW, "silu", False),
    "qwen3_moe": (_QWEN_WINDOW + _QWEN_MOE, "silu", False),
    "deepseek_v2": (_DEEPSEEK, "silu", False),
    "deepseek_v3": (_DEEPSEEK, "silu", False),
    "phi3": (("sliding_window",), "silu", False),
    "gemma2": (("sliding_window", "sliding_window_size", "hidden_activation"), "gelu_pytorch_tanh", True),
    "gpt_oss": (("sliding_window", "num_local_experts", "num_experts_per_tok", "experts_per_token"), "silu", False),
    "llama4_text": (("num_local_experts", "num_experts_per_tok", "intermediate_size_mlp",
                     "interleave_moe_layer_step", "moe_layers", "attention_chunk_size", "no_rope_layers",
                     "use_qk_norm"),  # Llama 4's qk-norm is an L2 norm without weights
                    "silu", False),
}
# a multimodal model_type -> its language model's, read from "text_config"
MULTIMODAL = {"llama4": "llama4_text"}
_WRAPPER = HARMLESS | {"text_config", "vision_config", "tie_word_embeddings", "boi_token_index", "eoi_token_index",
                       "image_token_index"}
SUPPORTED = tuple(FAMILIES) + tuple(MULTIMODAL)


def _refused(kind: str, **fields) -> ArgumentError:
    """A refusal of ``kind`` worded by labkit.messages' English catalogue (the one wording of it)."""
    return ArgumentError(render("error." + kind, "en", **fields), kind, **fields)


def read_config_json(text: str) -> dict:
    """A config.json's text as a dict (the calculators' pasted one); an ArgumentError if it is not
    JSON (kind "config_json": line and column), not an object ("config_object") or empty."""
    if isinstance(text, str) and not text.strip():
        raise ArgumentError("config.json is empty: paste the text of the model's config.json", "config_empty")
    try:
        config = json.loads(text)
    except ValueError as e:  # json.JSONDecodeError (Brython's too)
        line, column = getattr(e, "lineno", 1), getattr(e, "colno", 1)
        raise ArgumentError(f"config.json is not valid JSON: line {line}, column {column}", "config_json",
                            line=line, column=column) from None
    if not isinstance(config, dict):
        raise ArgumentError("config.json must be a JSON object ({...}), as Hugging Face writes it",
                            "config_object")
    return config


def shape_fields(config: dict) -> dict:
    """The ``ModelShape`` fields of a parsed config.json (see the module docstring)."""
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict (a parsed config.json), not {type(config).__name__}")
    model_type, source = config.get("model_type", "llama"), ""
    if not isinstance(model_type, str) or model_type not in FAMILIES and model_type not in MULTIMODAL:
        raise ArgumentError(f"model_type={model_type!r} is not read by labkit; supported: {list(SUPPORTED)}",
                            "model_type", model_type=model_type, supported=list(SUPPORTED))
    if model_type in MULTIMODAL:
        _refuse_unknown(config, _WRAPPER, model_type)
        text = config.get("text_config")
        if not isinstance(text, dict) or text.get("model_type") != MULTIMODAL[model_type]:
            raise _refused("config_text", model_type=model_type, text_type=MULTIMODAL[model_type])
        source = (f"the language model (text_config) of a {model_type} config.json; "
                  "its vision encoder and projector are not counted")
        config, model_type = {"tie_word_embeddings": config.get("tie_word_embeddings", False), **text}, \
            MULTIMODAL[model_type]
    keys, act, tied = FAMILIES[model_type]
    _refuse_unknown(config, HARMLESS | set(_COMMON) | set(keys), model_type)
    fields = {**_common(config, model_type, act, tied), **READERS[model_type](config)}
    return {**fields, "source": source} if source else fields


def _refuse_unknown(config: dict, known, model_type: str) -> None:
    unknown, read = sorted(k for k in config if k not in known), sorted(set(known) - HARMLESS)
    if unknown:
        raise ArgumentError(f"config.json keys {unknown} are not read for model_type={model_type!r}; a key "
                            f"that changes memory or FLOPs must be modelled, not ignored (read: {read})",
                            "config_keys", keys=unknown, model_type=model_type, read=read)


def _common(c: dict, model_type: str, act: str, tied: bool) -> dict:
    """The keys every family reads: sizes, heads, head size, positions, embeddings, biases."""
    missing = [k for k in REQUIRED if c.get(k) is None]
    if missing:
        raise ArgumentError(f"config.json is missing {missing}; a {model_type} config needs {list(REQUIRED)}",
                            "config_missing", missing=missing, model_type=model_type, needed=list(REQUIRED))
    for key in ("hidden_act", "hidden_activation"):
        if c.get(key, act) != act:
            raise ArgumentError(f"{key}={c[key]!r}: a {model_type} block is read with {act!r} (gated MLP: "
                                "SwiGLU for 'silu', GeGLU for 'gelu_pytorch_tanh')", "config_act", key=key,
                                value=c[key], model_type=model_type, act=act)
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key) and not (key == "attention_bias" and model_type == "gpt_oss"):
            raise ArgumentError(f"{key}={c[key]!r} is not modelled for model_type={model_type!r}",
                                "config_value", key=key, value=c[key], model_type=model_type)
    rope = c.get("rope_parameters")  # transformers 5 moves rope_theta here
    theta = rope.get("rope_theta", c.get("rope_theta")) if isinstance(rope, dict) else c.get("rope_theta")
    fields = {
        "n_layer": c["num_hidden_layers"], "d_model": c["hidden_size"],
        "n_head": c["num_attention_heads"], "vocab_size": c["vocab_size"],
        "seq_len": c["max_position_embeddings"], "d_ff": c["intermediate_size"],
        "n_kv_head": c.get("num_key_value_heads"),  # None: multi-head attention
        "tie_embeddings": c.get("tie_word_embeddings", tied),
        "norm": "rmsnorm", "mlp": "geglu" if act.startswith("gelu") else "swiglu", "pos": "rope", "bias": False,
        **({"rope_theta": theta} if theta is not None else {}),
        **_head_size(c), **_weight_format(c), **_windows(c, "use_sliding_window" in FAMILIES[model_type][0])}
    return fields


def _head_size(c: dict) -> dict:
    """``head_dim`` -> d_head, kept only where it is not hidden_size / num_attention_heads."""
    hd, h, a = c.get("head_dim"), c["hidden_size"], c["num_attention_heads"]
    if hd is None or (isinstance(h, int) and isinstance(a, int) and a and h == a * hd):
        return {}
    return {"d_head": hd}


def _weight_format(c: dict) -> dict:
    """``quantization_config.quant_method`` -> weight_format (how the release stores its weights)."""
    q = c.get("quantization_config")
    if q is None:
        return {}
    if not isinstance(q, dict) or not isinstance(q.get("quant_method"), str):
        raise _refused("config_quantization", value=q)
    return {"weight_format": q["quant_method"]}


def _windows(c: dict, switched: bool) -> dict:
    """``sliding_window`` and ``layer_types`` -> sliding_window, full_attention_every. ``switched``:
    the family applies its window only with ``use_sliding_window`` (Qwen's; default False)."""
    if c.get("use_sliding_window"):
        raise _refused("config_window_switch")
    window = None if switched else c.get("sliding_window")
    types = c.get("layer_types")
    if types is None:
        return {"sliding_window": window}
    return _pattern(types, c["num_hidden_layers"], ("full_attention", "sliding_attention"), window,
                    "layer_types")


def _pattern(types, n_layer, kinds, window, key) -> dict:
    """A per-layer list of (full, windowed) kinds -> every k-th layer full, the others windowed."""
    full, windowed = kinds
    if not isinstance(types, list) or len(types) != n_layer or any(t not in kinds for t in types):
        raise _refused("config_layer_list", key=key, full=full, windowed=windowed, n_layer=n_layer)
    if windowed not in types:
        return {"sliding_window": None}
    if window is None:
        raise _refused("config_no_window", key=key, windowed=windowed)
    k = types.index(full) + 1 if full in types else None
    if k is not None and types != [full if (i + 1) % k == 0 else windowed for i in range(n_layer)]:
        raise _refused("config_layer_pattern", key=key, value=types)
    return {"sliding_window": window, **({"full_attention_every": k} if k else {})}


def _experts(c: dict, count: str, tops: tuple, width: str | None) -> dict:
    """The routed experts: how many (``count``), how many a token (the first of ``tops`` given),
    each one's width (``width``; None: d_ff)."""
    top = [c[k] for k in tops if c.get(k) is not None]
    if c.get(count) is None or not top:
        missing = [count] if c.get(count) is None else list(tops)
        raise ArgumentError(f"config.json is missing {missing}: a mixture of experts needs its expert "
                            "count and experts per token", "config_missing_experts", missing=missing)
    if any(t != top[0] for t in top):
        raise _refused("config_disagree", keys=list(tops), values=top)
    fields = {"n_experts": c[count], "experts_per_token": top[0]}
    if width is not None:
        if c.get(width) is None:
            raise _refused("config_missing_width", key=width)
        fields["d_expert"] = c[width]
    return fields


def _qwen_moe(c: dict) -> dict:
    return {**_experts(c, "num_experts", ("num_experts_per_tok",), "moe_intermediate_size"),
            "moe_every": c.get("decoder_sparse_step", 1),  # layer i is sparse when (i+1) % step == 0
            "dense_layers": tuple(c.get("mlp_only_layers") or ())}


def _qwen2_moe(c: dict) -> dict:
    shared = c.get("shared_expert_intermediate_size") or 0
    return {**_qwen_moe(c), "qkv_bias": True, "n_shared_experts": 1 if shared else 0,
            "d_shared": shared or None, "shared_gate": bool(shared)}  # Qwen2-MoE's sigmoid gate


def _deepseek(c: dict) -> dict:
    """MLA and DeepSeekMoE; ``head_dim`` (transformers 5's name for qk_rope_head_dim) must agree."""
    if c.get("moe_layer_freq", 1) != 1:
        raise _refused("config_moe_freq", value=c["moe_layer_freq"])
    if c.get("head_dim") not in (None, c.get("qk_rope_head_dim")):
        raise _refused("config_head_dim", head_dim=c["head_dim"], rope=c.get("qk_rope_head_dim"))
    default = "noaux_tc" if c.get("model_type") == "deepseek_v3" else "greedy"
    method = c.get("topk_method", default)
    check_int("num_nextn_predict_layers", c.get("num_nextn_predict_layers", 0), 0)
    return {**_experts(c, "n_routed_experts", ("num_experts_per_tok",), "moe_intermediate_size"),
            "n_shared_experts": c.get("n_shared_experts") or 0, "n_kv_head": None, "d_head": None,
            "first_dense_layers": c.get("first_k_dense_replace", 0),
            "router_bias": method == "noaux_tc",  # DeepSeek-V3's e_score_correction_bias
            "kv_lora_rank": c.get("kv_lora_rank"), "q_lora_rank": c.get("q_lora_rank") or 0,
            "qk_rope_head_dim": c.get("qk_rope_head_dim"), "qk_nope_head_dim": c.get("qk_nope_head_dim"),
            "v_head_dim": c.get("v_head_dim"), "n_mtp_layers": c.get("num_nextn_predict_layers", 0)}


def _gpt_oss(c: dict) -> dict:
    bias = c.get("attention_bias", True)  # q, k, v and o alike; GptOssConfig's default: True
    return {**_experts(c, "num_local_experts", ("experts_per_token", "num_experts_per_tok"), None),
            "qkv_bias": bias, "o_bias": bias, "attn_sinks": True, "router_bias": True, "expert_bias": True}


def _llama4(c: dict) -> dict:
    """Llama 4's text model: experts of ``intermediate_size`` and one shared one; dense layers of
    ``intermediate_size_mlp``; chunked attention on the layers with rotary positions."""
    if c.get("intermediate_size_mlp") is None:
        raise _refused("config_missing_dense_width", key="intermediate_size_mlp")
    step = c.get("interleave_moe_layer_step", 1)
    moe = [i for i in range(c["num_hidden_layers"]) if isinstance(step, int) and step and (i + 1) % step == 0]
    if c.get("moe_layers") not in (None, moe):
        raise _refused("config_moe_layers", value=c["moe_layers"], step=step)
    chunk, nope = c.get("attention_chunk_size"), c.get("no_rope_layers")
    if nope is None:
        nope = [int((i + 1) % 4 != 0) for i in range(c["num_hidden_layers"])]  # its default: 1 in 4 NoPE
    kinds = ["full" if n == 0 else "chunked" for n in nope] if isinstance(nope, list) else nope
    windows = _pattern(kinds, c["num_hidden_layers"], ("full", "chunked"), chunk, "no_rope_layers") \
        if chunk is not None else {"sliding_window": None}
    return {**_experts(c, "num_local_experts", ("num_experts_per_tok",), "intermediate_size"),
            "d_ff": c["intermediate_size_mlp"], "moe_every": step, "n_shared_experts": 1, **windows,
            "chunked_attention": chunk is not None}


def _gemma2(c: dict) -> dict:
    if c.get("sliding_window_size", c.get("sliding_window")) != c.get("sliding_window"):
        raise _refused("config_window_size", size=c["sliding_window_size"], window=c.get("sliding_window"))
    windows = {} if c.get("layer_types") else {"full_attention_every": 2}  # sliding, full, sliding, ...
    return {"ffn_norms": True, **windows}


READERS = {
    "llama": lambda c: {}, "mistral": lambda c: {}, "phi3": lambda c: {},
    "mixtral": lambda c: _experts(c, "num_local_experts", ("num_experts_per_tok",), None),
    "qwen2": lambda c: {"qkv_bias": True},
    "qwen2_moe": _qwen2_moe,
    "qwen3": lambda c: {"qk_norm": True},
    "qwen3_moe": lambda c: {**_qwen_moe(c), "qk_norm": True},
    "deepseek_v2": _deepseek, "deepseek_v3": _deepseek,
    "gemma2": _gemma2, "gpt_oss": _gpt_oss, "llama4_text": _llama4,
}
