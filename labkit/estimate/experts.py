"""What labkit's mixture-of-experts block holds per rank in training: weights and activations.

Torch-free. Model states: a rank keeps its stage's non-expert weights and E / ep of each MoE
layer's routed experts (``labkit.expert_parallel.experts_per_rank``); ZeRO shards the first over
the dp x cp replicas, the experts over the dp / ep of them that hold the same experts (as
``labkit.parallel.ExpertShardedOptimizer`` does). DeepSeek-V3's selection bias is a buffer in
labkit's model (no gradient, no optimizer state): not counted, E elements a MoE layer.
Activations: what ``labkit.moe.MoE`` keeps for backward, term by term (:func:`moe_layer_bytes`).
"""

from __future__ import annotations

from functools import lru_cache

from ..expert_parallel.analytic import experts_per_rank
from ..moe.analytic import dispatched_rows, expert_capacity
from ..validate import ArgumentError, check_int
from ..zero.analytic import zero_model_state_bytes as _zero_states

__all__ = ["moe_layer_bytes", "dispatched_rows_bound", "rank_params", "rank_layer_params", "check_experts_trainable",
           "rank_model_states", "zero_model_state_bytes", "INDEX_BYTES"]

INDEX_BYTES = 8  # torch's int64 indices
# A planner's sweep sizes the same model states again and again: kept.
zero_model_state_bytes = lru_cache(maxsize=8192)(_zero_states)
DENSE_MLP = "SwiGLU gate, SiLU, up, product (4 sbf e / t)"  # labkit.memory.analytic.llama_layer_bytes's term


def check_experts_trainable(shape, run) -> None:
    """Refuse by name what the estimate of labkit's MoE block does not model: tensor parallelism
    (labkit keeps a MoE layer whole on each tp rank, ``labkit.tensor_parallel.experts``; not
    counted here yet) and the fused kernels' count."""
    if not shape.n_experts:
        return
    if shape.mlp != "swiglu":
        raise ArgumentError(f"mlp={shape.mlp!r} with experts: labkit's experts are SwiGLU; the training "
                            "estimate models those only", "untrainable", missing=[f"{shape.mlp} experts"])
    if run.tp_size > 1:
        raise ArgumentError(f"tp_size={run.tp_size} with experts (n_experts={shape.n_experts}): the training "
                            "estimate does not model experts under tensor parallelism (labkit keeps them whole "
                            "on each tp rank); use tp_size=1", "untrainable", missing=["tensor-parallel experts"])
    if run.kernels != "labkit":
        raise ArgumentError(f"kernels={run.kernels!r} with experts: the fused kernels' count has no MoE block; "
                            "use kernels='labkit'", "untrainable", missing=["fused MoE kernels"])


def dispatched_rows_bound(tokens: int, n_experts: int, experts_per_token: int, capacity_factor) -> int:
    """Rows a rank's MoE layer dispatches at most: N k dropless, else min(N k, E C) (each of the E
    experts takes at most C = ``expert_capacity`` of them)."""
    rows = dispatched_rows(tokens, experts_per_token)
    if capacity_factor is None:
        return rows
    return min(rows, n_experts * expert_capacity(tokens, n_experts, experts_per_token, capacity_factor))


