"""What labkit's mechanisms run together: :func:`check_runnable` (torch-free).

A different question from :meth:`labkit.parallel.RunConfig.check` (what a model's shapes allow):
whether :func:`labkit.parallel.parallelize_gpt` composes the techniques a run names. The table
below is the one list; ``parallelize_gpt`` refuses what it names (ZeRO-Offload, which the table
allows over data parallelism alone, runs as ``labkit.zero.OffloadOptimizer``) and the planner
(``labkit.plan.plan_training``) recommends only what passes, so a plan's memory is one the
estimate grid can measure. :func:`check_combination` and :func:`knobs_of_run` check
``parallelize_gpt``'s keywords, or a RunConfig it is given, against it.
"""

from __future__ import annotations

from ..tensor_parallel.rules import check_sequence_parallel
from .config import RunConfig

__all__ = ["NOT_COMPOSED", "experts_beyond", "runnable_reason", "refusal_key", "refusal_text", "check_runnable", "check_combination",
           "knobs_of_run"]

def experts_beyond(cp_size: int) -> list:
    """What a model with experts is run with beyond what labkit composes its experts with (data
    and expert parallelism, ZeRO-0 to 3, recomputation, tensor and sequence parallelism of the
    attention, the pipeline: all but context parallelism), each as ``name=value``; [] if nothing.
    The one home of that rule: NOT_COMPOSED's ``ep_composed`` and ``parallelize_gpt`` ask it."""
    return [f"cp_size={cp_size}"] if cp_size > 1 else []


# (a key, a test on a RunConfig and whether the model has experts, why labkit does not run it);
# labkit.messages renders the key in each language. Each entry is a combination the mechanisms
# refuse today; removing one is done by making parallelize_gpt run it and the estimate grid measure it.
NOT_COMPOSED = (
    ("offload_stage", lambda r, moe: r.offload and r.zero_stage != 2,
     "ZeRO-Offload at a stage other than 2 (labkit.zero.OffloadOptimizer is ZeRO-2's)"),
    ("offload_composed", lambda r, moe: r.offload and r.tp_size * r.pp_size * r.cp_size > 1,
     "ZeRO-Offload with tensor, pipeline or context parallelism (labkit.zero.OffloadOptimizer runs over "
     "data parallelism alone)"),
    ("offload_params", lambda r, moe: r.offload_params, "ZeRO-3's parameter offload (offload_params)"),
    ("reshard", lambda r, moe: not r.reshard_after_forward,
     "ZeRO-3 keeping its gathered parameters from forward to backward (reshard_after_forward=False)"),
    ("ep_composed", lambda r, moe: (moe or r.ep_size > 1) and bool(
        experts_beyond(r.cp_size)),
     "a mixture of experts with context parallelism (experts, or ep_size > 1, with cp > 1)"),
)


def runnable_reason(run, experts: bool = False) -> str:
    """'' if labkit's mechanisms run ``run`` together, else why not (the first combination of
    :data:`NOT_COMPOSED` it names). ``experts``: the model has a mixture of experts (which
    ``parallelize_gpt`` composes as it composes ep > 1, whatever ep_size)."""
    for _, test, why in NOT_COMPOSED:
        if test(run, experts):
            return why
    return ""


def refusal_key(why: str) -> str:
    """The key of a reason :func:`runnable_reason` gave (for ``labkit.messages``)."""
    return next(key for key, _, text in NOT_COMPOSED if text == why)


def refusal_text(key: str) -> str:
    """The reason, in words, of a :data:`NOT_COMPOSED` key."""
    return next(text for k, _, text in NOT_COMPOSED if k == key)


def check_runnable(run, experts: bool = False) -> None:
    """Raise ValueError naming the combination if ``parallelize_gpt`` does not compose ``run``
    (of a model with ``experts`` or not)."""
    why = runnable_reason(run, experts)
    if why:
        raise ValueError(f"labkit does not run {why} yet")


def check_combination(dims, sequence_parallel, zero_stage, checkpoint, schedule, num_microbatches, v,
                      seq_len: int) -> None:
    """Refuse what the techniques cannot do together: :func:`check_runnable`'s table, the one
    list (the planner reads it too), and sequence parallelism's rule: ``parallelize_gpt``'s keywords."""
    check_sequence_parallel(sequence_parallel, dims.tp_size, seq_len // dims.cp_size)
    run = RunConfig(dp_size=dims.dp_size, tp_size=dims.tp_size, pp_size=dims.pp_size, cp_size=dims.cp_size,
                    zero_stage=zero_stage, sequence_parallel=sequence_parallel, num_microbatches=num_microbatches,
                    recompute=checkpoint if checkpoint in ("none", "selective") else "full", v=v, schedule=schedule)
    why = runnable_reason(run)
    if why:
        raise ValueError(f"{dims} with zero_stage={zero_stage}, sequence_parallel={sequence_parallel}, checkpoint="
                         f"{checkpoint!r}: labkit does not run {why} yet; see labkit.parallel.compose.NOT_COMPOSED")


def knobs_of_run(run) -> tuple:
    """(dims, ``parallelize_gpt``'s keywords) of a RunConfig; refuses what a model's run cannot take."""
    check_runnable(run)
    if run.offload:
        raise ValueError("run.offload=True: ZeRO-Offload runs as labkit.zero.OffloadOptimizer over data "
                         "parallelism, not inside parallelize_gpt")
    for name, value, plain in (("precision", run.precision, "fp32"), ("attention", run.attention, "eager")):
        if value != plain:
            raise ValueError(f"run.{name}={value!r}: parallelize_gpt trains the model in the dtype it is given, "
                             f"with labkit's own attention; pass a RunConfig with {name}={plain!r}")
    checkpoint = {"none": "none", "selective": "selective", "full": "full"}[run.recompute]
    return run.dims, dict(sequence_parallel=run.sequence_parallel, zero_stage=run.zero_stage, checkpoint=checkpoint,
                          schedule=run.schedule, num_microbatches=run.num_microbatches, v=run.v)
