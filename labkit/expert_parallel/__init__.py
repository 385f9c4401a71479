"""Expert parallelism: each rank keeps E / ep of a MoE layer's experts; tokens travel to them.

``comm``: the all-to-all as an autograd Function (its backward the inverse all-to-all) and the
counts exchanged first. ``permute``: rows from (source rank, expert) order to (expert, source
rank) order and back. ``apply``: :func:`apply_expert_parallel` on labkit's GPT. ``analytic``
(no torch): experts and parameters per rank; the all-to-all bytes (the core's formula).
"""

from __future__ import annotations

from .._lazy import lazy_exports
from .analytic import all_to_all_bytes, check_ep_size, expert_params_per_rank, experts_per_rank

__all__ = ["apply_expert_parallel", "ExpertParallelExchange", "check_ep_size", "all_to_all", "exchange_counts",
           "expert_major_order", "inverse_permutation", "experts_per_rank", "expert_params_per_rank",
           "all_to_all_bytes"]

__getattr__, __dir__ = lazy_exports(__name__, {
    ".apply": ("apply_expert_parallel", "ExpertParallelExchange"),
    ".comm": ("all_to_all", "exchange_counts"),
    ".permute": ("expert_major_order", "inverse_permutation"),
})
