"""Memory per GPU of a training run, from the formulas the techniques' tests check.

``training_memory`` composes: the parameters a rank holds (``ModelShape.stage_params``: tensor
and pipeline split), ZeRO's model-state bytes (``labkit.zero.analytic``), activations per layer
(Korthikanti et al. 2022 for GPT-2's block, ``labkit.memory.analytic.korthikanti_activation_bytes``;
the Llama block's terms, ``llama_layer_bytes``), and the pipeline's micro-batches in flight
(``labkit.pipeline.analytic.max_in_flight``); a MoE block's, :mod:`.experts`; context parallelism's
ring, shard positions and global loss, :mod:`.context`. It adds them, and writes no formula.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from ..memory.analytic import (ATTENTION, RECOMPUTE, embedding_bytes, head_bytes, korthikanti_activation_bytes,
                               llama_layer_bytes, lse_bytes)
from ..memory.fused import fused_llama_layer_bytes
from ..memory.runtime import non_torch_bytes, ring_peers
from ..pipeline.analytic import max_in_flight
from ..pipeline.schedules import make_schedule, peak_layers_in_flight
from ..shapes import ModelShape, preset
from ..validate import ArgumentError, check_bool, check_choice, check_int
from ..zero.analytic import STAGES
from .context import core_under_cp, cp_micro_batch_bytes, ring_layer_terms
from .experts import (DENSE_MLP, check_experts_trainable, moe_layer_bytes, rank_layer_params, rank_params,
                      rank_model_states, zero_model_state_bytes)
from .latent import check_mla_trainable, replace_attention_terms
from .report import breakdown

__all__ = ["MemoryEstimate", "training_memory", "layer_activation_bytes", "PRECISIONS", "OPTIMIZERS", "as_shape",
           "check_trainable", "TRAINING_MODELS"]

# precision -> (labkit.memory's policy for the model states, bytes of an activation element)
PRECISIONS = {"bf16-mixed": ("mixed", 2), "fp16-mixed": ("mixed", 2),
              "bf16-mixed-fp32-grads": ("mixed_fp32_grads", 2), "bf16-mixed-fp32-buffer": ("mixed_fp32_buffer", 2),
              "bf16": ("bf16", 2), "fp32": ("fp32", 4)}
OPTIMIZERS = ("adamw", "adam", "sgd_momentum", "sgd")
# What the activation count models of the features beyond labkit's block (ModelShape.features):
# biases and windows leave the tensors a layer keeps unchanged. Any other is refused by name.
TRAINING_MODELS = ("q/k/v biases", "output bias", "per-layer windows", "chunked attention", "experts", "MLA")
# What labkit's MoE block (labkit.moe.MoE) does not have, by name: refused
_UNMODELLED_EXPERTS = (("shared-expert gate", "shared_gate"), ("expert biases", "expert_bias"))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU of the most loaded rank (pipeline ``stage``): model states, the activations
    kept for backward, ``transient``, the peaks above them (logits and loss, the gathered ZeRO-3
    unit, a layer recomputed in full), and ``non_torch``, what the process holds outside PyTorch's
    tensors (``labkit.memory.runtime``: assumed, stated). ``offloaded``: bytes moved to the CPU."""

    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    stage: int = 0
    offloaded: int = 0
    non_torch: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.transient + self.non_torch

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}

    def __str__(self) -> str:
        parts = {k: getattr(self, k) for k in ("params", "grads", "optimizer", "activations", "transient", "non_torch")}
        notes = (("offloaded", {"stage": self.stage, "offloaded": self.offloaded}),) if self.offloaded \
            else (("stage", {"stage": self.stage}),)
        return breakdown(("training", {}), parts, self.total, notes)


def as_shape(shape) -> ModelShape:
    """A ``ModelShape``, a preset's name, a ``GPTConfig`` or a Hugging Face config.json dict."""
    if isinstance(shape, ModelShape):
        return shape
    if isinstance(shape, str):
        return preset(shape)
    if isinstance(shape, dict):
        return ModelShape.from_hf_config(shape)
    if hasattr(shape, "n_layer") and hasattr(shape, "d_model"):
        return ModelShape.from_config(shape)
    raise TypeError(f"shape={shape!r} must be a ModelShape, a preset name, a GPTConfig or a config.json dict")


def check_trainable(shape: ModelShape) -> ModelShape:
    """``shape`` if the training estimate models every feature it has, else a ValueError naming
    those it does not (a head size not d_model / n_head, extra norms, a shared expert's gate,
    ...): the activations it counts are those of labkit's block, its MoE block and its MLA."""
    missing = [f for f in shape.features() if f not in TRAINING_MODELS]
    missing += [name for name, field in _UNMODELLED_EXPERTS if getattr(shape, field)]
    if missing:
        raise ArgumentError(f"training estimates do not model {missing} yet (modelled: labkit's block, with "
                            f"{list(TRAINING_MODELS)})", "untrainable", missing=missing)
    return shape


