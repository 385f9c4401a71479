"""What labkit's mechanisms run together: :func:`check_runnable` (torch-free).

A different question from :meth:`labkit.parallel.RunConfig.check` (what a model's shapes allow):
whether :func:`labkit.parallel.parallelize_gpt` composes the techniques a run names. The table
below is the one list; ``parallelize_gpt`` refuses what it names (ZeRO-Offload, which the table
allows over data parallelism alone, runs as ``labkit.zero.OffloadOptimizer``) and the planner
(``labkit.plan.plan_training``) recommends only what passes, so a plan's memory is one the
estimate grid can measure.
"""

from __future__ import annotations

__all__ = ["NOT_COMPOSED", "runnable_reason", "check_runnable"]

# (a test on a RunConfig, why labkit does not run it). Each entry is a combination the mechanisms
# refuse today; removing one is done by making parallelize_gpt run it and the estimate grid measure it.
NOT_COMPOSED = (
    (lambda r: r.offload and r.zero_stage != 2,
     "ZeRO-Offload at a stage other than 2 (labkit.zero.OffloadOptimizer is ZeRO-2's)"),
    (lambda r: r.offload and r.tp_size * r.pp_size * r.cp_size > 1,
     "ZeRO-Offload with tensor, pipeline or context parallelism (labkit.zero.OffloadOptimizer runs over "
     "data parallelism alone)"),
    (lambda r: r.offload_params, "ZeRO-3's parameter offload (offload_params)"),
    (lambda r: not r.reshard_after_forward,
     "ZeRO-3 keeping its gathered parameters from forward to backward (reshard_after_forward=False)"),
    (lambda r: r.ep_size > 1, "expert parallelism (ep_size > 1) in parallelize_gpt"),
)


def runnable_reason(run) -> str:
    """'' if labkit's mechanisms run ``run`` together, else why not (the first combination of
    :data:`NOT_COMPOSED` it names)."""
    for test, why in NOT_COMPOSED:
        if test(run):
            return why
    return ""


def check_runnable(run) -> None:
    """Raise ValueError naming the combination if ``parallelize_gpt`` does not compose ``run``."""
    why = runnable_reason(run)
    if why:
        raise ValueError(f"labkit does not run {why} yet")
