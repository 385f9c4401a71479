"""What a mixture-of-experts layer should cost: capacity, parameters, FLOPs, all-to-all bytes.

Torch-free (the calculators run it in a browser). The symbols: N tokens, E routed experts, k
experts per token (top-k), h = d_model, f = an expert's width (``d_expert``), S shared experts
of width f_s, b bytes an element. Capacity: Lepikhin et al. 2021 (GShard) and Fedus et al. 2022
(Switch), rounded up as Megatron-LM's ``get_capacity`` does. Parameters: the shape's own counts
(:meth:`labkit.shapes.ModelShape.num_params`, ``active_params``), so each formula exists once.
"""

from __future__ import annotations

import math

from ..shapes import ModelShape
from ..validate import check_bool, check_float, check_int

__all__ = ["expert_capacity", "param_counts", "moe_flops_per_token", "training_step_flops", "dispatched_rows",
           "all_to_all_bytes"]


def expert_capacity(tokens: int, n_experts: int, experts_per_token: int, capacity_factor: float) -> int:
    """Rows an expert takes at most: C = ceil(capacity_factor · N k / E).

    Rounded up, not down, so that capacity_factor=1 with perfectly balanced routing drops no
    token even when N k / E is not an integer (floor would drop one per expert); Megatron-LM's
    ``get_capacity`` rounds up too.
    """
    check_int("tokens", tokens, 0)
    e = check_int("n_experts", n_experts, 1)
    k = check_int("experts_per_token", experts_per_token, 1, e)
    cf = check_float("capacity_factor", capacity_factor, above=0.0)
    return math.ceil(cf * tokens * k / e)


def _moe_shape(shape) -> ModelShape:
    if not isinstance(shape, ModelShape):
        shape = ModelShape.from_config(shape)  # a GPTConfig, or anything with its field names
    if not shape.n_experts:
        raise ValueError(f"n_experts={shape.n_experts}: this shape has no experts (a dense model)")
    return shape


def param_counts(shape) -> tuple[int, int]:
    """(total, active) parameters: Ψ, and Ψ less the E - k routed experts a token does not pass
    through in each MoE layer (:meth:`ModelShape.active_params`)."""
    shape = _moe_shape(shape)
    return shape.num_params(), shape.active_params()


def moe_flops_per_token(shape, kept_fraction: float = 1.0) -> int | float:
    """Forward matmul FLOPs one token spends in one MoE layer: 2 h E (the router) + 2 · 3 h f · k
    (its k SwiGLU experts) + 2 · 3 h f_s · S (the shared experts). ``kept_fraction``: the share of
    the N k assignments the capacity kept (1 when dropless); the expert term scales with it."""
    shape = _moe_shape(shape)
    kept = check_float("kept_fraction", kept_fraction, 0.0, 1.0)
    h, e, k = shape.d_model, shape.n_experts, shape.experts_per_token
    routed = 2 * 3 * h * shape.expert_dim * k
    shared = 2 * 3 * h * shape.shared_dim * shape.n_shared_experts
    return 2 * h * e + (routed if kept == 1.0 else routed * kept) + shared


def training_step_flops(shape, global_batch: int, recompute: bool = False) -> int:
    """Matmul FLOPs of a training step of a dense or MoE model (``ShapeProperties.step_flops``),
    each MoE layer's MLP counted as :func:`moe_flops_per_token` (dropless): FLOPs follow the
    active parameters, so MFU is right for a mixture of experts."""
    if not getattr(shape, "n_experts", 0):
        return shape.step_flops(global_batch, recompute)
    moe = _moe_shape(shape)
    layers = sum(1 for i in range(moe.n_layer) if moe.is_moe_layer(i))
    return shape.step_flops(global_batch, recompute, moe_layers=layers, moe_token_flops=moe_flops_per_token(moe))


def dispatched_rows(tokens: int, experts_per_token: int, dropped: int = 0) -> int:
    """Rows one rank's dispatch sends (its own experts' share included): N k less the dropped."""
    check_int("tokens", tokens, 0)
    check_int("experts_per_token", experts_per_token, 1)
    rows = tokens * experts_per_token
    return rows - check_int("dropped", dropped, 0, rows)


def all_to_all_bytes(rows: int, d_model: int, n_experts: int, ep_size: int, dtype_bytes: int = 4, *,
                     backward: bool = True) -> int:
    """Bytes an expert-parallel group's ranks send, summed over them, for one MoE layer's step.

    ``rows``: Σ over the group's ranks of the rows each dispatches (:func:`dispatched_rows`).
    Forward: the dispatch sends ``rows`` rows of h elements, the combine sends them back (2 rows h b),
    and each rank first sends its E counts as int64 (ep · 8 E). Backward: the inverse all-to-alls,
    2 rows h b again, and no counts. A rank's own experts' rows are in its buffers; on average a
    fraction (ep - 1) / ep of the rows leaves the rank under uniform routing.
    """
    check_int("rows", rows, 0)
    check_int("d_model", d_model, 1)
    check_int("n_experts", n_experts, 1)
    check_int("ep_size", ep_size, 1)
    check_int("dtype_bytes", dtype_bytes, 1)
    check_bool("backward", backward)
    rows_bytes = 2 * rows * d_model * dtype_bytes
    return rows_bytes * (2 if backward else 1) + ep_size * 8 * n_experts
