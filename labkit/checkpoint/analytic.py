"""Bytes a checkpointing plan keeps, the peak of its step, and the FLOPs it recomputes (Chapter 3).

Derived from :mod:`labkit.model`'s code, in the terms of :func:`labkit.memory.activation_bytes`
(exact to the byte on CPU): u = sbh e is one (B, T, C) tensor, A the bytes a block keeps, C the
attention core's s^2 terms. A block keeps A (none), A - C (selective) or, for a full segment,
its input u only. "Peak" is the largest sum of activations and temporaries during forward and
backward (parameters, gradients and optimizer states are left out: checkpointing leaves them alone).
Exact on the CPU, where the tests compare it with the memory meter; on CUDA an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory.analytic import activation_bytes
from .plan import Plan, make_plan

__all__ = ["BlockBytes", "CheckpointBytes", "block_bytes", "checkpoint_activation_bytes",
           "block_forward_flops", "core_forward_flops", "recompute_flops"]


@dataclass(frozen=True)
class BlockBytes:
    """The per-block quantities the plan formulas combine (bytes)."""

    u: int         # one (B, T, C) activation: sbh e
    A: int         # kept by a block without checkpointing (our model's sbh(34 + 5as/h))
    S: int         # one (B, nh, T, T) score tensor: a s^2 b e
    mask_S: int    # the attention dropout mask: δ a s^2 b μ
    mask: int      # one (B, T, C) dropout mask: δ sbh μ
    ln_stats: int  # one LayerNorm's mean and rstd: 2 bs ν
    head: int      # kept outside the blocks (embedding dropout mask, final LayerNorm, loss)
    rest: int      # what of the head stays alive through the blocks' backward
    tied: int      # lm_head's gradient of the tied embedding, held until the embedding's arrives
    end: int       # beside both tied gradients in the token embedding's backward: its input gradient, loss, weight
    logits: int    # one (B, T, V) tensor
    drop: int      # δ: 1 when dropout is active
    copies: int    # 1 when matmul copies q, k, v (b > 1 and a > 1), 0 when it can take views

    @property
    def C(self) -> int:
        """The attention core's s^2 terms: softmax output, and with dropout its mask and output."""
        return self.S + self.drop * self.S + self.mask_S


def block_bytes(cfg, batch_size: int, seq_len: int | None = None, *, dtype_bytes: int = 4,
                device_type: str = "cpu", training: bool = True) -> BlockBytes:
    """The quantities of :class:`BlockBytes` for ``cfg`` and a batch, from the model's code."""
    act = activation_bytes(cfg, batch_size, seq_len, dtype_bytes=dtype_bytes,
                           device_type=device_type, training=training)
    b, s = batch_size, cfg.seq_len if seq_len is None else seq_len
    h, a, e, V = cfg.d_model, cfg.n_head, dtype_bytes, cfg.vocab_size
    d = 1 if (training and cfg.dropout > 0) else 0
    mu = 1 if device_type == "cuda" else e  # dropout mask element: CUDA's bool, the CPU's noise
    nu = 4 if device_type == "cuda" else e  # LayerNorm statistic element
    return BlockBytes(
        u=s * b * h * e, A=act.per_layer, S=a * s * s * b * e, mask_S=d * a * s * s * b * mu,
        mask=d * s * b * h * mu, ln_stats=2 * b * s * nu, head=act.head,
        rest=d * s * b * h * mu + 8 * s + 2 * e,  # embedding dropout mask, positions, loss and weight
        tied=V * h * e, end=s * b * h * e + 2 * e, logits=b * s * V * e, drop=d, copies=int(b > 1 and a > 1))


@dataclass(frozen=True)
class CheckpointBytes:
    """``kept``: activations alive at the end of forward; ``peak``: the step's peak (see module)."""

    kept: int
    peak: int
    kept_per_block: tuple
    head: int


