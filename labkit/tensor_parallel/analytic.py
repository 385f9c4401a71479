"""What tensor and sequence parallelism should cost: activation bytes, parameters, collectives.

``activation_bytes`` is Korthikanti et al. (2022), Table 2: bytes per layer per rank, 16-bit
activations, 1-byte dropout masks. ``model_activation_bytes`` is the same for labkit's GPT
(dropout 0, as :func:`labkit.tensor_parallel.apply_tensor_parallel` needs), derived from its code
in the terms of Chapter 1's :func:`labkit.memory.activation_bytes`; exact on the CPU.
"""

from __future__ import annotations

from ..memory.analytic import RECOMPUTE, ActivationBytes, korthikanti_activation_bytes
from ..memory.analytic import activation_bytes as chapter1_activation_bytes
from ..shapes import ModelShape
from ..validate import check_bool, check_choice, check_int
from .apply import check_tp_size
from .comm import check_seq_divisible

__all__ = ["RECOMPUTE", "activation_bytes", "model_activation_bytes", "params_per_rank",
           "collectives_per_layer", "collectives_per_step", "layer_flops", "layer_comm_bytes"]


def _degree(tp_size, tp) -> int:
    """``tp_size``, or ``tp`` (the name these functions had before) when only that is given."""
    if tp is not None:
        if tp_size not in (None, 1, tp):
            raise ValueError(f"tp_size={tp_size!r} and tp={tp!r} disagree: give tp_size only")
        tp_size = tp
    return check_int("tp_size", 1 if tp_size is None else tp_size, minimum=1)


def _sizes(**sizes) -> None:
    """Each of Korthikanti's sizes (s, b, h, a, ...) an int >= 1: zero or negative bytes mean nothing."""
    for name, value in sizes.items():
        check_int(name, value, minimum=1)


def _check(tp_size, sequence_parallel, recompute):
    check_int("tp_size", tp_size, minimum=1)
    check_bool("sequence_parallel", sequence_parallel)
    check_choice("recompute", recompute, RECOMPUTE)
    return tp_size if sequence_parallel else 1  # what the LayerNorm / dropout regions are divided by


def activation_bytes(s: int, b: int, h: int, a: int, tp_size: int = 1, sequence_parallel: bool = False,
                     recompute: str = "none", *, tp: int | None = None, sp: bool | None = None) -> float:
    """Activation bytes per transformer layer per rank, Korthikanti et al. (2022), Table 2.

    none: sbh(10 + 24/t + 5as/(ht)), or sbh/t (34 + 5as/h) with ``sequence_parallel``; selective
    drops the 5as/h attention-core term; full keeps the layer input only: 2sbh (2sbh/t with SP).
    t = ``tp_size``; ``tp=`` and ``sp=`` are the earlier names, still accepted.
    """
    _sizes(s=s, b=b, h=h, a=a)
    t = _degree(tp_size, tp)
    return korthikanti_activation_bytes(s, b, h, a, t, sequence_parallel if sp is None else sp, recompute)


def params_per_rank(cfg, tp_size: int) -> int:
    """Parameters one rank holds: V h/t + s h + L(12 h²/t + 7 h/t + 6 h) + 2 h.

    Split: the tied embedding, qkv, the projections' and MLP's weights, qkv's and c_fc's biases;
    replicated: positions, LayerNorms and the two row-parallel biases (added after the sum).
    Counted by :meth:`labkit.shapes.ModelShape.stage_params`, for either block.
    """
    check_tp_size(tp_size, cfg.n_head, cfg.d_model, cfg.vocab_size)
    return ModelShape.from_config(cfg).stage_params(tp_size)


