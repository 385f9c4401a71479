"""Expert parallelism composed with data parallelism and ZeRO: the groups, the refusals, the gradients.

:class:`ExpertDataParallel` is data parallelism's end-of-step reduction when experts are sharded
(:mod:`labkit.expert_parallel`): every gradient averaged over "dp", except an expert's, which
only the dp / ep ranks holding that expert have. Those are summed over the replicas and divided by
dp_size: each holder's gradient already sums its ep group's ranks' losses (the combine's backward
brings them home), so the replicas' sum covers every data-parallel rank once, as one process
summing dp_size local means and dividing by dp_size would. ZeRO-1/2 (:class:`ExpertShardedOptimizer`)
and ZeRO-3 (:func:`expert_units`) shard the experts over those replicas with the same scaling.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..collectives import all_reduce_mean_, check_same_across_ranks
from ..expert_parallel import apply_expert_parallel, check_ep_size
from ..moe.layer import Experts
from ..zero import ShardedGradOptimizer, ShardedOptimizer
from .compose import experts_beyond
from .dims import ParallelDims

__all__ = ["ExpertDataParallel", "ExpertShardedOptimizer", "build_expert_groups", "check_experts_combination",
           "expert_sharded_optimizer", "expert_units", "shard_experts", "split_experts"]


def build_expert_groups(dims, rank: int):
    """(this rank's ep group, its expert-replica group): every group created on every rank, in
    :meth:`ParallelDims.expert_groups`' order, as ``dist.new_group`` requires."""
    groups, replicas = dims.expert_groups()
    mine = [None, None]
    for kind, ranks_list in enumerate((groups, replicas)):
        for ranks in ranks_list:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    return tuple(mine)


def check_experts_combination(model, dims) -> None:
    """Refuse by name what experts do not compose with here (:func:`.compose.experts_beyond`)."""
    if not isinstance(dims, ParallelDims):
        return  # parallelize_gpt's mesh check names it
    has_experts = bool(getattr(model.cfg, "n_experts", 0))
    if dims.ep_size > 1 and not has_experts:
        raise ValueError(f"ep_size={dims.ep_size} needs a model with experts (cfg.n_experts > 0)")
    if not has_experts:
        return
    check_ep_size(dims.ep_size, model.cfg.n_experts)
    bad = experts_beyond(dims.cp_size)
    if bad:
        raise ValueError(f"a model with experts (n_experts={model.cfg.n_experts}) with {', '.join(bad)}: "
                         "experts compose here with every technique but context parallelism; use cp_size=1")


def shard_experts(model, dims, dp_group):
    """Check every data-parallel rank passed the same model, then keep this rank's experts over its
    ep group; returns the expert-replica group (None when ep_size is 1: nothing is sharded)."""
    if dims.ep_size == 1:
        return None
    check_same_across_ranks(model.named_parameters(), dp_group)
    ep_group, replica_group = build_expert_groups(dims, dist.get_rank())
    apply_expert_parallel(model, ep_group)
    return replica_group


class ExpertDataParallel:
    """Data parallelism over "dp" with experts sharded: ``all_reduce_grads`` after the step's
    backward passes (what :class:`labkit.parallel.ParallelModel` calls), ``no_sync`` a no-op."""

    def __init__(self, model, dp_group, replica_group):
        self.dp_group, self.replica_group = dp_group, replica_group
        self.dp_size = dist.get_world_size(dp_group)
        params = [p for p in model.parameters() if p.requires_grad]
        self.experts = [p for p in params if getattr(p, "expert_parallel", False)]
        self.dense = [p for p in params if not getattr(p, "expert_parallel", False)]

    def no_sync(self):
        return contextlib.nullcontext()

    @torch.no_grad()
    def all_reduce_grads(self) -> None:
        """Dense gradients: the mean over "dp"; experts': the sum over their replicas / dp_size."""
        for params, replicas in ((self.dense, False), (self.experts, True)):
            held = [p for p in params if p.grad is not None]
            if not held:
                continue
            flat = torch.cat([p.grad.reshape(-1) for p in held])
            if replicas:
                dist.all_reduce(flat, group=self.replica_group)
                flat /= self.dp_size
            else:
                all_reduce_mean_(flat, self.dp_size, self.dp_group)
            for p, part in zip(held, flat.split([p.numel() for p in held])):
                p.grad.copy_(part.view_as(p.grad))


class ExpertShardedOptimizer:
    """ZeRO-1 or 2 with experts sharded: ``sharded`` (:class:`labkit.zero.ShardedOptimizer` or
    :class:`labkit.zero.ShardedGradOptimizer`) over "dp" for the replicated parameters (``dense``,
    its params argument), another over the expert replicas for ``experts`` (each replica group
    holds the same experts, so its ranks can split their gradients and optimizer state). The
    second averages over dp / ep replicas; the experts' gradients (ZeRO-1: full, before it
    reduces them; ZeRO-2: the slices it reduce-scattered in backward) are then scaled by 1 / ep,
    so that what it steps is their sum over the replicas divided by dp_size, as
    :class:`ExpertDataParallel` takes it."""

    def __init__(self, dense, experts, optimizer_cls, dp_group, replica_group, ep_size: int,
                 sharded=ShardedOptimizer, **kwargs):
        self.ep_size = ep_size
        self.dense = sharded(dense, optimizer_cls, group=dp_group, **kwargs)
        self.experts = sharded(list(experts), optimizer_cls, group=replica_group, **kwargs)

    def slice_of(self, param):
        """This rank's slice of a replicated parameter (ZeRO-2's ``slice_of``)."""
        return self.dense.slice_of(param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none)
        self.experts.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        if isinstance(self.experts, ShardedGradOptimizer):  # reduce-scattered already: its slices
            self.experts.finish_grad_sync()
            grads = [s.grad for g in self.experts.inner.param_groups for s in g["params"]]
        else:
            grads = [p.grad for g in self.experts.param_groups for p in g["params"]]
        for grad in grads:
            if grad is not None:
                grad.div_(self.ep_size)
        self.dense.step()
        self.experts.step()


def split_experts(named) -> tuple[list, list]:
    """(replicated, expert) (name, parameter) pairs of ``named``: experts are marked ``expert_parallel``."""
    named = list(named)
    return ([(n, p) for n, p in named if not getattr(p, "expert_parallel", False)],
            [(n, p) for n, p in named if getattr(p, "expert_parallel", False)])


def expert_sharded_optimizer(pm, optimizer_cls, kwargs, sharded=ShardedOptimizer, dense=None) -> ExpertShardedOptimizer:
    """ZeRO-1's (or, ``sharded=ShardedGradOptimizer``, 2's) optimizer of a
    :class:`labkit.parallel.ParallelModel` whose experts are sharded; ``dense``: the replicated
    parameters' groups if not ``pm``'s (ZeRO-2 gives the tied weight a group of its own)."""
    rest, experts = split_experts(pm.named_parameters())
    return ExpertShardedOptimizer(rest if dense is None else dense, experts, optimizer_cls, pm.group["replicas"],
                                  pm.expert_replicas, pm.dims.ep_size, sharded=sharded, **kwargs)


def expert_units(block_type, replica_group, dp_size: int):
    """ZeRO-3's (unit predicate, ``unit_groups``) of :class:`labkit.zero.FullyShardedModule`: the
    blocks; with experts sharded over "ep" (``replica_group`` not None) each MoE layer's experts
    too, a unit sharded over the replicas that hold them, its gradient their sum / dp_size."""
    if replica_group is None:
        return (lambda m: isinstance(m, block_type)), None
    return ((lambda m: isinstance(m, (block_type, Experts))),
            (lambda m: (replica_group, dp_size) if isinstance(m, Experts) else None))
