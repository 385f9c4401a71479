"""Memory per GPU of a training run, from the formulas the techniques' tests check.

``training_memory`` composes: the parameters a rank holds (``ModelShape.stage_params``: tensor
and pipeline split), ZeRO's model-state bytes (``labkit.zero.analytic``), activations per layer
(Korthikanti et al. 2022 for GPT-2's block, ``labkit.memory.analytic.korthikanti_activation_bytes``;
the Llama block's terms, ``llama_layer_bytes``), and the pipeline's micro-batches in flight
(``labkit.pipeline.analytic.max_in_flight``). It writes no formula of its own beyond adding them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..memory.analytic import (RECOMPUTE, embedding_bytes, head_bytes, korthikanti_activation_bytes,
                               llama_layer_bytes)
from ..pipeline.analytic import max_in_flight
from ..pipeline.schedules import SCHEDULES
from ..shapes import ModelShape, preset
from ..validate import ArgumentError, check_bool, check_choice, check_int
from ..zero.analytic import STAGES, zero_model_state_bytes
from .report import breakdown

__all__ = ["MemoryEstimate", "training_memory", "layer_activation_bytes", "PRECISIONS", "OPTIMIZERS", "as_shape",
           "check_trainable", "TRAINING_MODELS"]

# precision -> (labkit.memory's policy for the model states, bytes of an activation element)
PRECISIONS = {"bf16-mixed": ("mixed", 2), "fp16-mixed": ("mixed", 2),
              "bf16-mixed-fp32-grads": ("mixed_fp32_grads", 2), "bf16": ("bf16", 2), "fp32": ("fp32", 4)}
OPTIMIZERS = ("adamw", "adam", "sgd_momentum", "sgd")
# What the activation count models of the features beyond labkit's block (ModelShape.features):
# biases and windows leave the tensors a layer keeps unchanged. Any other is refused by name.
TRAINING_MODELS = ("q/k/v biases", "output bias", "per-layer windows", "chunked attention")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU of the most loaded rank (pipeline ``stage``): model states, the activations
    kept for backward, and ``transient``, the peaks above them (logits and loss, the gathered
    ZeRO-3 unit, a layer recomputed in full). ``offloaded``: bytes moved to the CPU."""

    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    stage: int = 0
    offloaded: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.transient

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}

    def __str__(self) -> str:
        parts = {k: getattr(self, k) for k in ("params", "grads", "optimizer", "activations", "transient")}
        notes = (f"(pipeline stage {self.stage}; {self.offloaded / 1e9:.3f} GB offloaded to the CPU)",) \
            if self.offloaded else (f"(pipeline stage {self.stage})",)
        return breakdown("Training memory per GPU (GB = 10^9 bytes)", parts, self.total, notes)


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
    those it does not (experts, MLA, a head size not d_model / n_head, extra norms, ...): the
    activations it counts are those of labkit's block, and a mixture of experts needs its own."""
    missing = [f for f in shape.features() if f not in TRAINING_MODELS]
    if missing:
        moe = "; a mixture of experts needs an expert-parallel axis (ep), not there yet" if "experts" in missing else ""
        raise ArgumentError(f"training estimates do not model {missing} yet (modelled: labkit's block, with "
                            f"{list(TRAINING_MODELS)}){moe}", "untrainable", missing=missing)
    return shape


def _degrees(dims) -> tuple[int, int, int, int]:
    """(dp, tp, pp, cp) of any object with dp_size, tp_size, pp_size, cp_size (missing ones: 1)."""
    if dims is None:
        return 1, 1, 1, 1
    return tuple(check_int(f"dims.{n}", getattr(dims, n, 1), 1) for n in ("dp_size", "tp_size", "pp_size", "cp_size"))


