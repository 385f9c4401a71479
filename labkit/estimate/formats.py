"""How a served model's weights and KV cache are stored: named formats and their bytes (torch-free).

:data:`WEIGHT_FORMATS` is the one table of weight formats: the bits of a stored value, the scales
(their bytes and the block of a matrix one scale covers, as (rows, columns) of a (out, in)
weight: None a whole dimension), zero points, which matrices are quantized and which tensors stay
in 16-bit. Only the blocks' linear matrices are ever quantized; the embeddings, the LM head, the
norms, the router, the biases (and gpt-oss's sinks) stay in 16-bit in every format, and MXFP4
quantizes the routed experts alone (gpt-oss's ``modules_to_not_convert``). :func:`weight_bytes`
is the one count of a rank's weight bytes; :func:`linear_matrices` lists the matrices it
quantizes; :data:`KV_FORMATS` the KV cache's element bytes; :func:`default_weight_format` reads
a config.json's ``quantization_config`` (``ModelShape.weight_format``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..expert_parallel.analytic import experts_per_rank
from ..shape_rules import GATED
from ..validate import ArgumentError, check_bool, check_choice, check_int

__all__ = ["WeightFormat", "WEIGHT_FORMATS", "KV_FORMATS", "QUANT_METHODS", "WeightBytes", "weight_bytes",
           "linear_matrices", "params_per_rank", "default_weight_format", "check_weight_format"]


class WeightFormat(NamedTuple):
    """A stored weight format: ``bits`` a quantized value; ``scale_bytes`` a scale over a block
    of ``block`` = (rows, cols) (None: the whole dimension); ``zero_bits`` a zero point a scale;
    ``index_bytes`` per input column (GPTQ's g_idx); ``quantizes``: the matrix kinds stored so."""

    bits: int
    scale_bytes: int
    block: tuple
    zero_bits: int
    index_bytes: int
    quantizes: tuple
    kept: str  # the tensors left in 16-bit
    source: str


_LINEAR = ("attention", "mlp", "shared", "expert")
_KEPT = "embeddings, LM head, norms, router, biases"
WEIGHT_FORMATS = {
    "bf16": WeightFormat(16, 0, (None, None), 0, 0, (), "everything", "16-bit brain float"),
    "fp16": WeightFormat(16, 0, (None, None), 0, 0, (), "everything", "16-bit IEEE float"),
    # DeepSeek-V3's release: e4m3 values, one fp32 scale (weight_scale_inv) a 128 x 128 block
    "fp8": WeightFormat(8, 4, (128, 128), 0, 0, _LINEAR, _KEPT, "DeepSeek-V3's block-wise fp8"),
    # vLLM's --quantization fp8 of a 16-bit checkpoint: one fp32 scale a matrix
    "fp8-per-tensor": WeightFormat(8, 4, (None, None), 0, 0, _LINEAR, _KEPT, "per-tensor fp8"),
    # W8A16/W8A8 int8: one 16-bit scale an output channel (a row)
    "int8": WeightFormat(8, 2, (1, None), 0, 0, _LINEAR, _KEPT, "per-channel int8"),
    # AWQ (GEMM layout): a 16-bit scale and a 4-bit zero point a group of 128 inputs of a row
    "int4-awq": WeightFormat(4, 2, (1, 128), 4, 0, _LINEAR, _KEPT, "AWQ, group 128"),
    # GPTQ (AutoGPTQ layout): as AWQ, plus g_idx, one int32 an input column
    "int4-gptq": WeightFormat(4, 2, (1, 128), 4, 4, _LINEAR, _KEPT, "GPTQ, group 128, with g_idx"),
    # OCP MXFP4 (gpt-oss): e2m1 values, one E8M0 byte a block of 32 inputs, on the routed experts
    "mxfp4": WeightFormat(4, 1, (1, 32), 0, 0, ("expert",),
                          "everything but the routed experts' matrices (attention too)", "gpt-oss's MXFP4"),
}
KV_FORMATS = {"bf16": 2, "fp16": 2, "fp8": 1}  # bytes an element; fp8's per-layer k/v scales: negligible
# quantization_config.quant_method -> the format it names (the default for that model)
QUANT_METHODS = {"fp8": "fp8", "mxfp4": "mxfp4", "awq": "int4-awq", "gptq": "int4-gptq"}


class WeightBytes(NamedTuple):
    """One rank's weight bytes: quantized values, their scales (and zero points, indices), and
    the 16-bit rest; ``params`` and ``quantized_params``: the elements each covers."""

    values: int
    scales: int
    kept: int
    params: int
    quantized_params: int

    @property
    def total(self) -> int:
        return self.values + self.scales + self.kept


def check_weight_format(name: str) -> WeightFormat:
    return WEIGHT_FORMATS[check_choice("weight_format", name, tuple(WEIGHT_FORMATS))]


def default_weight_format(shape) -> str:
    """The format a model is served in unless told: its config.json's quantization_config
    (``shape.weight_format``) by :data:`QUANT_METHODS`, else "bf16"; an unknown method refused."""
    method = shape.weight_format
    if method is None:
        return "bf16"
    if method not in QUANT_METHODS:
        raise ArgumentError(f"weight_format={method!r} (the config's quantization_config) is not modelled; "
                            f"give a weight format: {', '.join(WEIGHT_FORMATS)}", "weight_format", value=method,
                            valid=list(WEIGHT_FORMATS))
    return QUANT_METHODS[method]


def _tp_share(n: int, t: int, replicate: bool = False) -> int:
    """A dimension n split over t ranks (at least 1 when ``replicate``: vLLM's KV heads)."""
    return max(1, n // t) if replicate else -(-n // t)


def linear_matrices(shape, tp_size: int = 1, expert_parallel: bool = False) -> list:
    """Every linear weight one rank holds, as (kind, rows, cols, count): its (out, in) shape under
    Megatron's split (column-parallel rows, row-parallel columns divided by t; MLA's down-projections
    whole); routed experts sliced by t, or with ``expert_parallel`` E/t whole experts a rank."""
    t = check_int("tp_size", tp_size, 1)
    check_bool("expert_parallel", expert_parallel)
    s, h = shape, shape.d_model
    a, hd = s.n_head, s.head_dim
    if s.kv_lora_rank:  # MLA: W_DQ, W_UQ (or W_Q), W_DKV with the rope key, W_UK and W_UV, W_O
        c, r, v = s.kv_lora_rank, s.qk_rope_head_dim, s.v_head_dim
        q = [(s.q_lora_rank, h), (_tp_share(a * hd, t), s.q_lora_rank)] if s.q_lora_rank else \
            [(_tp_share(a * hd, t), h)]
        attn = q + [(c + r, h), (_tp_share(a * (s.qk_nope_head_dim + v), t), c), (h, _tp_share(a * v, t))]
    else:
        kv = _tp_share(s.kv_heads, t, replicate=True) * hd
        attn = [(_tp_share(a * hd, t), h), (kv, h), (kv, h), (h, _tp_share(a * hd, t))]
    out = [("attention", rows, cols, s.n_layer) for rows, cols in attn]
    moe = sum(1 for i in range(s.n_layer) if s.is_moe_layer(i))
    out += _mlp("mlp", s, s.ffn_dim, t, s.n_layer - moe)
    if moe:
        out += _mlp("shared", s, s.shared_dim, t, moe * s.n_shared_experts)
        e = experts_per_rank(s.n_experts, t) if expert_parallel else s.n_experts
        out += _mlp("expert", s, s.expert_dim, 1 if expert_parallel else t, moe * e, gated=True)
    return [m for m in out if m[3]]


def _mlp(kind, s, width, t, count, gated=None):
    """Gate and up (column-parallel) and down (row-parallel) of ``count`` MLPs of ``width``."""
    w = _tp_share(width, t)
    ins = [(w, s.d_model)] * (2 if (s.mlp in GATED if gated is None else gated) else 1)
    return [(kind, rows, cols, count) for rows, cols in ins + [(s.d_model, w)]]


def params_per_rank(shape, tp_size: int = 1, expert_parallel: bool = False) -> int:
    """Parameters one of ``tp_size`` ranks holds: ``shape.stage_params(t)`` when t divides every
    dimension, else ceil(Ψ/t) (KV heads replicated: an estimate); with ``expert_parallel``, each
    MoE layer's routed experts are E/t whole ones instead of E slices (t must divide E)."""
    t = check_int("tp_size", tp_size, 1)
    check_bool("expert_parallel", expert_parallel)
    n = shape.stage_params(t) if shape.tp_divides(t) else -(-shape.num_params() // t)
    if expert_parallel and shape.n_experts:
        moe = sum(1 for i in range(shape.n_layer) if shape.is_moe_layer(i))
        sliced = shape.expert_params(t) if shape.tp_divides(t) else -(-shape.expert_params() // t)
        n += moe * (experts_per_rank(shape.n_experts, t) * shape.expert_params() - shape.n_experts * sliced)
    return n


def weight_bytes(shape, weight_format: str = "bf16", tp_size: int = 1, expert_parallel: bool = False) -> WeightBytes:
    """One rank's weight bytes in ``weight_format`` (:data:`WEIGHT_FORMATS`): each quantized
    matrix's values (bits/8 an element) and its scales, zero points and indices, and every other
    parameter of :func:`params_per_rank` in 16-bit, so each parameter is counted once."""
    fmt = check_weight_format(weight_format)
    params = params_per_rank(shape, tp_size, expert_parallel)
    values = scales = numel = 0
    for kind, rows, cols, count in linear_matrices(shape, tp_size, expert_parallel):
        if kind not in fmt.quantizes:
            continue
        numel += count * rows * cols
        values += count * math.ceil(rows * cols * fmt.bits / 8)
        br, bc = (b or n for b, n in zip(fmt.block, (rows, cols)))
        n_scales = math.ceil(rows / br) * math.ceil(cols / bc)
        scales += count * (n_scales * fmt.scale_bytes + math.ceil(n_scales * fmt.zero_bits / 8)
                           + cols * fmt.index_bytes)
    if numel > params:
        raise ArgumentError(f"tp_size={tp_size}: the quantized matrices ({numel}) exceed the rank's "
                            f"{params} parameters (KV heads replicated past n_kv_head)")
    return WeightBytes(values, scales, 2 * (params - numel), params, numel)