def _degrees(dims) -> tuple[int, int, int, int, int]:
    """(dp, tp, pp, cp, ep) of any object with dp_size, tp_size, pp_size, cp_size, ep_size (missing: 1)."""
    names = ("dp_size", "tp_size", "pp_size", "cp_size", "ep_size")
    return (1,) * 5 if dims is None else tuple(check_int(f"dims.{n}", getattr(dims, n, 1), 1) for n in names)


def layer_activation_bytes(shape: ModelShape, seq_len: int, micro_batch: int, tp_size: int, *,
                           sequence_parallel: bool, recompute: str, dtype_bytes: int,
                           attention: str = "eager", kernels: str = "labkit", moe: bool = False,
                           ep_size: int = 1, capacity_factor: float | None = None, cp_size: int = 1) -> int:
    """Bytes one layer keeps per micro-batch per rank: Korthikanti's for GPT-2's block (16-bit
    activations, 1-byte dropout masks: Megatron's kernels), the Llama block's terms otherwise,
    labkit's or under fused kernels (``kernels``); ``attention="flash"``: no scores, a fp32
    log-sum-exp per row and head instead. ``moe``: a MoE layer, its MLP's terms :mod:`.experts`'
    (``ep_size``, ``capacity_factor``); MLA (``shape.kv_lora_rank``): its attention's :mod:`.latent`'.
    ``cp_size`` > 1: ``seq_len`` is a rank's s/cp tokens, the core the ring, flash-style (:mod:`.context`)."""
    check_mla_trainable(shape, tp_size=tp_size, cp_size=cp_size, kernels=kernels)
    attention = core_under_cp(attention, cp_size)
    if shape.norm == "layernorm" and shape.mlp == "gelu":
        e = dtype_bytes / 2  # Korthikanti's formula counts 2-byte activations
        flash = attention == "flash" and recompute == "none"
        kept = korthikanti_activation_bytes(seq_len, micro_batch, shape.d_model, shape.n_head, tp_size,
                                            sequence_parallel, "selective" if flash else recompute)
        return round(e * kept) + (lse_bytes(seq_len, micro_batch, shape.n_head // tp_size) if flash else 0)
    count = fused_llama_layer_bytes if kernels == "fused" else llama_layer_bytes
    terms = count(seq_len, micro_batch, shape.d_model, shape.n_head, shape.kv_heads, shape.ffn_dim,
                  dtype_bytes=dtype_bytes, tp_size=tp_size, sequence_parallel=sequence_parallel,
                  recompute=recompute, attention=attention)
    knobs = dict(dtype_bytes=dtype_bytes, recompute=recompute)
    terms = replace_attention_terms(terms, shape, seq_len, micro_batch, attention=attention, **knobs)
    if cp_size > 1 and kernels == "labkit":  # labkit's ring in place of its core
        terms = ring_layer_terms(terms, shape, seq_len, micro_batch, tp_size, **knobs)
    if check_bool("moe", moe) and recompute != "full":  # the experts in place of the dense MLP
        del terms[DENSE_MLP]
        terms.update(moe_layer_bytes(shape, seq_len, micro_batch, dtype_bytes=dtype_bytes, ep_size=ep_size,
                                     capacity_factor=capacity_factor))
    return sum(terms.values())


# training_memory's keyword form (before RunConfig), and its defaults: labkit's model as the meter
# measures it, so attention="eager" here (RunConfig's default is "flash", as real runs use)
_KNOBS = dict(seq_len=None, micro_batch=None, dims=None, zero_stage=0, recompute="none", sequence_parallel=False,
              num_microbatches=1, schedule="1f1b", v=1, precision="bf16-mixed", optimizer="adamw",
              offload=False, attention="eager", capacity_factor=None)


def training_memory(shape, run=None, *, stage: int | None = None, **knobs) -> MemoryEstimate:
    """Bytes per GPU of the most loaded rank of a run (a :class:`MemoryEstimate`), or of a rank of
    pipeline ``stage`` (0 to pp - 1) when given: every rank of a stage holds the same bytes.

    ``shape``: a ``ModelShape`` (or a preset name, a ``GPTConfig``, a config.json dict); ``run``: a
    ``labkit.parallel.RunConfig``, checked against the shape (``RunConfig.check``). Or, without
    ``run``, its keyword form: ``seq_len``, ``micro_batch`` (both required), ``dims`` (any object with
    ``dp_size``, ``tp_size``, ``pp_size``, ``cp_size``, ``ep_size``; None: one GPU), ``zero_stage``, ``recompute``,
    ``sequence_parallel``, ``num_microbatches``, ``schedule`` ("1f1b"), ``v``, ``precision``,
    ``optimizer``, ``offload`` and ``attention`` ("eager": labkit's model, whose attention keeps the
    (a, s, s) scores, as the meter measures it; "flash": a fused kernel's count; cp > 1: the ring).

    ZeRO shards the model states over the dp x cp ranks that hold the same parameters; context
    parallelism divides the sequence (:mod:`.context`). Experts: ``dims.ep_size``, ``capacity_factor``
    (None: dropless), :mod:`.experts`. Model states are exact, for one flat group per rank padded
    as ZeRO pads; torch's Adam also keeps a 4-byte step count per tensor, not counted. ``transient``
    is an estimate (the peaks above what is kept: the logits, a layer recomputed in full, ZeRO-3's
    gathered parameters); no communication bucket (torch's DDP copies into 25 MB buckets: add them).
    """
    shape = check_trainable(as_shape(shape))
    run = _as_run(run, knobs).check(shape)
    check_experts_trainable(shape, run)
    check_mla_trainable(shape, tp_size=run.tp_size, cp_size=run.cp_size, kernels=run.kernels)
    if stage is not None:
        return _stage_estimate(shape, check_int("stage", stage, 0, run.pp_size - 1), run)
    per_stage = [_stage_estimate(shape, st, run) for st in sorted({0, run.pp_size - 1})]
    return max(per_stage, key=lambda est: (est.total, -est.stage))


def _as_run(run, knobs: dict):
    """``run`` (a RunConfig), or the RunConfig of training_memory's keyword form."""
    from ..parallel.config import RunConfig
    if run is not None:
        if knobs:
            raise TypeError(f"training_memory takes a RunConfig or keywords, not both: {sorted(knobs)}")
        if not isinstance(run, RunConfig):
            raise TypeError(f"run={run!r} must be a labkit.parallel.RunConfig")
        return run
    unknown = sorted(set(knobs) - set(_KNOBS))
    if unknown:
        raise TypeError(f"training_memory got unknown keywords {unknown}; valid: {sorted(_KNOBS)}")
    k = {**_KNOBS, **knobs}
    for name in ("seq_len", "micro_batch"):
        if k[name] is None:
            raise TypeError(f"training_memory needs {name}= (or a RunConfig)")
    dp, tp, pp, cp, ep = _degrees(k.pop("dims"))
    return RunConfig(dp_size=dp, tp_size=tp, pp_size=pp, cp_size=cp, ep_size=ep, **k)


def _stage_estimate(shape, stage: int, run) -> MemoryEstimate:
    policy, e = PRECISIONS[run.precision]
    tp, pp, cp, sp, v = run.tp_size, run.pp_size, run.cp_size, run.sequence_parallel, run.v
    states = rank_model_states(shape, run, stage, policy)
    s, b, t = run.seq_len // cp, run.micro_batch, tp
    layer = dict(sequence_parallel=sp, dtype_bytes=e, attention=run.attention, kernels=run.kernels, cp_size=cp)
    # Stage `stage` holds max_in_flight micro-batches (chunks of 1/v of its layers, interleaved).
    # Under 1F1B with m >= p that is p - stage: stage 0 keeps p x L/p = L layers' worth of
    # activations whatever p is, so pipelining divides the model states but not stage 0's activations.
    in_flight = max_in_flight(pp, run.num_microbatches, run.schedule, v, stage)
    activations = _stage_layers_bytes(shape, run, stage, in_flight, s, b, layer)
    transient = _transient(shape, run, stage, s, b, e, layer, policy)
    if stage == 0:  # the embedding's position indices and, under TP, its ids and mask
        activations += in_flight * embedding_bytes(s, b, pos=shape.pos, tp_size=t)
    activations += in_flight * cp_micro_batch_bytes(shape, run, stage, s)  # positions, the global loss
    if stage > 0 and shape.norm == "rmsnorm" and e < 4 and run.recompute != "full":
        # the received activation, kept for its gradient: the first RMSNorm keeps an fp32 copy, not
        # it (in fp32 it keeps this very tensor; a LayerNorm or a checkpointed block keeps it too)
        activations += in_flight * s * b * shape.d_model * e // (t if sp else 1)
    if stage < pp - 1:  # each micro-batch's output, sent on and kept until its backward (b s h, /t with SP)
        activations += in_flight * s * b * shape.d_model * e // (t if sp else 1)
    if stage == pp - 1:  # the final norm and the loss's log-softmax (b s V/t), kept
        activations += in_flight * head_bytes(s, b, shape.d_model, shape.vocab_size, norm=shape.norm,
                                              dtype_bytes=e, tp_size=t, sequence_parallel=sp)
    params = 0 if run.offload_params else states.params
    offloaded = (states.grads + states.optimizer if run.offload else 0) + (states.params if run.offload_params else 0)
    outside = _outside(run.tp_size, run.cp_size, run.replicas, run.pp_size, run.ep_size)
    if run.offload:
        return MemoryEstimate(params, 0, 0, activations, transient, stage, offloaded, outside)
    return MemoryEstimate(params, states.grads, states.optimizer, activations, transient, stage, offloaded, outside)


def run_peers(run) -> int:
    """The NCCL peers of one rank of ``run`` (``labkit.memory.runtime``): a ring over each of the
    tensor-parallel, context-parallel and gradient (dp x cp replicas) groups, a pipeline stage's
    neighbours, and every other rank of an expert-parallel all-to-all."""
    return _peers(run.tp_size, run.cp_size, run.replicas, run.pp_size, run.ep_size)


def _peers(tp: int, cp: int, replicas: int, pp: int, ep: int) -> int:
    pipeline = 0 if pp == 1 else (1 if pp == 2 else 2)
    return ring_peers(tp) + ring_peers(cp) + ring_peers(replicas) + pipeline + ep - 1


@lru_cache(maxsize=8192)
def _layer_bytes(shape, s: int, b: int, t: int, recompute: str, **layer) -> int:
    return layer_activation_bytes(shape, s, b, t, recompute=recompute, **layer)


@lru_cache(maxsize=1024)
def _outside(tp: int, cp: int, replicas: int, pp: int, ep: int) -> int:
    """non_torch_bytes of a rank with these degrees, kept: a planner's sweep asks again and again."""
    return non_torch_bytes(_peers(tp, cp, replicas, pp, ep))


def _stage_layers_bytes(shape, run, stage: int, in_flight: int, s: int, b: int, layer: dict) -> int:
    """The most bytes of layers' activations rank ``stage`` holds at once: ``in_flight``
    chunk-forwards of equal chunks, or, when the chunks differ (v p does not divide n_layer, or
    dense and MoE layers mix), the peak over its schedule's actions."""
    kept = {moe: _layer_bytes(shape, s, b, run.tp_size, run.recompute, **_moe_knobs(run, moe), **layer)
            for moe in ((False, True) if shape.n_experts else (False,))}
    ranges = shape.stage_ranges(run.pp_size, stage, run.v)
    chunks = [sum(kept[shape.is_moe_layer(i)] for i in range(start, stop)) for start, stop in ranges]
    if len(set(chunks)) == 1:
        return in_flight * chunks[0]
    return _peak_layers(run.schedule, run.pp_size, run.num_microbatches, run.v, stage, tuple(chunks))


def _moe_knobs(run, moe: bool) -> dict:
    return dict(moe=True, ep_size=run.ep_size, capacity_factor=run.capacity_factor) if moe else {}


@lru_cache(maxsize=4096)
def _peak_layers(schedule: str, p: int, m: int, v: int, stage: int, sizes: tuple) -> int:
    """:func:`labkit.pipeline.schedules.peak_layers_in_flight` over the rank's actions, kept: a
    planner's sweep asks the same (p, m, v, stage) again and again."""
    return peak_layers_in_flight(_schedule(schedule, p, m, v)[stage], list(sizes))


@lru_cache(maxsize=256)
def _schedule(schedule: str, p: int, m: int, v: int) -> list:
    return make_schedule(schedule, p, m, v)


def _transient(shape, run, stage: int, s: int, b: int, e: int, layer: dict, policy: str) -> int:
    """The peaks above what a rank keeps: a layer recomputed in full, ZeRO-3's gathered parameters
    (one layer's and their gradients; the whole stage's with ``reshard_after_forward=False``), the
    last stage's logits and their gradient beside the log-softmax."""
    t = run.tp_size
    transient = 0
    if run.recompute == "full":  # backward recomputes one layer at a time: its activations, all kept
        transient += max(_layer_bytes(shape, s, b, t, "none", **_moe_knobs(run, moe), **layer)
                         for moe in {shape.is_moe_layer(i) for i in range(shape.n_layer)})
    if run.zero_stage == 3 and run.replicas > 1:
        one = zero_model_state_bytes(rank_layer_params(shape, t, run.ep_size), 1, 0, policy, run.optimizer)
        transient += one.params + one.grads
        if not run.reshard_after_forward:  # the stage's parameters stay gathered until their backward
            n = sum(rank_params(shape, t, run.pp_size, stage, run.v, run.ep_size))
            full = zero_model_state_bytes(n, 1, 0, policy, run.optimizer)
            shard = zero_model_state_bytes(n, run.replicas, 3, policy, run.optimizer)
            transient += full.params - shard.params
    if stage == run.pp_size - 1:
        transient += b * s * shape.vocab_rows(t) * e
    return transient
