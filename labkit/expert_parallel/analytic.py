"""What expert parallelism should cost, per rank: experts and their parameters kept.

Torch-free. The all-to-all bytes are the mixture-of-experts layer's own formula
(:func:`labkit.moe.analytic.all_to_all_bytes`, written once, in the core).
"""

from __future__ import annotations

from ..moe.analytic import all_to_all_bytes
from ..shapes import ModelShape
from ..validate import ArgumentError, check_int

__all__ = ["check_ep_size", "experts_per_rank", "expert_params_per_rank", "all_to_all_bytes"]


def check_ep_size(ep_size: int, n_experts: int) -> int:
    """Raise unless ``ep_size`` divides ``n_experts``: each rank keeps E / ep whole experts."""
    check_int("ep_size", ep_size, 1)
    check_int("n_experts", n_experts, 1)
    if n_experts % ep_size:
        raise ArgumentError(f"ep_size={ep_size} must divide n_experts={n_experts}")
    return ep_size


def experts_per_rank(n_experts: int, ep_size: int) -> int:
    """E / ep: the routed experts one rank keeps in each MoE layer (ep must divide E)."""
    check_int("n_experts", n_experts, 1)
    return n_experts // check_ep_size(ep_size, n_experts)


def expert_params_per_rank(shape, ep_size: int) -> int:
    """Routed-expert parameters one rank keeps: MoE layers · E / ep · 3 h f."""
    shape = shape if isinstance(shape, ModelShape) else ModelShape.from_config(shape)
    layers = sum(1 for i in range(shape.n_layer) if shape.is_moe_layer(i))
    return layers * experts_per_rank(shape.n_experts, ep_size) * shape.expert_params()
