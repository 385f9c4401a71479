"""The analytic side of the memory meter: bytes a training step needs, from formulas.

Model states (Chapter 1): parameters, gradients and optimizer states for a parameter count
under a precision policy and an optimizer; mixed-precision Adam needs 16 bytes per parameter
(Rajbhandari et al. 2020). Activations: the bytes our GPT keeps for backward, derived term by
term in Chapter 1, next to Korthikanti et al. (2022)'s sbh(34 + 5as/h).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..validate import check_bool, check_choice, check_int

__all__ = [
    "ModelStateBytes", "model_state_bytes", "RECOMPUTE",
    "ActivationBytes", "activation_bytes", "korthikanti_activation_bytes", "llama_layer_bytes", "head_bytes",
    "embedding_bytes", "ATTENTION", "lse_bytes",
]

# What a layer keeps under recomputation (Korthikanti et al. 2022): everything, all but the
# attention core (selective), or its input only (full). The one list of the modes: the
# checkpoint package, tensor parallelism, the planner and the estimator read it from here.
RECOMPUTE = ("none", "selective", "full")
# The attention kernel, a choice apart from recomputation: "flash" never stores the (a, s, s)
# scores (it keeps q, k, v, its output and one fp32 log-sum-exp per row, Dao 2023); "eager" is
# labkit's model, whose softmax output autograd keeps, as the memory meter measures it.
ATTENTION = ("flash", "eager")

# bytes per parameter: (parameters, gradients, optimizer states) for each policy
_PARAM_GRAD = {"fp32": (4, 4), "mixed": (2, 2), "mixed_fp32_grads": (2, 4), "mixed_fp32_buffer": (2, 6), "bf16": (2, 2)}
_MASTER = {"fp32": 0, "mixed": 4, "mixed_fp32_grads": 4, "mixed_fp32_buffer": 4, "bf16": 0}  # an fp32 copy of the weights
_STATE_BYTES = {"fp32": 4, "mixed": 4, "mixed_fp32_grads": 4, "mixed_fp32_buffer": 4, "bf16": 2}  # optimizer moments
_N_STATES = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}
_STEP_COUNTER = {"adam": 4, "adamw": 4, "sgd_momentum": 0, "sgd": 0}  # torch's fp32 `step` per tensor


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of the model states: parameters, gradients, optimizer states (with master weights)."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer, "total": self.total}


def model_state_bytes(n_params: int, precision: str = "mixed", optimizer: str = "adam",
                      n_tensors: int = 0, *, device_type: str = "cpu",
                      step_on_device: bool = False) -> ModelStateBytes:
    """Model-state bytes of Ψ = ``n_params`` parameters (Chapter 1, eq. 16Ψ).

    ``precision``: ``"fp32"``, ``"mixed"`` (16-bit params and grads, fp32 master weights),
    ``"mixed_fp32_grads"`` (mixed with an fp32 gradient buffer: 18 bytes with Adam),
    ``"mixed_fp32_buffer"`` (the 16-bit gradients of a backward held beside that buffer until it
    ends, DeepSpeed's BF16 optimizer: 20 bytes) or ``"bf16"``; ``optimizer``: ``"adam"``, ``"adamw"``, ``"sgd_momentum"`` or ``"sgd"``.
    ``n_tensors``: number of parameter tensors; torch's Adam keeps a 4-byte step count for each,
    on the CPU unless the optimizer is ``fused`` or ``capturable`` (``step_on_device=True``): on
    ``device_type="cuda"`` the counters are then host memory and not counted.
    """
    check_choice("precision", precision, tuple(_PARAM_GRAD))  # labkit.precision.PRECISIONS, torch-free
    check_choice("optimizer", optimizer, tuple(_N_STATES))  # labkit.precision.OPTIMIZERS
    check_int("n_params", n_params)
    check_int("n_tensors", n_tensors)
    check_choice("device_type", device_type, ("cpu", "cuda"))
    check_bool("step_on_device", step_on_device)
    counters = n_tensors if (device_type == "cpu" or step_on_device) else 0
    p, g = _PARAM_GRAD[precision]
    per_param_opt = _MASTER[precision] + _N_STATES[optimizer] * _STATE_BYTES[precision]
    return ModelStateBytes(params=p * n_params, grads=g * n_params,
                           optimizer=per_param_opt * n_params + _STEP_COUNTER[optimizer] * counters)


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes kept for backward: ``per_layer`` x n_layer + ``head`` = ``total``."""

    per_layer: int
    head: int
    n_layer: int
    terms: dict  # per-layer terms, name -> bytes

    @property
    def total(self) -> int:
        return self.n_layer * self.per_layer + self.head


def activation_bytes(cfg, batch_size: int, seq_len: int | None = None, *, dtype_bytes: int = 4,
                     device_type: str = "cpu", training: bool = True) -> ActivationBytes:
    """Bytes that :class:`labkit.model.GPT` keeps for backward in one forward pass (Chapter 1).

    Per layer, with e = ``dtype_bytes``, μ the bytes of a dropout mask element (1 for CUDA's
    fused dropout, e for the CPU path) and δ = 1 when dropout is active:
    sbh(16e + 2δμ) + abs²(e + δ(e + μ)) + 4bsν, with ν the bytes of a LayerNorm mean/rstd
    element (4 on CUDA, which keeps them in fp32; e on the CPU path).
    """
    b, s = batch_size, cfg.seq_len if seq_len is None else seq_len
    check_int("batch_size", b, 1)
    check_int("seq_len", s, 1)
    check_choice("dtype_bytes", dtype_bytes, (2, 4))
    check_choice("device_type", device_type, ("cpu", "cuda"))
    check_bool("training", training)
    h, a, V, e = cfg.d_model, cfg.n_head, cfg.vocab_size, dtype_bytes
    d = 1 if (training and cfg.dropout > 0) else 0
    mu = 1 if device_type == "cuda" else e
    nu = 4 if device_type == "cuda" else e
    terms = {
        "layernorm inputs (2 sbh)": 2 * s * b * h * e,
        "layernorm outputs = qkv and fc inputs (2 sbh)": 2 * s * b * h * e,
        "q, k, v copies (3 sbh)": 3 * s * b * h * e,
        "attention output = proj input (sbh)": s * b * h * e,
        "fc output = GELU input (4 sbh)": 4 * s * b * h * e,
        "GELU output = fc2 input (4 sbh)": 4 * s * b * h * e,
        "dropout masks after proj and MLP (2 sbh)": 2 * d * s * b * h * mu,
        "softmax output (a s^2 b)": a * s * s * b * e,
        "attention dropout mask and output (2 a s^2 b)": d * a * s * s * b * (mu + e),
        "layernorm mean and rstd (4 bs)": 2 * 2 * b * s * nu,
    }
    head = (2 * s * b * h * e          # final LayerNorm input and output (lm_head input)
            + 2 * b * s * nu           # its mean and rstd
            + d * s * b * h * mu       # embedding dropout mask
            + b * s * V * e            # log-softmax output kept by the cross-entropy
            + 2 * e                    # the loss and the cross-entropy's total weight
            + 8 * s)                   # position indices (int64)
    return ActivationBytes(per_layer=sum(terms.values()), head=head, n_layer=cfg.n_layer, terms=terms)


def korthikanti_activation_bytes(seq_len: int, batch_size: int, d_model: int, n_head: int,
                                 tp_size: int = 1, sequence_parallel: bool = False,
                                 recompute: str = "none") -> float:
    """Per-layer activation bytes per rank of Korthikanti et al. (2022), eq. 1 and Table 2.

    16-bit activations, 1-byte dropout masks. t = ``tp_size``: sbh(10 + 24/t + 5as/(ht)), or
    sbh/t (34 + 5as/h) with ``sequence_parallel``; "selective" recomputation drops the 5as/h
    attention-core term; "full" keeps the layer input only, 2sbh (2sbh/t with SP). With t = 1:
    eq. 1, sbh(34 + 5as/h). The one place this formula is written.
    """
    s, b, h, a, t = (check_int(n, v, 1) for n, v in (("seq_len", seq_len), ("batch_size", batch_size),
                                                     ("d_model", d_model), ("n_head", n_head),
                                                     ("tp_size", tp_size)))
    sp = check_bool("sequence_parallel", sequence_parallel)
    check_choice("recompute", recompute, RECOMPUTE)
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / t if sp else 2 * sbh
    attn = 0 if recompute == "selective" else 5 * a * s / h
    if t == 1:
        return sbh * (34 + attn)
    return sbh / t * (34 + attn) if sp else sbh * (10 + 24 / t + attn / t)


def llama_layer_bytes(seq_len: int, batch_size: int, d_model: int, n_head: int, n_kv_head: int,
                      d_ff: int, *, dtype_bytes: int = 2, tp_size: int = 1,
                      sequence_parallel: bool = False, recompute: str = "none",
                      attention: str = "eager") -> dict:
    """Bytes one Llama block of :class:`labkit.model.GPT` keeps for backward, per rank, by term.

    Derived as Korthikanti et al. derive GPT-2's, from which tensors autograd saves in labkit's
    code (RMSNorm computed in fp32, rotary positions, grouped-query attention, SwiGLU, no
    dropout); e = ``dtype_bytes``, u = sbh e, hd = h/a, f = ``d_ff``, and a, n_kv the heads of
    one of t = ``tp_size`` ranks. Each RMSNorm keeps its fp32 input (4sbh), its fp32 1/rms (4bs),
    the normalised tensor cast back and its output (2u). Attention keeps the rotated q (u), the
    keys and values matmul reads, the softmax (a s^2 b e) and c_proj's input (u); rope keeps
    nothing (its cos and sin are buffers). Keys: the rotated k (u) when n_kv = a; with n_kv < a
    the copy ``repeat_kv`` makes (u), except one KV head at b = 1, a stride-0 view of k (u/a).
    Values: a view of the qkv projection's output ((a + 2 n_kv) hd sb e) when matmul can fold
    (b, a) into one batch dimension without copying (n_kv = a or 1, and b = 1), else a copy (u).
    SwiGLU keeps its gate, SiLU, up and their product (4 sbf e). Sequence parallelism divides the
    norms' terms by t too; "selective" (labkit's policy: the attention core checkpointed) drops the
    softmax and keeps the core's q, k, v as they are passed, views included; "full" keeps the block
    input (u, /t with SP). ``attention="flash"``: labkit's FlashAttention core in place of the
    softmax (``labkit.flash_attention.apply_flash_attention``): no scores; its output O and a fp32
    log-sum-exp per row (4 a s b) instead, the keys and values as it receives them (:data:`ATTENTION`).
    """
    s, b, h, a, kv, f, t = (check_int(n, v, 1) for n, v in (
        ("seq_len", seq_len), ("batch_size", batch_size), ("d_model", d_model), ("n_head", n_head),
        ("n_kv_head", n_kv_head), ("d_ff", d_ff), ("tp_size", tp_size)))
    e = check_choice("dtype_bytes", dtype_bytes, (2, 4))
    r = t if check_bool("sequence_parallel", sequence_parallel) else 1
    check_choice("recompute", recompute, RECOMPUTE)
    check_choice("attention", attention, ATTENTION)
    if recompute == "full":
        return {"block input (sbh e / r)": s * b * h * e // r}
    a, kv, f, hd = a // t, kv // t, f // t, h // a  # this rank's heads and MLP width
    token = hd * s * b * e  # one head's (b, s, hd) tensor
    # matmul folds (b, a) into one batch dimension as a view; under selective recomputation the
    # checkpoint keeps the core's inputs as they are, views included, and matmul's copies go
    folds = b == 1 or a == 1 or recompute == "selective"
    terms = {
        "RMSNorm fp32 inputs and 1/rms (2 (4sbh + 4bs) / r)": 2 * (4 * s * b * h + 4 * b * s) // r,
        "RMSNorm normalised and outputs (4 sbh e / r)": 4 * s * b * h * e // r,
        "rotated q (sbh e / t)": a * token,
        "keys for the core (sbh e / t; one KV head at b = 1: sbh e / a)":
            (kv if kv == 1 and folds else a) * token,
        "values for the core (sbh e / t, or the qkv output it views)":
            ((a + 2 * kv) if (kv in (a, 1) and folds) else a) * token,
        "softmax output (a s^2 b e / t)": a * s * s * b * e,
        "c_proj input (sbh e / t)": a * token,
        "SwiGLU gate, SiLU, up, product (4 sbf e / t)": 4 * s * b * f * e,
    }
    if recompute == "selective" or attention == "flash":
        terms.pop("softmax output (a s^2 b e / t)")
    if attention == "flash":
        terms.update(_flash_terms(token, s, b, a, kv, kept_by_core=recompute != "selective"))
    return terms


def _flash_terms(token: int, s: int, b: int, a: int, kv: int, kept_by_core: bool) -> dict:
    """What the Llama block keeps around labkit's FlashAttention core (``apply_flash_attention``),
    which saves q, k, v, its output O and its fp32 log-sum-exp L: the keys and values as
    ``repeat_kv`` hands them over (a copy of a heads; with nothing to repeat, or one KV head, the
    rotated k as a view and a view of the qkv output), and, unless the core is checkpointed
    (selective recomputation keeps its inputs only), O and L (4 a s b)."""
    view = kv in (a, 1)
    terms = {"keys for the core (sbh e / t; one KV head at b = 1: sbh e / a)": (kv if view else a) * token,
             "values for the core (sbh e / t, or the qkv output it views)": ((a + 2 * kv) if view else a) * token}
    if kept_by_core:
        terms.update({"attention output O (sbh e / t)": a * token, "log-sum-exp (4 a s b / t)": lse_bytes(s, b, a)})
    return terms


def lse_bytes(seq_len: int, batch_size: int, n_head: int) -> int:
    """Bytes of a fused attention kernel's fp32 log-sum-exp, one per query row and head: 4 a s b."""
    return 4 * n_head * seq_len * batch_size


def head_bytes(seq_len: int, batch_size: int, d_model: int, vocab_size: int, *, norm: str = "rmsnorm",
               dtype_bytes: int = 2, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """Bytes the model's head keeps for backward, per rank: the final norm (RMSNorm's terms as in
    :func:`llama_layer_bytes`, or LayerNorm's input, output and fp32 mean and rstd), the
    log-softmax of this rank's logits that the cross-entropy keeps (b s V/t e, the vocabulary
    padded to a multiple of t) and the loss with its weight (2e); under tensor parallelism the
    vocabulary-parallel loss keeps, instead of the weight, each row's target index in this rank's
    columns (int64), whether this rank holds it and whether it counts (bool each), and the count
    (int64): 10bs + 8 bytes. Exact for labkit's model on the CPU."""
    s, b, h, V, t = (check_int(n, v, 1) for n, v in (("seq_len", seq_len), ("batch_size", batch_size),
                                                   ("d_model", d_model), ("vocab_size", vocab_size),
                                                   ("tp_size", tp_size)))
    check_choice("norm", norm, ("rmsnorm", "layernorm"))
    e = check_choice("dtype_bytes", dtype_bytes, (2, 4))
    r = t if check_bool("sequence_parallel", sequence_parallel) else 1
    if norm == "rmsnorm":  # fp32 input and 1/rms, the normalised tensor and the output
        norm_bytes = (4 * s * b * h + 4 * b * s + 2 * s * b * h * e) // r
    else:  # input and output, fp32 mean and rstd
        norm_bytes = (2 * s * b * h * e + 8 * b * s) // r
    loss = 2 * e if t == 1 else e + 10 * b * s + 8
    return norm_bytes + b * s * -(-V // t) * e + loss


def embedding_bytes(seq_len: int, batch_size: int, *, pos: str = "rope", tp_size: int = 1) -> int:
    """Bytes the model's embedding keeps for backward, per rank (the token ids are the step's
    input, not kept by it): a learned position table's indices (int64, 8s); under tensor
    parallelism the vocabulary-parallel lookup's ids in this rank's rows (int64) and the mask of
    those it does not hold (bool), 9bs. Rotary positions keep nothing (cos and sin are buffers).
    Exact for labkit's model on the CPU."""
    s, b, t = (check_int(n, v, 1) for n, v in (("seq_len", seq_len), ("batch_size", batch_size),
                                               ("tp_size", tp_size)))
    check_choice("pos", pos, ("learned", "rope"))
    return (8 * s if pos == "learned" else 0) + (9 * b * s if t > 1 else 0)
