"""One description of a training run: :class:`RunConfig` (torch-free).

The degrees (``ParallelDims``' dp, tp, pp, cp and the expert axis ep), the batch (micro-batch b,
m micro-batches a pipeline, the sequence length), the pipeline (v chunks a rank, the schedule),
ZeRO and offload, recomputation, sequence parallelism, precision, optimizer, the attention kernel,
and how ZeRO-3 and the gradient reduction run. A knob is one field here; the estimator
(``labkit.estimate.training_memory``), the step-time model, the planner's sweep and its
``TrainingPlan``, Chapter 6's ``Plan``, the CLI, the exporters and ``parallelize_gpt`` read it.

Each rule lives once, with the technique that owns it; :meth:`RunConfig.check` calls them all:
``shape.check_tp_size`` (heads and widths), ``pipeline.analytic.check_pipeline`` (stages,
interleaving, schedule), ``context_parallel.analytic.check_cp_seq_len``,
``tensor_parallel.rules.check_sequence_parallel``, ``zero.analytic.check_zero``,
``expert_parallel.analytic.check_ep_size``, ``ParallelDims`` (ep divides dp) and ``check_attention``
below. What the mechanisms compose (a different question:
which combinations labkit's code runs) is ``labkit.parallel.compose.check_runnable``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..context_parallel.analytic import check_cp_seq_len
from ..expert_parallel.analytic import check_ep_size
from ..memory.analytic import ATTENTION, RECOMPUTE
from ..memory.fused import KERNELS
from ..pipeline.analytic import check_pipeline, default_schedule
from ..tensor_parallel.rules import check_sequence_parallel
from ..validate import ArgumentError, check_bool, check_choice, check_float, check_int
from ..zero.analytic import STAGES, check_zero
from .dims import ParallelDims

__all__ = ["RunConfig", "ATTENTION", "RECOMPUTE", "PRECISIONS", "OPTIMIZERS", "check_attention"]

# The precisions and optimizers the estimator models (labkit.estimate.training.PRECISIONS maps each
# precision to its byte counts); named here so that RunConfig validates without the estimator.
PRECISIONS = ("bf16-mixed", "fp16-mixed", "bf16-mixed-fp32-grads", "bf16-mixed-fp32-buffer", "bf16", "fp32")
OPTIMIZERS = ("adamw", "adam", "sgd_momentum", "sgd")
_INTS = ("dp_size", "tp_size", "pp_size", "cp_size", "ep_size", "micro_batch", "num_microbatches", "v")
_BOOLS = ("sequence_parallel", "offload", "offload_params", "reshard_after_forward", "overlap_grad_reduce")


def check_attention(attention: str) -> str:
    """``attention`` if it is a kernel the count models: "flash" (the (a, s, s) scores are never
    stored: FlashAttention, cuDNN's or PyTorch's fused SDPA, every run the book cites) or "eager"
    (labkit's model, whose softmax output autograd keeps, as the memory meter measures it)."""
    return check_choice("attention", attention, ATTENTION)


@dataclass(frozen=True)
class RunConfig:
    """One training run's layout and knobs; ``check(shape)`` says whether a model can run it.

    ``schedule`` None: :func:`labkit.pipeline.analytic.default_schedule` (interleaved when v > 1,
    1F1B when m >= p, else GPipe). ``seq_len`` None: the model's. ``offload``: optimizer states and
    gradients on the CPU (ZeRO-Offload); ``offload_params``: ZeRO-3's parameters too (DeepSpeed's
    ``offload_param``). ``reshard_after_forward`` False keeps ZeRO-3's gathered parameters until
    the step ends (FSDP's option: one gather a step instead of two a micro-batch, the whole
    stage's parameters held). ``kernels``: "labkit" (the activations labkit's model keeps, as the
    meter measures them) or "fused" (production fused kernels' count, ``labkit.memory.fused``).
    ``overlap_grad_reduce``: the gradient reduction runs under the
    backward (its time hidden behind compute in the step-time model). ``capacity_factor``: a MoE
    layer's experts take at most C = ceil(cf N k / E) rows each (``labkit.moe``); None: dropless.
    """

    dp_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    micro_batch: int = 1
    num_microbatches: int = 1
    seq_len: int | None = None
    v: int = 1
    schedule: str | None = None
    zero_stage: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    offload: bool = False
    offload_params: bool = False
    attention: str = "flash"
    kernels: str = "labkit"
    reshard_after_forward: bool = True
    overlap_grad_reduce: bool = False
    capacity_factor: float | None = None

    def __post_init__(self):
        for name in _INTS:
            check_int(name, getattr(self, name), 1)
        for name in _BOOLS:
            check_bool(name, getattr(self, name))
        if self.seq_len is not None:
            check_int("seq_len", self.seq_len, 1)
        if self.capacity_factor is not None:
            check_float("capacity_factor", self.capacity_factor, above=0.0)
        check_choice("recompute", self.recompute, RECOMPUTE)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("zero_stage", self.zero_stage, STAGES)
        check_attention(self.attention)
        check_choice("kernels", self.kernels, KERNELS)
        if self.schedule is None:
            object.__setattr__(self, "schedule", default_schedule(self.pp_size, self.num_microbatches, self.v))

    @property
    def dims(self) -> ParallelDims:
        """The rank grid's degrees (dp, tp, pp, cp) and ep, which lives inside dp (it divides dp_size)."""
        return ParallelDims(dp_size=self.dp_size, tp_size=self.tp_size, pp_size=self.pp_size, cp_size=self.cp_size,
                            ep_size=self.ep_size)

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp_size * self.pp_size * self.cp_size

    @property
    def replicas(self) -> int:
        """The ranks that hold the same parameters (ZeRO shards and gradients reduce over them)."""
        return self.dp_size * self.cp_size

    @property
    def global_batch(self) -> int:
        """Sequences a step: N_d x b x m."""
        return self.dp_size * self.micro_batch * self.num_microbatches

    def replace(self, **changes) -> "RunConfig":
        """A copy with ``changes``; the schedule is derived again unless given."""
        if "schedule" not in changes and {"pp_size", "num_microbatches", "v"} & set(changes):
            changes["schedule"] = None
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    def check(self, shape, seq_len: int | None = None) -> "RunConfig":
        """``self`` with ``seq_len`` resolved if ``shape`` (a ``ModelShape``) can run it, else the
        first rule's ValueError, naming the argument and what is valid."""
        s = check_int("seq_len", seq_len or self.seq_len or shape.seq_len, 1)
        if s > shape.seq_len:
            raise ArgumentError(f"seq_len={s} must be at most the model's seq_len={shape.seq_len} "
                                "(its max_position_embeddings)", "seq_len_max", seq_len=s, max_len=shape.seq_len)
        shape.check_tp_size(self.tp_size)
        check_pipeline(shape.n_layer, self.pp_size, self.num_microbatches, self.v, self.schedule)
        if self.cp_size > 1:
            check_cp_seq_len(s, self.cp_size, "zigzag")
        check_sequence_parallel(self.sequence_parallel, self.tp_size, s // self.cp_size)
        check_zero(self.zero_stage, self.replicas, offload=self.offload, offload_params=self.offload_params,
                   reshard_after_forward=self.reshard_after_forward, precision=self.precision)
        self.dims  # ParallelDims: ep divides dp_size (the expert axis is carved out of data parallelism)
        if self.capacity_factor is not None and not shape.n_experts:
            raise ValueError(f"capacity_factor={self.capacity_factor} caps experts, and this model has none: use None")
        if self.ep_size > 1:
            if not shape.n_experts:
                raise ValueError(f"ep_size={self.ep_size} shards experts, and this model has none: use ep_size=1")
            check_ep_size(self.ep_size, shape.n_experts)
        return self if self.seq_len == s else replace(self, seq_len=s)