def layer_activation_bytes(shape: ModelShape, seq_len: int, micro_batch: int, tp_size: int, *,
                           sequence_parallel: bool, recompute: str, dtype_bytes: int) -> int:
    """Bytes one layer keeps per micro-batch per rank: Korthikanti's for GPT-2's block (16-bit
    activations, 1-byte dropout masks), the Llama block's terms otherwise."""
    if shape.norm == "layernorm" and shape.mlp == "gelu":
        e = dtype_bytes / 2  # Korthikanti's formula counts 2-byte activations
        return round(e * korthikanti_activation_bytes(seq_len, micro_batch, shape.d_model, shape.n_head,
                                                      tp_size, sequence_parallel, recompute))
    return sum(llama_layer_bytes(seq_len, micro_batch, shape.d_model, shape.n_head, shape.kv_heads,
                                 shape.ffn_dim, dtype_bytes=dtype_bytes, tp_size=tp_size,
                                 sequence_parallel=sequence_parallel, recompute=recompute).values())


def training_memory(shape, *, seq_len: int, micro_batch: int, dims=None, zero_stage: int = 0,
                    recompute: str = "none", sequence_parallel: bool = False, num_microbatches: int = 1,
                    schedule: str = "1f1b", v: int = 1, precision: str = "bf16-mixed",
                    optimizer: str = "adamw", offload: bool = False, stage: int | None = None) -> MemoryEstimate:
    """Bytes per GPU of the most loaded rank of a run (a :class:`MemoryEstimate`), or of a rank of
    pipeline ``stage`` (0 to pp - 1) when given: every rank of a stage holds the same bytes.

    ``shape``: a ``ModelShape`` (or a preset name, a ``GPTConfig``, a config.json dict);
    ``dims``: any object with ``dp_size``, ``tp_size``, ``pp_size``, ``cp_size`` (such as
    ``labkit.parallel.ParallelDims``; None: one GPU). ZeRO shards the model states over the
    dp x cp ranks that hold the same parameters; context parallelism divides the sequence (each
    rank's attention scores counted over its s/cp queries and s/cp keys: one block of a ring).
    ``precision``: one of :data:`PRECISIONS`; ``offload``: the gradients and optimizer states
    live on the CPU (ZeRO-Offload), the GPU keeps the parameters.

    Activations are those of labkit's model, whose attention materialises the (a, s, s) scores
    (the 5as/h term): selective recomputation drops them, as a FlashAttention kernel would.
    Model states are exact, for one flat group per rank padded as ZeRO pads; torch's Adam also
    keeps a 4-byte step count per tensor, on the host unless the optimizer is fused, not counted.
    ``transient`` is an estimate (the meter's peak is not compared with ``total``); it counts no
    communication bucket, since labkit's bucketed data parallelism makes the gradients views of
    its buckets (torch's DDP copies into 25 MB buckets: add them for it).
    """
    shape = check_trainable(as_shape(shape))
    dp, tp, pp, cp = _degrees(dims)
    args = _check_args(shape, seq_len, micro_batch, tp, pp, cp, zero_stage, recompute, sequence_parallel,
                       num_microbatches, schedule, v, precision, optimizer, offload)
    if stage is not None:
        return _stage_estimate(shape, check_int("stage", stage, 0, pp - 1), dp, tp, pp, cp, **args)
    stages = sorted({0, pp - 1})
    per_stage = [_stage_estimate(shape, stage, dp, tp, pp, cp, **args) for stage in stages]
    return max(per_stage, key=lambda est: (est.total, -est.stage))


