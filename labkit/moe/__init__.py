"""Mixture of experts: a router, SwiGLU experts, shared experts, capacity.

``router``: top-k gating (softmax or sigmoid, renormalised or not, scaled), token dropping by
capacity in GShard's order, Switch's load-balancing loss, DeepSeek-V3's bias update. ``layer``:
:class:`MoE`, the block's MLP when a GPTConfig has experts (the model builds it: this package is
part of the core, like ``attention``), and its stacked :class:`Experts`. ``analytic`` (no torch):
capacity, parameters total and active, FLOPs per token, all-to-all bytes.

The formulas load at once; the torch side on first use (:mod:`labkit._lazy`).
"""

from __future__ import annotations

from .._lazy import lazy_exports
from .analytic import (all_to_all_bytes, dispatched_rows, expert_capacity, moe_flops_per_token, param_counts,
                       training_step_flops)

__all__ = [
    "expert_capacity", "param_counts", "moe_flops_per_token", "training_step_flops", "dispatched_rows",
    "all_to_all_bytes",
    "SCORES", "route", "keep_mask", "load_balancing_loss", "update_bias",
    "Experts", "LocalExchange", "MoE", "check_moe_config", "moe_layers", "update_expert_bias",
]

__getattr__, __dir__ = lazy_exports(__name__, {
    ".router": ("SCORES", "route", "keep_mask", "load_balancing_loss", "update_bias"),
    ".layer": ("Experts", "LocalExchange", "MoE", "check_moe_config", "moe_layers", "update_expert_bias"),
})