@lru_cache(maxsize=4096)
def moe_layer_bytes(shape, seq_len: int, micro_batch: int, *, dtype_bytes: int, ep_size: int = 1,
                    capacity_factor: float | None = None, sent_rows: int | None = None,
                    received_rows: int | None = None) -> dict:
    """Bytes one MoE layer of ``labkit.moe.MoE`` keeps for backward on a rank, by term (its MLP's
    part; the block's attention and norms are the Llama block's).

    N = seq_len x micro_batch tokens, e = ``dtype_bytes``, M = ``sent_rows`` (default: the bound of
    :func:`dispatched_rows_bound`), M' = ``received_rows``, the rows this rank's experts run
    (default M: routing balanced over the ep ranks; the true count depends on the routing).
    Assumed: top-k weights renormalised (norm_topk_prob; without, N k e + N e less) and no
    load-balancing loss (aux_loss_coef > 0 keeps N e + E e + e more).
    """
    e, E, k, h = dtype_bytes, shape.n_experts, shape.experts_per_token, shape.d_model
    N = check_int("seq_len", seq_len, 1) * check_int("micro_batch", micro_batch, 1)
    bound = dispatched_rows_bound(N, E, k, capacity_factor)
    M = bound if sent_rows is None else check_int("sent_rows", sent_rows, 0, bound)
    R = M if received_rows is None else check_int("received_rows", received_rows, 0)
    f, width = shape.expert_dim, shape.n_shared_experts * shape.shared_dim
    return {
        "router scores (N E e)": N * E * e,
        "top-k choices (8 N k)": INDEX_BYTES * N * k,
        "renormalised top-k weights and their sums (N k e + N e)": N * k * e + N * e,
        "kept assignments under a capacity (N k, bool)": N * k if capacity_factor is not None else 0,
        "dispatch order and token indices (3 x 8 M)": 3 * INDEX_BYTES * M,
        "each row's weight (M e)": M * e,
        "combined rows and weighted rows (2 M h e)": 2 * M * h * e,
        "rows at this rank's experts (M' h e)": R * h * e,
        "experts' gate, SiLU, up, product (4 M' f e)": 4 * R * f * e,
        "expert-major permutation and its inverse (2 x 8 M', ep > 1)":
            2 * INDEX_BYTES * R if check_int("ep_size", ep_size, 1) > 1 else 0,
        "shared experts' gate, SiLU, up, product (4 N S f_s e)": 4 * N * width * e,
    }


def rank_params(shape, tp_size: int, pp_size: int, stage: int, v: int, ep_size: int) -> tuple[int, int]:
    """(non-expert, routed-expert) parameters a rank of pipeline ``stage`` trains: the stage's
    parameters (``ModelShape.stage_params``) less the router's bias buffer, its routed experts
    split into E / ep a rank (``experts_per_rank``)."""
    n = shape.stage_params(tp_size, pp_size, stage, v)
    if not shape.n_experts:
        return n, 0
    moe = sum(1 for start, stop in shape.stage_ranges(pp_size, stage, v)
              for i in range(start, stop) if shape.is_moe_layer(i))
    local = moe * experts_per_rank(shape.n_experts, ep_size) * shape.expert_params(tp_size)
    return n - moe * _not_trained(shape, tp_size, ep_size) - local, local


def _not_trained(shape, tp_size: int, ep_size: int) -> int:
    """Elements of one MoE layer a rank does not train: the other ranks' experts, the bias buffer."""
    E = shape.n_experts
    return (E - experts_per_rank(E, ep_size)) * shape.expert_params(tp_size) + (E if shape.router_bias else 0)


@lru_cache(maxsize=4096)  # a sweep asks it for every configuration, and it walks every layer
def rank_layer_params(shape, tp_size: int, ep_size: int) -> int:
    """The parameters of a rank's largest layer: a dense one, or a MoE one with its E / ep experts."""
    return max(shape.layer_params(tp_size, i) - (_not_trained(shape, tp_size, ep_size) if shape.is_moe_layer(i) else 0)
               for i in range(shape.n_layer))


def rank_model_states(shape, run, stage: int, policy: str):
    """ZeRO's model-state bytes of a rank: its non-expert parameters sharded over the replicas,
    its E / ep experts of each MoE layer over the replicas / ep that hold the same experts."""
    dense, experts = rank_params(shape, run.tp_size, run.pp_size, stage, run.v, run.ep_size)
    if run.ep_size == 1:  # one flat group, as labkit pads it
        return zero_model_state_bytes(dense + experts, run.replicas, run.zero_stage, policy, run.optimizer)
    a = zero_model_state_bytes(dense, run.replicas, run.zero_stage, policy, run.optimizer)
    x = zero_model_state_bytes(experts, run.replicas // run.ep_size, run.zero_stage, policy, run.optimizer)
    return type(a)(a.params + x.params, a.grads + x.grads, a.optimizer + x.optimizer)
