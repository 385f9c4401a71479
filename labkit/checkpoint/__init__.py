"""Activation checkpointing (Chapter 3): recompute in backward what the forward did not keep.

``function``: the mechanism from scratch (:class:`CheckpointFunction`) and torch's as reference;
``plan``: :class:`Plan` and the named policies; ``policies``: :func:`apply_checkpointing`; ``analytic``: the bytes each plan keeps and
the FLOPs it recomputes; ``planner``: the plan with the least recomputation under a budget.
"""

from .function import CheckpointFunction, RNGState, checkpoint_scratch, checkpoint_torch
from .plan import MODES, POLICIES, Plan, make_plan
from .policies import IMPLS, apply_checkpointing, remove_checkpointing
from .analytic import (BlockBytes, CheckpointBytes, block_bytes, block_forward_flops,
                       checkpoint_activation_bytes, core_forward_flops, recompute_flops)
from .planner import min_peak_plan, plan_for_budget

__all__ = ["CheckpointFunction", "RNGState", "checkpoint_scratch", "checkpoint_torch", "MODES", "POLICIES",
           "Plan", "make_plan", "IMPLS", "apply_checkpointing", "remove_checkpointing", "BlockBytes",
           "CheckpointBytes", "block_bytes", "block_forward_flops", "checkpoint_activation_bytes",
           "core_forward_flops", "recompute_flops", "min_peak_plan", "plan_for_budget"]