def model_activation_bytes(cfg, batch_size: int, tp_size: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none", *, seq_len: int | None = None, dtype_bytes: int = 4,
                           device_type: str = "cpu") -> ActivationBytes:
    """Bytes labkit's tensor-parallel GPT keeps for backward, per rank, after one forward.

    Per layer, u = sbh e, r = t with sequence parallelism (else 1), ν the LayerNorm statistic
    element: (4u + 4bsν)/r + 12u/t + a s² b e/t (recompute "none"); "selective" (labkit's
    checkpoint policy) drops a s² b e/t; "full" keeps u/r. tp_size=1 is the unsharded model.
    """
    r = _check(tp_size, sequence_parallel, recompute)
    if cfg.dropout > 0:
        raise ValueError(f"cfg.dropout={cfg.dropout} must be 0: the tensor-parallel model refuses dropout")
    check_tp_size(tp_size, cfg.n_head, cfg.d_model, cfg.vocab_size)
    if sequence_parallel:
        check_seq_divisible(cfg.seq_len if seq_len is None else seq_len, tp_size)
    one = chapter1_activation_bytes(cfg, batch_size, seq_len, dtype_bytes=dtype_bytes, device_type=device_type)
    b, s = batch_size, cfg.seq_len if seq_len is None else seq_len
    h, a, V, e, t = cfg.d_model, cfg.n_head, cfg.vocab_size, dtype_bytes, tp_size
    nu = 4 if device_type == "cuda" else e
    u = s * b * h * e
    terms = {
        "layernorm inputs and outputs (4 sbh / r)": 4 * u // r,
        "layernorm mean and rstd (4 bs / r)": 4 * b * s * nu // r,
        "qkv, attention output, fc output, GELU output (12 sbh / t)": 12 * u // t,
        "softmax output (a s^2 b / t)": a * s * s * b * e // t,
    }
    if recompute == "selective":
        terms.pop("softmax output (a s^2 b / t)")
    elif recompute == "full":
        terms = {"block input (sbh / r)": u // r}
    if t == 1:
        head = one.head  # Chapter 1's: the unsharded model's embedding, final LayerNorm and loss
    else:
        head = (8 * b * s + b * s + 8 * s  # local token ids, their out-of-range mask, positions
                + (2 * u + 2 * b * s * nu) // r  # final LayerNorm: input, output, mean and rstd
                + b * s * V * e // t  # the softmax of this rank's logits, kept by the loss
                + 8 * b * s + 2 * b * s + 8 + e)  # target ids, two row masks, the count, the loss
    return ActivationBytes(per_layer=sum(terms.values()), head=head, n_layer=cfg.n_layer, terms=terms)


def collectives_per_layer(sequence_parallel: bool = False) -> dict:
    """The collectives one transformer layer issues per step, by pass.

    Plain: g after attention and after the MLP forward, f before them backward. Sequence
    parallel: an all-gather in and a reduce-scatter out of each region forward, their
    transposes backward, plus an all-gather of each saved input shard for the weight gradient.
    """
    if check_bool("sequence_parallel", sequence_parallel):
        return {"forward": {"all_gather": 2, "reduce_scatter": 2},
                "backward": {"all_gather": 4, "reduce_scatter": 2}}
    return {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}


def collectives_per_step(n_layer: int, sequence_parallel: bool = False, embedding: bool = True,
                         head: bool = True) -> dict:
    """Calls per step of each collective: ``collectives_per_layer`` x n_layer, plus the embedding
    (one g forward), the head (lm_head's f or gather), the loss (three all-reduces) and, with
    sequence parallelism, one all-reduce of the replicated parameters' gradients."""
    check_int("n_layer", n_layer, minimum=1)
    for name, flag in (("sequence_parallel", sequence_parallel), ("embedding", embedding), ("head", head)):
        check_bool(name, flag)
    total: dict = {}

    def add(kind, n):
        total[kind] = total.get(kind, 0) + n

    for counts in collectives_per_layer(sequence_parallel).values():
        for kind, n in counts.items():
            add(kind, n * n_layer)
    if embedding:
        add(*(("reduce_scatter", 1) if sequence_parallel else ("all_reduce", 1)))  # forward
        if sequence_parallel:
            add("all_gather", 1)  # its backward
    if head:
        if sequence_parallel:
            add("all_gather", 2)  # lm_head's input, forward and again backward
            add("reduce_scatter", 1)  # its input gradient
        else:
            add("all_reduce", 1)  # f before lm_head, backward
        add("all_reduce", 3)  # the loss: max, target logit, sum of exps
    if sequence_parallel:
        add("all_reduce", 1)  # the end-of-backward sum of the sequence-parallel gradients
    return total


def layer_flops(s: int, b: int, h: int, tp_size: int = 1, *, tp: int | None = None) -> float:
    """Training FLOPs of one layer per rank: 3 (24 b s h² + 4 b s² h) / t (forward, and backward
    twice the forward; Narayanan et al. 2021, Section 5.1). ``tp=``: tp_size's earlier name."""
    _sizes(s=s, b=b, h=h)
    t = _degree(tp_size, tp)
    return 3 * (24 * b * s * h * h + 4 * b * s * s * h) / t


def layer_comm_bytes(s: int, b: int, h: int, tp_size: int | None = None, dtype_bytes: int = 2,
                     sequence_parallel: bool = False, *, tp: int | None = None) -> float:
    """Bytes one rank sends per layer per step in a ring, for ``collectives_per_layer``'s calls.

    Plain: four all-reduces of (s, b, h), each 2(t-1)/t of the tensor. With sequence parallelism
    the same four as reduce-scatter + all-gather pairs, (t-1)/t each, plus the backward's two
    re-gathers of the saved input shards: 10 (t-1)/t sbh e instead of 8 (t-1)/t sbh e.
    """
    _sizes(s=s, b=b, h=h, dtype_bytes=dtype_bytes)
    t = _degree(tp_size, tp)
    check_bool("sequence_parallel", sequence_parallel)
    halves = 10 if sequence_parallel else 8  # all-gathers and reduce-scatters; an all-reduce is two
    return halves * (t - 1) / t * s * b * h * dtype_bytes