def _check_args(shape, seq_len, micro_batch, tp, pp, cp, zero_stage, recompute, sequence_parallel,
                num_microbatches, schedule, v, precision, optimizer, offload) -> dict:
    check_int("seq_len", seq_len, 1)
    check_int("micro_batch", micro_batch, 1)
    check_int("num_microbatches", num_microbatches, 1)
    check_int("v", v, 1)
    check_choice("zero_stage", zero_stage, STAGES)
    check_choice("recompute", recompute, RECOMPUTE)
    check_bool("sequence_parallel", sequence_parallel)
    check_choice("schedule", schedule, SCHEDULES)
    check_choice("precision", precision, tuple(PRECISIONS))
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_bool("offload", offload)
    shape.check_tp_size(tp)
    if pp > shape.n_layer:
        raise ArgumentError(f"dims.pp_size={pp} must be at most n_layer={shape.n_layer} (a stage holds a layer or more)",
                            "pp_size", pp_size=pp, n_layer=shape.n_layer)
    if v > 1 and (schedule != "interleaved" or shape.n_layer % (pp * v)):
        raise ValueError(f"v={v} chunks a rank need schedule='interleaved' and v x pp_size to divide "
                         f"n_layer={shape.n_layer}")
    if seq_len % (cp * (tp if sequence_parallel else 1)):
        raise ArgumentError(f"seq_len={seq_len} must be divisible by cp_size={cp} (x tp_size={tp} with "
                            "sequence parallelism): each rank holds an equal share of the positions", "seq_cp",
                            seq_len=seq_len, cp_size=cp, tp_size=tp)
    return dict(seq_len=seq_len, micro_batch=micro_batch, zero_stage=zero_stage, recompute=recompute,
                sequence_parallel=sequence_parallel, num_microbatches=num_microbatches, schedule=schedule,
                v=v, precision=precision, optimizer=optimizer, offload=offload)


def _stage_estimate(shape, stage, dp, tp, pp, cp, *, seq_len, micro_batch, zero_stage, recompute,
                    sequence_parallel, num_microbatches, schedule, v, precision, optimizer,
                    offload) -> MemoryEstimate:
    policy, e = PRECISIONS[precision]
    n_params = shape.stage_params(tp, pp, stage)
    states = zero_model_state_bytes(n_params, dp * cp, zero_stage, policy, optimizer)
    s, b, t = seq_len // cp, micro_batch, tp
    layer = dict(sequence_parallel=sequence_parallel, dtype_bytes=e)
    kept = layer_activation_bytes(shape, s, b, t, recompute=recompute, **layer)
    # Stage `stage` holds max_in_flight micro-batches (chunks of 1/v of its layers, interleaved).
    # Under 1F1B with m >= p that is p - stage: stage 0 keeps p x L/p = L layers' worth of
    # activations whatever p is, so pipelining divides the model states but not stage 0's activations.
    in_flight = max_in_flight(pp, num_microbatches, schedule, v, stage)
    activations = in_flight * shape.stage_layers(pp, stage) * kept // v
    transient = 0
    if recompute == "full":  # backward recomputes one layer at a time: its activations, all kept
        transient += layer_activation_bytes(shape, s, b, t, recompute="none", **layer)
    if zero_stage == 3 and dp * cp > 1:  # one layer's parameters gathered whole, and their gradients
        one = zero_model_state_bytes(shape.layer_params(t), 1, 0, policy, optimizer)
        transient += one.params + one.grads
    if stage == 0:  # the embedding's position indices and, under TP, its ids and mask
        activations += in_flight * embedding_bytes(s, b, pos=shape.pos, tp_size=t)
    if stage > 0 and shape.norm == "rmsnorm" and e < 4 and recompute != "full":
        # the received activation, kept for its gradient: the first RMSNorm keeps an fp32 copy, not
        # it (in fp32 it keeps this very tensor; a LayerNorm or a checkpointed block keeps it too)
        activations += in_flight * s * b * shape.d_model * e // (t if sequence_parallel else 1)
    if stage < pp - 1:  # each micro-batch's output, sent on and kept until its backward (b s h, /t with SP)
        activations += in_flight * s * b * shape.d_model * e // (t if sequence_parallel else 1)
    if stage == pp - 1:  # the final norm and the loss's log-softmax (b s V/t), kept; the logits
        activations += in_flight * head_bytes(s, b, shape.d_model, shape.vocab_size, norm=shape.norm,
                                              dtype_bytes=e, tp_size=t, sequence_parallel=sequence_parallel)
        transient += b * s * shape.vocab_rows(t) * e  # (then their gradient) sit beside the log-softmax
    if offload:
        return MemoryEstimate(states.params, 0, 0, activations, transient, stage,
                              offloaded=states.grads + states.optimizer)
    return MemoryEstimate(states.params, states.grads, states.optimizer, activations, transient, stage)