def _segment_peak(q: BlockBytes, mode: str, n: int) -> int:
    """A segment's peak above what is alive before it (Chapter 3 derives each station).

    fwd: the forward at the softmax (scores twice) or after att @ v; mlp: backward through the
    MLP's second linear, with gradients g, dropout(g) and the (B, T, 4C) input gradient; att:
    backward through att @ v; core: a recomputed core's backward beside its kept qkv. A full
    segment also holds its other recomputed blocks, the incoming gradient and its output.
    """
    u, d, S, m_S, sigma, T, c = q.u, q.drop, q.S, q.mask_S, q.ln_stats, q.tied, q.copies
    # forward at the softmax: LN_1 in and out, qkv (3u), q and k copies, two score tensors (+ mask);
    # or after att @ v: softmax output (+ dropout mask and output), v copy and the core's output
    fwd = sigma + max((5 + 2 * c) * u + 2 * S + d * m_S, (6 + 3 * c) * u + S + d * (S + m_S))
    # backward of the MLP's second linear: the block but its MLP mask, g, dropout(g), the 4h gradient
    mlp = q.A - q.mask + (5 + d) * u
    # backward of att @ v, then of dropout and softmax: LN_1 in and out, qkv, g, the gradients of the
    # core's output and of v, and two or three s^2 tensors at once
    att = sigma + max(8 * u + 2 * S + d * (S + m_S), (7 - c) * u + 3 * S + d * m_S)
    if mode == "none":
        return max(fwd, T + mlp, T + att)
    if mode == "full":  # + the incoming gradient and the recomputed output, held through the inner backward
        return (n - 1) * q.A + T + max(fwd + u, mlp + u, att + 2 * u)
    # selective: as att, beside the kept qkv the recomputed copies and the core's recomputed output
    core = sigma + max((9 + 4 * c) * u + 2 * S + d * (S + m_S), (9 + 2 * c) * u + 3 * S + d * m_S)
    return max(fwd, T + mlp - q.C, T + core)


def _head_peak(q: BlockBytes, kept: int) -> int:
    """The loss and lm_head backward: log-softmax's gradient beside its input gradient (2 bsV e),
    or the tied embedding's gradient V h e beside the final LayerNorm's output gradient u; and,
    with the blocks' activations gone, the token embedding's backward: two V h e gradients at once."""
    return max(kept + max(2 * q.logits, q.tied + q.u), 2 * q.tied + q.end)


def checkpoint_activation_bytes(cfg, policy, batch_size: int, seq_len: int | None = None, *,
                                k: int | None = None, dtype_bytes: int = 4, device_type: str = "cpu",
                                training: bool = True) -> CheckpointBytes:
    """Activations kept at the end of forward and the step's peak under ``policy`` (a name or Plan).

    kept = head + Σ_blocks {A: none, A - C: selective, u: first block of a full segment, 0: the rest}.
    peak = max(kept + max(2 bsV e, V h e + u)  [loss and lm_head backward],
               2 V h e + u + 2e  [token embedding backward, both tied gradients alive],
               max over segments of (kept before it + rest + the segment's own peak)).
    """
    plan = policy if isinstance(policy, Plan) else make_plan(policy, cfg.n_layer, k)
    if plan.n_layer != cfg.n_layer:
        raise ValueError(f"plan covers {plan.n_layer} blocks but cfg has n_layer={cfg.n_layer}")
    q = block_bytes(cfg, batch_size, seq_len, dtype_bytes=dtype_bytes, device_type=device_type, training=training)
    keep = {"none": q.A, "selective": q.A - q.C, "full": q.u}
    kept_per_block, peaks, before = [], [], 0
    for start, stop, mode in plan.bounds():
        n = stop - start
        peaks.append(before + q.rest + _segment_peak(q, mode, n))
        kept_per_block += [keep[mode]] + [0] * (n - 1)
        before += keep[mode]
    kept = before + q.head
    peak = max([_head_peak(q, kept)] + peaks)
    return CheckpointBytes(kept=kept, peak=peak, kept_per_block=tuple(kept_per_block), head=q.head)


def core_forward_flops(cfg, batch_size: int, seq_len: int | None = None) -> int:
    """Matmul FLOPs of one attention core's forward: q kᵀ and att v, 2 b s² h each."""
    s = cfg.seq_len if seq_len is None else seq_len
    return 4 * batch_size * s * s * cfg.d_model


def block_forward_flops(cfg, batch_size: int, seq_len: int | None = None) -> int:
    """Matmul FLOPs of one block's forward: 24 b s h² in its four linears, plus the core."""
    s = cfg.seq_len if seq_len is None else seq_len
    return 24 * batch_size * s * cfg.d_model ** 2 + core_forward_flops(cfg, batch_size, s)


def recompute_flops(cfg, policy, batch_size: int, seq_len: int | None = None, *,
                    k: int | None = None) -> int:
    """FLOPs recomputed in backward: one block forward per fully checkpointed block, one core per selective."""
    plan = policy if isinstance(policy, Plan) else make_plan(policy, cfg.n_layer, k)
    per = {"none": 0, "selective": core_forward_flops(cfg, batch_size, seq_len),
           "full": block_forward_flops(cfg, batch_size, seq_len)}
    return sum(per[m] for m in plan.modes)
