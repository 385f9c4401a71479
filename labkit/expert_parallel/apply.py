"""Experts sharded over an expert-parallel group: :func:`apply_expert_parallel`.

Each of the group's ep ranks keeps E / ep of every MoE layer's experts (rank r: experts
r E/ep .. (r + 1) E/ep - 1) and replaces the layer's local exchange with
:class:`ExpertParallelExchange`: counts, dispatch, the experts, combine (Lepikhin et al. 2021).
The router, shared experts and everything else stay replicated. The experts' parameters are
marked ``expert_parallel = True``: whoever reduces gradients over data parallelism sums them
over the ranks that hold the same experts only (:mod:`labkit.parallel`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..moe.layer import moe_layers
from ..validate import ArgumentError, check_int
from .analytic import check_ep_size
from .comm import all_to_all, exchange_counts
from .permute import expert_major_order, inverse_permutation

__all__ = ["ExpertParallelExchange", "apply_expert_parallel", "check_ep_size"]


class ExpertParallelExchange:
    """A MoE layer's exchange over ``group``: rows (M, h) sorted by global expert, counts (E,)
    -> the experts' outputs (M, h) in the same order, computed on the ranks holding them."""

    def __init__(self, group, n_experts: int):
        self.group, self.ep = group, dist.get_world_size(group)
        self.n_local = n_experts // check_ep_size(self.ep, n_experts)

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts) -> torch.Tensor:
        ep, n_local = self.ep, self.n_local
        received = exchange_counts(counts, self.group).view(ep, n_local)  # (ep, E_local)
        send = counts.view(ep, n_local).sum(1).tolist()  # rows to each rank
        recv = received.sum(1).tolist()  # rows from each rank
        got = all_to_all(rows, send, recv, self.group)  # (Σ recv, h), (source, expert) order
        order = expert_major_order(received)  # (Σ recv,)
        out = experts(got[order], received.sum(0).tolist())  # (Σ recv, h), (expert, source) order
        return all_to_all(out[inverse_permutation(order)], recv, send, self.group)  # (M, h)


def apply_expert_parallel(model: nn.Module, group) -> nn.Module:
    """Keep this rank's E / ep experts of each MoE layer of ``model`` (the same seeded model on
    every rank of ``group``) and exchange tokens over ``group``. Returns ``model``."""
    layers = moe_layers(model)
    if not layers:
        raise ArgumentError("model has no MoE layers (n_experts=0): expert parallelism has nothing to shard")
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    for layer in layers:
        n_local = layer.n_experts // check_ep_size(ep, layer.n_experts)
        keep = slice(rank * n_local, (rank + 1) * n_local)
        for name in ("c_gate", "c_fc", "c_proj"):
            p = nn.Parameter(getattr(layer.experts, name).detach()[keep].clone())  # (E_local, ...)
            p.expert_parallel = True
            setattr(layer.experts, name, p)
        layer.exchange = ExpertParallelExchange(group, layer.n_experts)
    return model
