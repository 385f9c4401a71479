"""What labkit's mechanisms run together: :func:`check_runnable` (torch-free).

A different question from :meth:`labkit.parallel.RunConfig.check` (what a model's shapes allow):
whether :func:`labkit.parallel.parallelize_gpt` composes the techniques a run names. The table
below is the one list; ``parallelize_gpt`` refuses what it names (ZeRO-Offload, which the table
allows over data parallelism alone, runs as ``labkit.zero.OffloadOptimizer``) and the planner
(``labkit.plan.plan_training``) recommends only what passes, so a plan's memory is one the
estimate grid can measure.
"""

from __future__ import annotations

__all__ = ["NOT_COMPOSED", "runnable_reason", "refusal_key", "refusal_text", "check_runnable"]

# (a key, a test on a RunConfig, why labkit does not run it); labkit.messages renders the key in
# each language. Each entry is a combination the mechanisms
# refuse today; removing one is done by making parallelize_gpt run it and the estimate grid measure it.
NOT_COMPOSED = (
    ("cp_pp", lambda r: r.cp_size > 1 and r.pp_size > 1,
     "context parallelism with the pipeline (cp_size > 1 and pp_size > 1)"),
    ("cp_sp", lambda r: r.cp_size > 1 and r.sequence_parallel,
     "context parallelism with sequence parallelism (cp_size > 1 and sequence_parallel)"),
    ("cp_zero", lambda r: r.cp_size > 1 and r.zero_stage >= 2,
     "context parallelism with ZeRO-2/3 (cp_size > 1 and zero_stage >= 2)"),
    ("cp_recompute", lambda r: r.cp_size > 1 and r.recompute != "none",
     "context parallelism with recomputation (cp_size > 1 and recompute != 'none')"),
    ("zero3_recompute", lambda r: r.zero_stage == 3 and r.recompute != "none",
     "ZeRO-3 with recomputation (the recomputed forward would gather each unit outside ZeRO-3's forward)"),
    ("offload_stage", lambda r: r.offload and r.zero_stage != 2,
     "ZeRO-Offload at a stage other than 2 (labkit.zero.OffloadOptimizer is ZeRO-2's)"),
    ("offload_composed", lambda r: r.offload and r.tp_size * r.pp_size * r.cp_size > 1,
     "ZeRO-Offload with tensor, pipeline or context parallelism (labkit.zero.OffloadOptimizer runs over "
     "data parallelism alone)"),
    ("offload_params", lambda r: r.offload_params, "ZeRO-3's parameter offload (offload_params)"),
    ("reshard", lambda r: not r.reshard_after_forward,
     "ZeRO-3 keeping its gathered parameters from forward to backward (reshard_after_forward=False)"),
    ("ep_composed", lambda r: r.ep_size > 1 and (r.tp_size * r.pp_size * r.cp_size > 1 or r.zero_stage >= 2
                                                 or r.recompute != "none" or r.sequence_parallel),
     "expert parallelism beyond data parallelism and ZeRO-1 (ep_size > 1 with tp, pp or cp > 1, ZeRO-2/3, "
     "recomputation or sequence parallelism)"),
)


def runnable_reason(run) -> str:
    """'' if labkit's mechanisms run ``run`` together, else why not (the first combination of
    :data:`NOT_COMPOSED` it names)."""
    for _, test, why in NOT_COMPOSED:
        if test(run):
            return why
    return ""


def refusal_key(why: str) -> str:
    """The key of a reason :func:`runnable_reason` gave (for ``labkit.messages``)."""
    return next(key for key, _, text in NOT_COMPOSED if text == why)


def refusal_text(key: str) -> str:
    """The reason, in words, of a :data:`NOT_COMPOSED` key."""
    return next(text for k, _, text in NOT_COMPOSED if k == key)


def check_runnable(run) -> None:
    """Raise ValueError naming the combination if ``parallelize_gpt`` does not compose ``run``."""
    why = runnable_reason(run)
    if why:
        raise ValueError(f"labkit does not run {why} yet")
