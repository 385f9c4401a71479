"""The analytic side of the memory meter: bytes a training step needs, from formulas.

Model states (Chapter 1): parameters, gradients and optimizer states for a parameter count
under a precision policy and an optimizer; mixed-precision Adam needs 16 bytes per parameter
(Rajbhandari et al. 2020). Activations: the bytes our GPT keeps for backward, derived term by
term in Chapter 1, next to Korthikanti et al. (2022)'s sbh(34 + 5as/h).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..precision import _check
from ..validate import check_bool, check_choice, check_int

__all__ = [
    "ModelStateBytes", "model_state_bytes",
    "ActivationBytes", "activation_bytes", "korthikanti_activation_bytes",
]

# bytes per parameter: (parameters, gradients, optimizer states) for each policy
_PARAM_GRAD = {"fp32": (4, 4), "mixed": (2, 2), "mixed_fp32_grads": (2, 4), "bf16": (2, 2)}
_MASTER = {"fp32": 0, "mixed": 4, "mixed_fp32_grads": 4, "bf16": 0}  # an fp32 copy of the weights
_STATE_BYTES = {"fp32": 4, "mixed": 4, "mixed_fp32_grads": 4, "bf16": 2}  # dtype of optimizer moments
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
    ``"mixed_fp32_grads"`` (mixed with an fp32 gradient buffer: 18 bytes with Adam) or ``"bf16"``; ``optimizer``: ``"adam"``, ``"adamw"``, ``"sgd_momentum"`` or ``"sgd"``.
    ``n_tensors``: number of parameter tensors; torch's Adam keeps a 4-byte step count for each,
    on the CPU unless the optimizer is ``fused`` or ``capturable`` (``step_on_device=True``): on
    ``device_type="cuda"`` the counters are then host memory and not counted.
    """
    _check(precision, optimizer)
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


def korthikanti_activation_bytes(seq_len: int, batch_size: int, d_model: int, n_head: int) -> float:
    """Per-layer activation bytes of Korthikanti et al. (2022), eq. 1: sbh(34 + 5as/h).

    Assumes 16-bit activations, 1-byte dropout masks and no tensor parallelism.
    """
    s, b, h, a = (check_int(n, v, 1) for n, v in (("seq_len", seq_len), ("batch_size", batch_size),
                                                  ("d_model", d_model), ("n_head", n_head)))
    return s * b * h * (34 + 5 * a * s / h)
