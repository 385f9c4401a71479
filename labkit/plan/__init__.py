"""Plan a run from the estimator (Chapter 9): which t, p, v, N_d, ZeRO stage, recomputation,
micro-batch and accumulation fit a model on a cluster, and how many requests a GPU serves.

``plan_training`` sweeps the configurations of a training run, sizes each with
``labkit.estimate.training_memory`` and ranks those that fit by the step-time model of
``steptime``; ``plan_serving`` sizes the KV cache for each tensor-parallel degree with
``labkit.estimate.serving_memory``; ``plan_parallelism`` is Chapter 6's planner, a special case
of ``plan_training`` (``parallelism``). Imports no torch: the same code runs in a browser page.
``labkit.plan.export`` writes a plan as an engine's configuration (DeepSpeed, Megatron-LM,
torchtitan, accelerate, FSDP2, vLLM). ``python -m labkit.plan`` is the command line (``cli``).
"""

from .parallelism import NoPlanFits, Plan, plan_memory, plan_parallelism
from .planner import RECOMPUTE, TERMS, Overflow, TrainingPlan, TrainingPlans, overflow_term, plan_training
from .serving import ServingPlan, ServingPlans, plan_serving
from .steptime import StepTime, step_flops, step_time

__all__ = ["plan_training", "TrainingPlan", "TrainingPlans", "Overflow", "overflow_term", "RECOMPUTE", "TERMS",
           "plan_serving", "ServingPlan", "ServingPlans", "StepTime", "step_time", "step_flops",
           "plan_parallelism", "plan_memory", "Plan", "NoPlanFits"]
