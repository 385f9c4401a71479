"""Plan a training run: every (t, cp, p, v, N_d, ep, ZeRO, recomputation, b, m) that fits, fastest first.
Memory per GPU is ``labkit.estimate.training_memory`` (the most loaded rank); a plan fits when
its total is at most ``memory_fraction`` of the GPU's memory (nvidia-smi's total). Step time and
MFU are :mod:`labkit.plan.steptime`'s model. A *layout* (t, cp, p, N_d) where no configuration fits
is reported with the term that overflowed in its leanest configuration: adding the terms in the
order params, grads, optimizer, activations, transient, the first that passes the limit, with
the total so far ("activations: 91.2 GB of 77.3 GB").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..estimate import OPTIMIZERS, PRECISIONS, as_shape, check_trainable
from ..hardware import get_gpu, peak_flops
from ..memory.analytic import ATTENTION
from ..messages import current, say, training_reason
from ..parallel.compose import refusal_key, runnable_reason
from ..parallel.config import RunConfig
from ..validate import ArgumentError, check_bool, check_choice, check_float, check_int, check_positive
from ..zero.analytic import zero_allowed
from .sweep import (check_ep_degrees, cp_degrees, ep_degrees, flops_of, layouts, mla_cp_degrees, pipeline_choices,
                    training_memory)
from .steptime import StepTime, step_flops, step_time

__all__ = ["TrainingPlan", "TrainingPlans", "Overflow", "overflow_term", "plan_training", "RECOMPUTE", "TERMS"]

RECOMPUTE = ("none", "selective", "full")
TERMS = ("params", "grads", "optimizer", "activations", "transient", "non_torch")


@dataclass(frozen=True)
class TrainingPlan:
    """One configuration: ``run`` (a ``labkit.parallel.RunConfig``), the per-GPU memory (a
    ``MemoryEstimate``), the step (a ``StepTime``) and the memory limit it was judged against. The
    run's fields read through (``plan.tp_size`` is ``plan.run.tp_size``)."""

    run: RunConfig
    memory: object
    step: StepTime
    limit_bytes: int
    unrunnable: str = ""  # why labkit's mechanisms do not run it ("": they do); --include-unrunnable

    def __getattr__(self, name):
        if name in RunConfig.__dataclass_fields__:
            return getattr(self.run, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.limit_bytes

    @property
    def step_time_s(self) -> float:
        return self.step.total_s

    @property
    def mfu(self) -> float:
        return self.step.mfu

    def to_dict(self) -> dict:
        return {**self.run.to_dict(), "memory": self.memory.to_dict(), "step": self.step.to_dict(),
                "limit_bytes": self.limit_bytes, "step_time_s": self.step_time_s, "mfu": self.mfu,
                "unrunnable": self.unrunnable}


class Overflow(NamedTuple):
    """A layout where nothing fits: its leanest configuration, and the term that overflowed."""

    tp_size: int
    pp_size: int
    dp_size: int
    cp_size: int
    term: str
    bytes_so_far: int
    limit_bytes: int
    leanest: TrainingPlan

    @property
    def message(self) -> str:
        """The term that passed the limit, in the language labkit prints in."""
        return say("plan.overflow", term=self.term, bytes_so_far=self.bytes_so_far, limit_bytes=self.limit_bytes)

    def to_dict(self) -> dict:
        return {"tp_size": self.tp_size, "pp_size": self.pp_size, "dp_size": self.dp_size,
                "cp_size": self.cp_size, "term": self.term, "bytes_so_far": self.bytes_so_far,
                "limit_bytes": self.limit_bytes, "message": self.message, "leanest": self.leanest.to_dict()}


class TrainingPlans(NamedTuple):
    """What :func:`plan_training` found: ``plans`` that fit, best first; ``overflows``, one per
    layout where none does; ``considered``: how many configurations the sweep sized; ``refused``:
    those it did not size because labkit's mechanisms do not run them, by reason."""

    plans: list
    overflows: list
    considered: int
    refused: dict = {}  # configurations labkit does not run, by labkit.parallel.compose's key

    def refused_reasons(self) -> dict:
        """``refused`` with each key's reason in words, most configurations first."""
        return {say(f"refused.{k}"): n for k, n in sorted(self.refused.items(), key=lambda kv: (-kv[1], kv[0]))}

    def to_dict(self) -> dict:
        return {"plans": [p.to_dict() for p in self.plans], "overflows": [o.to_dict() for o in self.overflows],
                "considered": self.considered, "refused": dict(self.refused)}

    def reason(self) -> str:
        """Why nothing fits: each layout's overflow, the closest first; or what labkit does not run
        (``labkit.messages.training_reason``, in the language labkit prints in)."""
        return training_reason(self.overflows, current(), self.refused)


def overflow_term(memory, limit: int) -> tuple[str, int]:
    """(the first term whose running total passes ``limit``, that total); ('', total) if none."""
    total = 0
    for term in TERMS:
        total += getattr(memory, term)
        if total > limit:
            return term, total
    return "", total


def _check(num_gpus, gpus_per_node, seq_len, global_batch, efficiency, memory_fraction,
           micro_batches, zero_stages, recompute, sequence_parallel, interleave, offload):
    for name, value in (("num_gpus", num_gpus), ("gpus_per_node", gpus_per_node), ("seq_len", seq_len),
                        ("global_batch", global_batch)):
        check_int(name, value, 1)
    check_float("efficiency", efficiency, maximum=1.0, above=0.0)
    check_float("memory_fraction", memory_fraction, maximum=1.0, above=0.0)
    for name, values, valid in (("micro_batches", micro_batches, None), ("interleave", interleave, None),
                                ("zero_stages", zero_stages, (0, 1, 2, 3)), ("recompute", recompute, RECOMPUTE),
                                ("sequence_parallel", sequence_parallel, None), ("offload", offload, None)):
        if not tuple(values):
            raise ValueError(f"{name}=() must hold at least one choice")
        for x in values:
            if name in ("sequence_parallel", "offload"):
                check_bool(name, x)
            elif valid is None:
                check_int(name, x, 1)
            else:
                check_choice(name, x, valid)


def _check_options(*, precision, optimizer, attention, nvlink_gbps, network_gbps, **flags) -> None:
    check_choice("precision", precision, tuple(PRECISIONS))
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_choice("attention", attention, ATTENTION)
    for name, value in flags.items():
        check_bool(name, value)
    for name, value in (("nvlink_gbps", nvlink_gbps), ("network_gbps", network_gbps)):
        if value is not None:
            check_positive(name, value)


def _peak_dtype(g, precision: str) -> str:
    """The dtype whose dense peak MFU is taken against: the precision's half type; for fp32, bf16
    (or fp16 on a GPU without bf16), as before. A bf16 precision needs a bf16 peak on ``g``."""
    half = precision[:4]
    if half in ("bf16", "fp16"):
        if half not in g.peak:
            valid = [p for p in PRECISIONS if p[:4] not in ("bf16", "fp16") or p[:4] in g.peak]
            raise ArgumentError(f"precision={precision!r} computes in {half}, which {g.name} has no peak for "
                                f"(no {half} tensor cores); valid on {g.name}: {', '.join(valid)}", "no_peak",
                                precision=precision, half=half, gpu=g.name, valid=valid)
        return half
    return "bf16" if "bf16" in g.peak else "fp16"


def plan_training(shape, *, gpu, num_gpus: int, gpus_per_node: int = 8, seq_len: int, global_batch: int,
                  micro_batches=(1, 2, 4, 8), zero_stages=(0, 1, 2, 3), recompute=RECOMPUTE,
                  sequence_parallel=(False, True), interleave=(1, 2, 4), offload=(False,),
                  dtype: str | None = None, precision: str = "bf16-mixed", optimizer: str = "adamw",
                  efficiency: float = 0.5, network_gbps: float | None = None, nvlink_gbps: float | None = None,
                  memory_fraction: float = 0.9, even_stages: bool = False,
                  include_infeasible: bool = False, context_parallel=None, stepwise: bool = False,
                  attention: str = "flash", overlap_grad_reduce: bool = False,
                  include_unrunnable: bool = False, expert_parallel=None) -> TrainingPlans:
    """Every configuration of ``shape`` on ``num_gpus`` x ``gpu`` that fits, fastest first.

    Each is a ``labkit.parallel.RunConfig`` that passes ``RunConfig.check(shape)`` (t divides the
    heads and widths and ``gpus_per_node``; p <= n_layer; v > 1 where interleaving runs) and that
    labkit's mechanisms run together (``labkit.parallel.compose``: ``include_unrunnable`` keeps the
    others too, each plan's ``unrunnable`` saying why not); t cp p N_d = num_gpus; N_d b divides
    ``global_batch`` (m = global_batch / (N_d b)). ``offload``: (False,), or (False, True) to weigh
    ZeRO-Offload too (ZeRO-2 on one replica). ``shape``: a ``ModelShape``, a preset's name, a
    ``GPTConfig`` or a config.json dict. ``network_gbps``: GB/s per GPU between nodes, one
    direction (None: the GPU's reference cluster, ``labkit.hardware.GPU.network_gbps``);
    ``nvlink_gbps``: inside a node (default half the table's total); ``dtype``: the peak MFU is
    taken against (default: the precision's); ``attention``: "flash" (default) or "eager";
    ``overlap_grad_reduce``: the gradient reduction hides under the backward; ``even_stages``: p
    (and v p) divide n_layer; ``include_infeasible``: ``plans`` keeps what does not fit too. Step time:
    :mod:`labkit.plan.steptime`.

    ``context_parallel``: the cp degrees to weigh (ring attention, zigzag layout), a tuple such as
    (1, 2, 4); ``None``: :func:`labkit.plan.sweep.cp_degrees`. Ranks sit in
    ``labkit.parallel.ParallelDims.AXES`` order (dp, pp, cp, tp), so a cp group spans t cp
    consecutive ranks. ``expert_parallel``: the ep degrees to weigh for a model with experts, a
    tuple such as (1, 8) (None: every one dividing N_d and E, :func:`labkit.plan.sweep.ep_degrees`).
    ``stepwise``: a generator yielding ``(layouts done, layouts, None)`` and then
    ``(n, n, TrainingPlans)`` (a page's calculator gives the browser its turn between steps).
    """
    g, shape = get_gpu(gpu), check_trainable(as_shape(shape))
    _check(num_gpus, gpus_per_node, seq_len, global_batch, efficiency, memory_fraction,
           micro_batches, zero_stages, recompute, sequence_parallel, interleave, offload)
    _check_options(precision=precision, optimizer=optimizer, attention=attention, even_stages=even_stages,
                   include_infeasible=include_infeasible, stepwise=stepwise, overlap_grad_reduce=overlap_grad_reduce,
                   include_unrunnable=include_unrunnable, nvlink_gbps=nvlink_gbps, network_gbps=network_gbps)
    cps = mla_cp_degrees(shape, cp_degrees(seq_len, num_gpus, context_parallel), context_parallel)
    shape = shape.replace(seq_len=seq_len) if shape.seq_len != seq_len else shape
    base = RunConfig(seq_len=seq_len, precision=precision, optimizer=optimizer, attention=attention,
                     overlap_grad_reduce=overlap_grad_reduce)
    ctx = dict(shape=shape, base=base, num_gpus=num_gpus, gpus_per_node=gpus_per_node, global_batch=global_batch,
               peak=peak_flops(g, dtype or _peak_dtype(g, precision)), efficiency=efficiency,
               nvlink_gbps=g.link_gbps / 2 if nvlink_gbps is None else nvlink_gbps,
               network_gbps=g.network_gbps if network_gbps is None else network_gbps,
               limit=int(memory_fraction * g.memory_bytes), unrunnable=include_unrunnable, even_stages=even_stages,
               expert_parallel=None if expert_parallel is None else check_ep_degrees(shape, expert_parallel),
               flops={rc: step_flops(flops_of, shape, global_batch, rc) for rc in recompute})
    grid = [(t, cp, p, dp) for cp in cps for t, p, dp in layouts(shape, num_gpus // cp, gpus_per_node, even_stages)]
    steps = _sweep(ctx, grid, dict(micro_batches=micro_batches, interleave=interleave, zero_stages=zero_stages,
                                   recompute=recompute, sequence_parallel=sequence_parallel, offload=offload),
                   include_infeasible)
    if stepwise:
        return steps
    for _, _, found in steps:
        pass
    return found


def _sweep(ctx, grid, choices, include_infeasible):
    """Size each layout of ``grid`` in turn, yielding ``(layouts done, len(grid), None)`` after each
    configuration, then the plans."""
    plans, overflows, considered, refused = [], [], 0, {}
    for i, (t, cp, p, dp) in enumerate(grid):
        found = []
        for plan in _layout_plans(ctx, t, cp, p, dp, refused, **choices):
            found.append(plan)
            yield i, len(grid), None
        considered += len(found)
        fitting = [pl for pl in found if pl.fits]
        plans += found if include_infeasible else fitting
        if found and not fitting:
            leanest = min(found, key=lambda pl: pl.memory.total)
            term, so_far = overflow_term(leanest.memory, ctx["limit"])
            overflows.append(Overflow(t, p, dp, cp, term, so_far, ctx["limit"], leanest))
        yield i + 1, len(grid), None
    plans.sort(key=lambda pl: (pl.step_time_s, pl.memory.total))
    yield len(grid), len(grid), TrainingPlans(plans, overflows, considered, refused)


def _zero_choices(zero_stages, offload, replicas: int):
    """(ZeRO stage, offload) pairs worth sizing: ZeRO shards over replicas > 1 (stage 0 on one);
    offloading needs a stage >= 1 (ZeRO-Offload; on one replica one such stage, ZeRO-2 first)."""
    for off in offload:
        if replicas > 1:
            yield from ((z, off) for z in zero_stages if z >= 1 or not off)
        elif not off:
            yield 0, False
        else:
            lone = [z for z in (2, 1, 3) if z in zero_stages]
            if lone:
                yield lone[0], True


def _layout_plans(ctx, t, cp, p, dp, refused, *, micro_batches, interleave, zero_stages, recompute,
                  sequence_parallel, offload):
    """Yield every configuration of one layout (t, cp, p, N_d) that the shape allows (RunConfig.check)
    and, unless asked, that labkit runs (``refused`` counts the others by reason)."""
    shape = ctx["shape"]
    for b, m, v, schedule in pipeline_choices(shape, p, dp, ctx["global_batch"], micro_batches, interleave,
                                              ctx["even_stages"]):
        for rc, sp, ep in ((rc, sp, ep) for rc in recompute for sp in sequence_parallel
                           for ep in ep_degrees(shape, dp, ctx["expert_parallel"])
                           if not (sp and (t == 1 or shape.seq_len % (t * cp)))):
            degrees = dict(tp_size=t, cp_size=cp, pp_size=p, dp_size=dp, ep_size=ep)
            for z, off in _zero_choices(zero_stages, offload, dp * cp):
                if not zero_allowed(z, dp * cp, off, ctx["base"].precision):
                    continue
                run = ctx["base"].replace(**degrees, micro_batch=b, num_microbatches=m, v=v, schedule=schedule,
                                          recompute=rc, sequence_parallel=sp, zero_stage=z, offload=off)
                why = runnable_reason(run, bool(shape.n_experts))
                if why and not ctx["unrunnable"]:
                    key = refusal_key(why)
                    refused[key] = refused.get(key, 0) + 1
                    continue
                yield _size(ctx, run, why)


def _size(ctx, run, why: str = "") -> TrainingPlan:
    shape = ctx["shape"]
    mem = training_memory(shape, run)
    step = step_time(run, shape, num_gpus=ctx["num_gpus"], gpus_per_node=ctx["gpus_per_node"], peak=ctx["peak"],
                     efficiency=ctx["efficiency"], nvlink_gbps=ctx["nvlink_gbps"], network_gbps=ctx["network_gbps"],
                     flops=ctx["flops"][run.recompute])
    return TrainingPlan(run, mem, step, ctx["limit"], why)
