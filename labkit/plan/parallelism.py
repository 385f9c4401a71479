"""Chapter 6's planner, a special case of :func:`labkit.plan.plan_training`.

``plan_parallelism(cfg, gpu, n_gpus, gpus_per_node, global_batch)`` weighs what Chapter 6 does:
ZeRO 0 and 1, stages of equal layer counts, v from 1 to 8, no context parallelism, and returns its :class:`Plan` s, the
chapter's names (t, p, dp, zero); memory and step time are ``plan_training``'s (the estimator
and :mod:`labkit.plan.steptime`). ``plan_memory``: one configuration's (model-state bytes,
activation bytes) per GPU of the most loaded stage, from ``labkit.estimate.training_memory``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..estimate import training_memory
from ..hardware import get_gpu
from ..memory.analytic import RECOMPUTE
from ..shapes import ModelShape
from ..validate import check_choice, check_float, check_int, check_positive
from ..parallel.config import RunConfig
from .planner import plan_training

__all__ = ["Plan", "NoPlanFits", "plan_parallelism", "plan_memory", "RECOMPUTE"]

_ZERO_STAGES = (0, 1, 2)  # the stages Chapter 6's planner may weigh (0 and 1 by default)


@dataclass(frozen=True)
class Plan:
    t: int
    p: int
    dp: int                  # N_d
    micro_batch: int         # b
    num_microbatches: int    # m, per pipeline per step
    zero: int
    recompute: str
    sequence_parallel: bool
    states_bytes: float      # per GPU, the most loaded stage
    activation_bytes: float  # per GPU: activations kept and the transient peaks above them
    bubble: float
    comm_bytes: dict         # per GPU per step: {"tensor", "pipeline", "data"}
    step_time_s: float
    mfu: float
    fits: bool
    v: int = 1               # model chunks a rank holds: 1, or the interleaved schedule's v
    schedule: str = "1f1b"
    run: object = None       # the labkit.parallel.RunConfig these fields name

    @property
    def memory_bytes(self) -> float:
        return self.states_bytes + self.activation_bytes


class NoPlanFits(ValueError):
    """No configuration fits: ``closest`` is the plan with the least memory (None when no
    configuration exists at all), and the message names the term that overflowed."""

    def __init__(self, message: str, closest=None):
        super().__init__(message)
        self.closest = closest


def _plan(pl) -> Plan:
    """Chapter 6's names for a ``TrainingPlan`` (its ``run``, memory and step)."""
    mem, run = pl.memory, pl.run
    return Plan(run.tp_size, run.pp_size, run.dp_size, run.micro_batch, run.num_microbatches, run.zero_stage,
                run.recompute, run.sequence_parallel, mem.params + mem.grads + mem.optimizer,
                mem.activations + mem.transient, pl.step.bubble, pl.step.comm_bytes, pl.step_time_s, pl.mfu,
                pl.fits, run.v, run.schedule, run)


def plan_memory(cfg, t: int, p: int, dp: int, micro_batch: int, num_microbatches: int, zero: int = 0,
                recompute: str = "full", sequence_parallel: bool = False, v: int = 1) -> tuple[int, int]:
    """(model-state bytes, activation bytes kept) per GPU of the most loaded stage (the transient
    peaks above them left out); ``v`` > 1: the interleaved schedule with v chunks a rank."""
    check_choice("zero", zero, _ZERO_STAGES)
    shape = ModelShape.from_config(cfg)
    if cfg.n_layer % check_int("p", p, 1):
        raise ValueError(f"p={p} must divide n_layer={cfg.n_layer} (stages of equal layer count)")
    for name, value in (("t", t), ("dp", dp)):
        check_int(name, value, 1)
    run = RunConfig(dp_size=dp, tp_size=t, pp_size=p, micro_batch=micro_batch, num_microbatches=num_microbatches,
                    v=v, zero_stage=zero, recompute=recompute, sequence_parallel=sequence_parallel,
                    attention="eager", seq_len=cfg.seq_len)
    try:
        mem = training_memory(shape, run)
    except ValueError as err:  # the rules name labkit's arguments; say them in Chapter 6's names
        message = str(err)
        for name, short in (("tp_size=", "t="), ("pp_size=", "p="), ("dp_size=", "dp="), ("zero_stage=", "zero=")):
            message = message.replace(name, short)
        raise ValueError(message) from None
    return mem.params + mem.grads + mem.optimizer, mem.activations


