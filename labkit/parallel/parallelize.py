"""One GPT sharded by every technique at once, in one order: :func:`parallelize_gpt`.

The order is torchtitan's ``parallelize_llama``: tensor (and sequence) parallelism over "tp",
context parallelism over "cp" (ring attention), the pipeline split over "pp", activation
checkpointing of the blocks, then data parallelism over "dp" or ZeRO over "dp" x "cp" (under
ZeRO-3 the checkpoints go inside its units, so a recomputed block gathers its parameters again).
Each technique is labkit's own
(:mod:`labkit.tensor_parallel`, :mod:`labkit.pipeline`, :mod:`labkit.checkpoint`,
:mod:`labkit.data_parallel`, :mod:`labkit.zero`); this module only composes them.

What comes back, a :class:`ParallelModel`, does every end-of-backward duty by itself: the
sequence-parallel gradient sums over "tp" (the tensor-parallel layers' hook; under ZeRO-2/3 a
sum of the shards, :mod:`.zero3`), the tied embedding's exchange between the first and last stage
(the pipeline runtime; under ZeRO-2/3 of the two ends' shards), the context-parallel sum over "cp"
(without ZeRO), and the reduction over "dp" (after the step's last backward pass; under ZeRO over
"dp" x "cp": ZeRO-1/2's inside its optimizer, ZeRO-3's in each backward pass).
A plain loop over it trains like one process::

    pm = parallelize_gpt(model, dims, mesh, zero_stage=1, num_microbatches=2)
    opt = pm.build_optimizer(torch.optim.SGD, lr=0.1)
    for x, y in batches:                              # the global batch, the same on every rank
        opt.zero_grad(set_to_none=True)
        loss = pm.forward_backward(*pm.shard_batch(x, y))
        opt.step()
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist

from ..checkpoint import apply_checkpointing, checkpoint_scratch
from ..context_parallel import apply_context_parallel, ring_attention, shard_sequence
from ..data_parallel import DataParallelBucketed
from ..moe.layer import moe_layers, set_aux_grad_scale
from ..pipeline import SCHEDULES, build_chunks, check_same_model, make_schedule, run_schedule, split_stages
from ..tensor_parallel import apply_tensor_parallel
from ..validate import check_bool, check_choice, check_int
from ..zero import FullyShardedModule, ShardedGradOptimizer, ShardedOptimizer
from .compose import check_combination, knobs_of_run
from .config import RunConfig
from .context import context_parallel_chunks, context_parallel_loss_fn
from .dims import AXES, ParallelDims
from .experts import (ExpertDataParallel, check_experts_combination, expert_sharded_optimizer, expert_units,
                      shard_experts, split_experts)
from .zero3 import BlockShards, ShardedSequenceSum, replica_group, sequence_sharded, shard_chunks, sharded_full_state

__all__ = ["CHECKPOINTS", "ParallelModel", "parallelize_gpt"]

CHECKPOINTS = ("none", "full", "selective", "sqrt")  # the policies of labkit.checkpoint a run may name


def _check_mesh(dims, mesh) -> None:
    if not isinstance(dims, ParallelDims):
        raise TypeError(f"dims={dims!r} must be a labkit.parallel.ParallelDims")
    names, shape = tuple(mesh.mesh_dim_names or ()), tuple(mesh.mesh.shape)
    if names != AXES or shape != dims.sizes:
        raise ValueError(f"mesh has axes {names} of sizes {shape}; dims needs axes {AXES} of sizes "
                         f"{dims.sizes}: build it with dims.build_mesh(device_type)")


class ParallelModel:
    """One rank's share of a GPT under :func:`parallelize_gpt`, and its training step.

    ``model``: the (tensor-parallel) GPT, every part of it (a stage uses only its chunks);
    ``chunks``: this rank's pipeline chunks; ``coords``: its place on the mesh. A step:
    :meth:`forward_backward` on this data-parallel replica's rows (:meth:`shard_batch`), then the
    optimizer of :meth:`build_optimizer`. ``data_parallel`` (stage 0), ``fsdp`` (stage 3, one
    stage) or ``fsdp_chunks`` (stage 3, one per chunk) are the wrappers, when used;
    :meth:`full_state` gathers what the rank's stage trains.
    """

    def __init__(self, model, dims, mesh, *, sequence_parallel, zero_stage, num_microbatches, v,
                 chunks, ranges, actions, expert_replicas=None):
        self.model, self.dims, self.mesh, self.zero_stage = model, dims, mesh, zero_stage
        self.sequence_parallel, self.chunks, self.ranges = sequence_parallel, chunks, ranges
        self.num_microbatches, self.v = num_microbatches, v
        self.coords = dims.coords(dist.get_rank())
        self.group = {axis: mesh.get_group(axis) for axis in AXES}
        self.group["replicas"] = replica_group(dims, mesh, self.coords) if zero_stage else self.group["dp"]
        c = self.coords  # a stage's peers along "pp" share its dp, cp and tp coordinates
        self.pp_ranks = [dims.rank_of(dp=c.dp, pp=s, cp=c.cp, tp=c.tp) for s in range(dims.pp_size)]
        self.loss_fn = model.loss  # the last stage's loss(logits, targets)
        if chunks and dims.cp_size > 1:  # each chunk's layers by the ring, the loss the global mean's
            context_parallel_chunks(model, chunks, dims.tp_size if sequence_parallel else 1)
            self.loss_fn = context_parallel_loss_fn(model)
        self.actions = actions
        held = {id(p) for c in chunks for p in c.parameters()} if chunks else None
        self._named = [(n, p) for n, p in model.named_parameters() if held is None or id(p) in held]
        self.data_parallel = self.fsdp = self.optimizer = self._sp_sum = None
        self.fsdp_chunks, self._tied = [], model.wte.weight
        self._act_dtype = model.wte.weight.dtype
        self.last_losses = []  # the micro-batch losses of the last forward_backward (last stage)
        self.expert_replicas = expert_replicas  # experts sharded over "ep": their own reductions (.experts)
        if zero_stage == 0 and dims.dp_size > 1:
            self.data_parallel = DataParallelBucketed(model, group=self.group["dp"]) if expert_replicas is None \
                else ExpertDataParallel(model, self.group["dp"], expert_replicas)
        if zero_stage == 3:
            self._shard_fully(model, type(model.blocks[0]))

    def _shard_fully(self, model, block_type) -> None:
        """ZeRO-3 over "dp": the whole model (one stage) or each chunk (:mod:`.zero3`), experts
        sharded over "ep" over their replicas (:func:`.experts.expert_units`); with sequence
        parallelism, the sum over "tp" of the sequence-sharded parameters' shards."""
        is_unit, unit_groups = expert_units(block_type, self.expert_replicas, self.dims.dp_size)
        if self.chunks:
            self.fsdp_chunks, self._tied = shard_chunks(model, self.chunks, self.group["replicas"], is_unit,
                                                        unit_groups)
            wrappers = self.fsdp_chunks
        else:
            sp = {n for n, p in self._named if getattr(p, "sequence_parallel", False)}
            self.fsdp = FullyShardedModule(model, group=self.group["replicas"], unit_types=is_unit,
                                           unit_groups=unit_groups)
            self.fsdp.sequence_parallel_names = sp
            wrappers = [self.fsdp]
        self._named = [(n, None) for n, _ in self._named]  # names only: no reference to the full tensors
        if self.sequence_parallel:
            self._sp_sum = ShardedSequenceSum(sequence_sharded(wrappers), self.group["tp"])

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the pipeline's last stage (and so the loss)."""
        return self.coords.pp == self.dims.pp_size - 1

    def named_parameters(self):
        """(name, parameter) of what this rank holds and trains (under ZeRO-3: its shards)."""
        if self.fsdp is not None:
            return list(self.fsdp.named_parameters())
        if self.fsdp_chunks:
            return [(f"{i}.{n}", p) for i, w in enumerate(self.fsdp_chunks) for n, p in w.named_parameters()]
        return list(self._named)

    def full_state(self) -> dict:
        """{the model's name: value} of every parameter this rank's stage trains, in full (under
        ZeRO-3 gathered over "dp", a collective: every rank of "dp" calls it)."""
        if self.fsdp is not None:
            state = self.fsdp.full_state_dict()
            return {n: state[n] for n, _ in self._named}
        if self.fsdp_chunks:
            return sharded_full_state(self.fsdp_chunks)
        return {n: p.detach().clone() for n, p in self._named}

    def parameters(self):
        """The parameters of :meth:`named_parameters`: what an optimizer over this rank steps."""
        return [p for _, p in self.named_parameters()]

    def build_optimizer(self, optimizer_cls=torch.optim.SGD, **kwargs):
        """The step's optimizer over this rank's parameters: ``optimizer_cls`` itself (stages 0 and
        3), or ZeRO-1/2's sharded wrapper around it over "dp"; kept as ``self.optimizer``."""
        if self.zero_stage == 1:
            self.optimizer = ShardedOptimizer(self.named_parameters(), optimizer_cls, group=self.group["replicas"],
                                              **kwargs) if self.expert_replicas is None else \
                expert_sharded_optimizer(self, optimizer_cls, kwargs)
        elif self.zero_stage == 2:
            self.optimizer = self._zero2_optimizer(optimizer_cls, kwargs)
        else:
            self.optimizer = optimizer_cls(self.parameters(), **kwargs)
        return self.optimizer

    def _zero2_optimizer(self, optimizer_cls, kwargs):
        """ZeRO-2 over "dp". The tied weight gets a parameter group (so a bucket) of its own: its
        shards then line up at the pipeline's two ends, which sum their gradients; with sequence
        parallelism the sequence-sharded parameters' shards are summed over "tp" (:mod:`.zero3`)."""
        named, pp = self.named_parameters(), self.dims.pp_size > 1
        if self.expert_replicas is not None:  # the experts reduce-scattered over their replicas
            named = split_experts(named)[0]
        groups = [{"params": [(n, p) for n, p in named if not (pp and p is self._tied)]}]
        if len(groups[0]["params"]) < len(named):
            groups.append({"params": [(n, p) for n, p in named if p is self._tied]})
        opt = ShardedGradOptimizer(groups, optimizer_cls, group=self.group["replicas"], **kwargs) \
            if self.expert_replicas is None else \
            expert_sharded_optimizer(self, optimizer_cls, kwargs, sharded=ShardedGradOptimizer, dense=groups)
        if self.dims.pp_size > 1:
            self._tied = opt.slice_of(self._tied)  # None on a middle stage
        if self.sequence_parallel:
            sp = [opt.slice_of(p) for _, p in named if getattr(p, "sequence_parallel", False)]
            self._sp_sum = ShardedSequenceSum(sp, self.group["tp"])
        return opt

    def shard_batch(self, x, y):
        """This data-parallel replica's rows of the global batch ``x``, ``y`` (B, T) each; with cp > 1,
        its context-parallel rank's zigzag shard of them (B / dp, T / cp)."""
        dp, d = self.dims.dp_size, self.coords.dp
        if x.shape[0] % dp:
            raise ValueError(f"the global batch of {x.shape[0]} sequences must split into dp_size={dp} replicas")
        rows = slice(d * x.shape[0] // dp, (d + 1) * x.shape[0] // dp)
        if self.dims.cp_size == 1:
            return x[rows], y[rows]
        return tuple(shard_sequence(t[rows], self.dims.cp_size, self.coords.cp) for t in (x, y))  # zigzag

    def forward_backward(self, x, y):
        """Forward and backward of this replica's batch (B, T) in m micro-batches; every gradient
        complete when it returns. The loss (the mean over the replica's tokens) on the last stage,
        None on the others; under pp > 1 the cross-entropy alone (aux losses join at their layers)."""
        m = self.num_microbatches
        if x.shape[0] % m:
            raise ValueError(f"num_microbatches={m} must divide this replica's batch of {x.shape[0]} sequences")
        sync = self.data_parallel.no_sync() if self.data_parallel is not None else contextlib.nullcontext()
        if self._sp_sum is not None:
            self._sp_sum.begin()
        with sync:
            losses = self._pipeline_step(x, y) if self.dims.pp_size > 1 else self._local_step(x, y)
        if self._sp_sum is not None:  # ZeRO-3's shards of the sequence-sharded gradients, over "tp"
            self._sp_sum.finish()
        if self.data_parallel is not None:  # after the sequence-parallel sums and the tied exchange
            self.data_parallel.all_reduce_grads()
        self.last_losses = losses
        return sum(losses) / len(losses) if losses else None

    def _local_step(self, x, y) -> list[float]:
        net, m, losses = self.fsdp or self.model, self.num_microbatches, []
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            loss = net(xm, ym)
            (loss / m).backward()
            losses.append(loss.item())
        return losses

    def _pipeline_step(self, x, y) -> list[float]:
        m, model = self.num_microbatches, self.model
        # each stage's MoE layers add their aux losses' gradient (1 / m, the runtime's loss scale) in
        # their own backward: the last stage's loss_fn is the cross-entropy alone (labkit.moe.layer)
        set_aux_grad_scale(moe_layers(model), 1.0 / m)
        seq = x.shape[1] // self.dims.tp_size if self.sequence_parallel else x.shape[1]  # what stages exchange
        res = run_schedule(self.fsdp_chunks or self.chunks, self.actions, rank=self.coords.pp,
                           pp_size=self.dims.pp_size,
                           inputs=x.chunk(m), targets=y.chunk(m), loss_fn=self.loss_fn,
                           act_shape=(x.shape[0] // m, seq, model.cfg.d_model), act_dtype=self._act_dtype,
                           device=x.device, group=self.group["pp"], ranks=self.pp_ranks,
                           tied=self._tied, count_saved=False)
        return res.losses


def parallelize_gpt(model, dims, mesh, *, sequence_parallel: bool = False, zero_stage: int = 0,
                    checkpoint: str = "none", schedule: str = "1f1b", num_microbatches: int = 1,
                    v: int = 1) -> ParallelModel:
    """Shard labkit's GPT ``model`` over ``mesh`` (``dims.build_mesh``) and return its :class:`ParallelModel`.

    ``dims``: a :class:`ParallelDims` with the keywords, or a ``RunConfig`` (precision "fp32",
    attention "eager") that gives them all. Every rank passes the same seeded model (checked). In
    order, as the module docstring says: tensor (and sequence) parallelism over "tp", context
    parallelism over "cp", the pipeline over "pp" (``schedule``, ``num_microbatches`` m, ``v``),
    ``checkpoint`` (:data:`CHECKPOINTS`; under ZeRO-3 inside its units), then plain data
    parallelism or ZeRO stage 1-3 over the dp x cp ranks that hold the same parameters; experts
    over "ep" (:mod:`.experts`; what they compose with: :func:`.compose.experts_beyond`). Refused with a ValueError:
    sequence parallelism without tp > 1, and :data:`labkit.parallel.compose.NOT_COMPOSED`.
    """
    if isinstance(dims, RunConfig):
        if (sequence_parallel, zero_stage, checkpoint, schedule, num_microbatches, v) != (False, 0, "none", "1f1b", 1, 1):
            raise TypeError("parallelize_gpt takes a RunConfig or keywords, not both")
        dims, knobs = knobs_of_run(dims)
        return parallelize_gpt(model, dims, mesh, **knobs)
    check_bool("sequence_parallel", sequence_parallel)
    check_int("zero_stage", zero_stage, 0, 3)
    check_choice("checkpoint", checkpoint, CHECKPOINTS)
    check_choice("schedule", schedule, SCHEDULES)
    check_int("num_microbatches", num_microbatches, 1)
    check_int("v", v, 1)
    check_experts_combination(model, dims)
    _check_mesh(dims, mesh)
    check_combination(dims, sequence_parallel, zero_stage, checkpoint, schedule, num_microbatches, v, model.cfg.seq_len)
    if dims.pp_size == 1 and (schedule, v) != ("1f1b", 1):
        raise ValueError(f"schedule={schedule!r}, v={v} need pp_size > 1; with one stage the m micro-batches "
                         "run one after another (gradient accumulation)")
    pp, stage = dims.pp_size, dims.coords(dist.get_rank()).pp
    actions = make_schedule(schedule, pp, num_microbatches, v)[stage] if pp > 1 else None  # checks m, v
    if pp > 1:
        check_same_model(model, mesh.get_group("pp"))  # each stage cuts its chunks from its own copy
    ranges = split_stages(model, pp, v=v) if pp > 1 else None  # by the unsharded model's parameters
    if dims.tp_size > 1:
        apply_tensor_parallel(model, mesh.get_group("tp"), sequence_parallel)
    if dims.cp_size > 1:  # ring attention over "cp"; its gradient sum runs before the one over "dp"
        # selective recomputation recomputes the attention core, here the ring: it keeps q, k, v only
        ring = partial(checkpoint_scratch, ring_attention, params=[]) if checkpoint == "selective" else None
        # under ZeRO its mean over the dp x cp ranks sums the sequence's shares (grad_sync=False)
        apply_context_parallel(model, mesh.get_group("cp"), attention=ring, grad_sync=zero_stage == 0)
    expert_replicas = shard_experts(model, dims, mesh.get_group("dp"))  # ep > 1: experts over "ep"
    if checkpoint != "none" and zero_stage != 3:  # after the experts' sharding: it checkpoints what stays
        apply_checkpointing(model, checkpoint)
    chunks = build_chunks(model, ranges, pp, stage) if pp > 1 else None
    pm = ParallelModel(model, dims, mesh, sequence_parallel=sequence_parallel, zero_stage=zero_stage,
                       num_microbatches=num_microbatches, v=v, chunks=chunks, ranges=ranges, actions=actions,
                       expert_replicas=expert_replicas)
    if checkpoint != "none" and zero_stage == 3:  # inside ZeRO-3's units: a recomputed block gathers again
        apply_checkpointing(model, checkpoint, sharded=BlockShards(pm.fsdp_chunks or [pm.fsdp]))
    return pm
