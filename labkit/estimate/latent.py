"""What labkit's multi-head latent attention keeps for backward in training, term by term.

Torch-free. ``labkit.mla.MultiHeadLatentAttention`` in place of the Llama block's attention: the
block's two RMSNorms and its MLP (or MoE block) are counted as before
(``labkit.memory.analytic.llama_layer_bytes``, :mod:`.experts`); :func:`mla_layer_bytes` replaces
the attention's terms. Model states need nothing here (``ModelShape.layer_params`` counts MLA's
matrices). Modelled with one tensor-parallel rank and no context parallelism: labkit runs MLA so
(``labkit.tensor_parallel`` splits ``CausalSelfAttention`` only), and anything else is refused by
name (:func:`check_mla_trainable`).
"""

from __future__ import annotations

from ..memory.analytic import ATTENTION, RECOMPUTE, lse_bytes
from ..validate import ArgumentError, check_choice, check_int

__all__ = ["mla_layer_bytes", "check_mla_trainable", "replace_attention_terms"]

# the Llama block's terms that are not its attention's: its two RMSNorms' (kept under MLA too)
_NORM_TERMS = ("RMSNorm fp32 inputs and 1/rms (2 (4sbh + 4bs) / r)", "RMSNorm normalised and outputs (4 sbh e / r)")


def check_mla_trainable(shape, *, tp_size: int = 1, cp_size: int = 1, kernels: str = "labkit") -> None:
    """Refuse by name what the estimate of labkit's MLA does not model: tensor, sequence or
    context parallelism of MLA (labkit runs MLA on one tensor-parallel rank, whole sequences),
    the fused kernels' count, and MLA in GPT-2's block."""
    if not shape.kv_lora_rank:
        return
    bad = [(f"tp_size={tp_size}", "tensor-parallel MLA") if tp_size > 1 else None,
           (f"cp_size={cp_size}", "context-parallel MLA") if cp_size > 1 else None,
           (f"kernels={kernels!r}", "fused MLA kernels") if kernels != "labkit" else None,
           (f"norm={shape.norm!r}, mlp={shape.mlp!r}", "MLA in GPT-2's block")
           if shape.norm != "rmsnorm" or shape.mlp == "gelu" else None]
    bad = [b for b in bad if b]
    if bad:
        raise ArgumentError(f"MLA (kv_lora_rank={shape.kv_lora_rank}) with {', '.join(b[0] for b in bad)}: the "
                            "training estimate models labkit's MLA on one tensor-parallel rank (tp_size=1, "
                            "cp_size=1), kernels='labkit', in the Llama block", "untrainable",
                            missing=[b[1] for b in bad])


def mla_layer_bytes(shape, seq_len: int, micro_batch: int, *, dtype_bytes: int, recompute: str = "none",
                    attention: str = "eager") -> dict:
    """Bytes one ``MultiHeadLatentAttention`` keeps for backward (tp = 1), by term; N = s b tokens,
    e = ``dtype_bytes``, a heads, c = kv_lora_rank, q' = q_lora_rank (0: no compressed query).

    The latent's RMSNorm (and the query's, q' > 0) keeps its fp32 input and 1/rms, the normalised
    tensor and its output, which W^UK, W^UV (W^UQ, W^QR) read; rope keeps nothing (buffers). The
    eager core (``AttentionCore``) keeps q = [q^C; q^R] and k = [k^C; k^R] (two concatenations,
    N a (d_nope + d_rope) e each), the softmax (a s^2 b e) and the values (N a d_v e: W^UV's output,
    or matmul's copy of it); W^O keeps its input (N a d_v e). "selective" (the core checkpointed):
    its inputs only. ``attention="flash"``: a fused kernel's count, as the Llama block's
    (q, k, v, its output O and a fp32 log-sum-exp per row and head): not measured, labkit's
    FlashAttention core does not take MLA. "full": nothing (the block input is the block's).
    """
    s, b = check_int("seq_len", seq_len, 1), check_int("micro_batch", micro_batch, 1)
    e = check_choice("dtype_bytes", dtype_bytes, (2, 4))
    check_choice("recompute", recompute, RECOMPUTE)
    check_choice("attention", attention, ATTENTION)
    if recompute == "full":
        return {}
    N, a, c, q = s * b, shape.n_head, shape.kv_lora_rank, shape.q_lora_rank or 0
    qk, dv = shape.qk_nope_head_dim + shape.qk_rope_head_dim, shape.v_head_dim
    norms = 2 if q else 1
    terms = {
        "latent RMSNorms' fp32 inputs and 1/rms (4 N (c + q') + 4 N per norm)": 4 * N * (c + q) + 4 * N * norms,
        "latent RMSNorms' normalised and outputs (2 N (c + q') e)": 2 * N * (c + q) * e,
        "q = [q^C; q^R] (N a (d_nope + d_rope) e)": N * a * qk * e,
        "k = [k^C; k^R] (N a (d_nope + d_rope) e)": N * a * qk * e,
        "values for the core (N a d_v e)": N * a * dv * e,
        "softmax output (a s^2 b e)": a * s * s * b * e,
        "W^O input (N a d_v e)": N * a * dv * e,
    }
    if recompute == "selective" or attention == "flash":
        del terms["softmax output (a s^2 b e)"]
    if attention == "flash" and recompute != "selective":
        terms.update({"attention output O (N a d_v e)": N * a * dv * e, "log-sum-exp (4 a s b)": lse_bytes(s, b, a)})
    return terms


def replace_attention_terms(terms: dict, shape, seq_len: int, micro_batch: int, **count) -> dict:
    """The Llama block's ``terms`` with its attention's replaced by MLA's (:func:`mla_layer_bytes`);
    ``terms`` unchanged for a model without MLA or under full recomputation (the block input)."""
    if not shape.kv_lora_rank or count.get("recompute") == "full":
        return terms
    if not set(_NORM_TERMS) <= set(terms):
        raise ArgumentError(f"MLA's count replaces the Llama block's attention terms; got {sorted(terms)}")
    mlp = {k: v for k, v in terms.items() if k not in _NORM_TERMS and not _is_attention(k)}
    return {**{k: terms[k] for k in _NORM_TERMS}, **mla_layer_bytes(shape, seq_len, micro_batch, **count), **mlp}


def _is_attention(term: str) -> bool:
    """A term of the Llama block's attention (llama_layer_bytes' names): q, keys, values, scores, O, L, c_proj."""
    return term.startswith(("rotated q", "keys for", "values for", "softmax output", "c_proj input",
                            "attention output O", "log-sum-exp"))