def plan_parallelism(cfg, gpu, n_gpus: int, gpus_per_node: int, global_batch: int, *,
                     dtype: str = "bf16", efficiency: float = 0.5, network_gbps: float = 25.0,
                     nvlink_gbps: float | None = None, micro_batches=(1, 2, 4, 8), zero_stages=(0, 1),
                     recompute=RECOMPUTE, sequence_parallel=(False, True), interleave=None,
                     memory_fraction: float = 0.9, include_infeasible: bool = False,
                     attention: str = "eager") -> list[Plan]:
    """Every (t, p, N_d, b, v, ZeRO, recomputation) that fits, fastest estimated step first;
    raises :class:`NoPlanFits` (a ValueError) naming the term that overflowed when none does.

    :func:`labkit.plan.plan_training` with p dividing n_layer, ``interleave`` v from 1 to 8 by
    default, and ``zero_stages`` (0, 1); the other arguments are its own, under Chapter 6's names.
    ``attention`` "eager" by default: labkit's model, whose memory Lab 6 measures (and
    :func:`plan_memory` counts).
    """
    check_int("n_gpus", n_gpus, 1)
    check_float("efficiency", efficiency, maximum=1.0, above=0.0)  # a share of the dense peak
    check_float("memory_fraction", memory_fraction, maximum=1.0, above=0.0)
    check_positive("network_gbps", network_gbps)
    for x in zero_stages:
        check_choice("zero_stages", x, _ZERO_STAGES)
    for x in sequence_parallel:
        check_choice("sequence_parallel", x, (False, True))
    for x in (() if interleave is None else interleave):
        try:
            check_int("interleave", x, 1)
        except ValueError as err:
            raise ValueError(f"interleave={tuple(interleave)!r}: {err}") from None
    found = plan_training(ModelShape.from_config(cfg), gpu=gpu, num_gpus=n_gpus, gpus_per_node=gpus_per_node,
                          seq_len=cfg.seq_len, global_batch=global_batch, micro_batches=micro_batches,
                          zero_stages=zero_stages, recompute=recompute, sequence_parallel=sequence_parallel,
                          interleave=tuple(range(1, 9)) if interleave is None else tuple(interleave),
                          dtype=dtype, efficiency=efficiency, network_gbps=network_gbps, nvlink_gbps=nvlink_gbps,
                          memory_fraction=memory_fraction, even_stages=True, include_infeasible=True,
                          context_parallel=(1,), attention=attention)
    plans = [_plan(pl) for pl in found.plans]
    fitting = plans if include_infeasible else [pl for pl in plans if pl.fits]
    if not fitting:
        raise _no_plan(plans, get_gpu(gpu), n_gpus, global_batch, memory_fraction)
    return sorted(fitting, key=lambda pl: (pl.step_time_s, pl.memory_bytes))


def _no_plan(plans, g, n_gpus, global_batch, memory_fraction) -> NoPlanFits:
    """Why nothing fits: no configuration at all, or the term of the leanest plan that overflows."""
    limit = memory_fraction * g.memory_bytes
    if not plans:
        return NoPlanFits(f"no (t, p, N_d, b) splits n_gpus={n_gpus} and global_batch={global_batch}: "
                          "t must divide n_head and gpus_per_node, p n_layer, N_d b the global batch")
    best = min(plans, key=lambda pl: pl.memory_bytes)
    where = (f"(leanest plan: t={best.t}, p={best.p}, N_d={best.dp}, b={best.micro_batch}, ZeRO-{best.zero}, "
             f"recompute={best.recompute!r})")
    if best.states_bytes > limit:
        term = f"model states alone need {best.states_bytes / 1e9:.1f} GB per GPU"
    else:
        term = (f"activations need {best.activation_bytes / 1e9:.1f} GB on top of "
                f"{best.states_bytes / 1e9:.1f} GB of model states")
    return NoPlanFits(f"no plan fits on {n_gpus} x {g.name}: {term} {where}, over "
                      f"memory_fraction={memory_fraction:g} of {g.memory_bytes / 1e9:.1f} GB = "
                      f"{limit / 1e9:.1f} GB", best)
