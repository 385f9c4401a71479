"""What each rank runs in Chapter 2's lab and benchmark.

``train_rank(rank, world_size, kinds, ...)`` trains the tiny GPT under each data-parallel
scheme in ``kinds`` on the same global batches, measures one step with the memory meter and
the communication counter, and returns per-rank results; pass it to :func:`labkit.dist.launch`.
``reference_run`` trains the same model in one process on the whole batch and
``adam_agreement`` judges a scheme against it (both in :mod:`labkit.runs.zero_reference`). ``BUILDERS`` maps
each scheme to the function that wraps a model and makes its optimizer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..data import load_corpus
from ..dist import CommCounter, rank_device
from ..memory.meter import MemoryMeter, optimizer_tensors, train_step
from ..model import Block, count_params
from ..parallel import ParallelDims
from ..data_parallel import DataParallelBucketed, DataParallelNaive
from ..validate import check_int
from ..zero import (FullyShardedModule, OffloadOptimizer, ShardedGradOptimizer, ShardedOptimizer, load_sharded,
                    save_sharded)
from .zero_reference import adam_agreement, make_model, rank_batch, reference_run

__all__ = ["BUILDERS", "KINDS", "RESUMABLE", "STAGE", "Built", "adam_agreement", "build", "make_model", "rank_batch",
           "reference_run", "train_rank"]

RESUMABLE = ("zero1", "zero2", "zero3")  # the kinds that save and load sharded checkpoints


@dataclass
class Built:
    """A scheme around one model: what to call, what steps, and what the lab reads of it."""

    net: nn.Module  # called on a batch: the model or its wrapper
    opt: object  # the optimizer
    full_state: Callable[[], dict]  # the whole model's state dict, on every rank
    meter_model: nn.Module  # what the memory meter labels parameters and gradients from
    shards: object = None  # what holds the shard entries of a sharded checkpoint
    groups: tuple = ()  # Ψ of each flat group (stages 1-3)
    meter_opt: object = None  # what holds the optimizer states, when not ``opt`` itself

    def __post_init__(self):
        self.meter_opt = self.opt if self.meter_opt is None else self.meter_opt


class _StateView(nn.Module):
    """The model's parameters and the optimizer's slices, so the meter labels both (and their grads)."""

    def __init__(self, model, slices):
        super().__init__()
        self.model = model
        seen = {id(p) for p in model.parameters()}
        self.slices = nn.ParameterList([s for s in slices if id(s) not in seen])


def _torch_ddp(model):
    from torch.nn.parallel import DistributedDataParallel as DDP
    try:  # the causal mask never changes: no buffer broadcast in each forward
        return DDP(model, forward_sync_buffers=False)
    except TypeError:  # torch < 2.13
        return DDP(model, broadcast_buffers=False)


def _build_torch_ddp(model, kw, mesh):
    net = _torch_ddp(model)
    return Built(net, torch.optim.AdamW(net.parameters(), **kw), model.state_dict, model)


def _build_zero1_ddp(model, kw, mesh):
    net = _torch_ddp(model)
    opt = ShardedOptimizer(net.parameters(), torch.optim.AdamW, reduce_grads=False, **kw)
    return Built(net, opt, model.state_dict, model, opt, tuple(opt.bucket_numels()))


def _build_zero1_torch(model, kw, mesh):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    net = _torch_ddp(model)
    opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, **kw)
    return Built(net, opt, model.state_dict, model, meter_opt=opt.optim)  # the local AdamW's states


def _build_data_parallel(cls):
    def build(model, kw, mesh):
        net = cls(model)
        return Built(net, torch.optim.AdamW(net.parameters(), **kw), model.state_dict, model)
    return build


def _build_sharded_optimizer(cls):
    def build(model, kw, mesh):
        opt = cls(model.parameters(), torch.optim.AdamW, **kw)
        slices = [s for _, _, _, s in opt.shard_entries()]  # offloaded ones are labelled optimizer states
        return Built(model, opt, model.state_dict, _StateView(model, slices), opt, tuple(opt.bucket_numels()))
    return build


def _build_zero3(compute_dtype):
    def build(model, kw, mesh):
        net = FullyShardedModule(model, unit_types=(Block,), compute_dtype=compute_dtype)
        return Built(net, torch.optim.AdamW(net.parameters(), **kw), net.full_state_dict, net, net,
                     tuple(net.unit_numels()))
    return build


def _build_fsdp2(bf16):
    def build(model, kw, mesh):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) \
            if bf16 else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)

        def full():
            return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        return Built(model, torch.optim.AdamW(model.parameters(), **kw), full, model)
    return build


# scheme -> (ZeRO stage it implements, 0 for plain data parallelism; builder(model, optimizer kwargs, mesh))
BUILDERS = {
    "ddp_torch": (0, _build_torch_ddp),
    "ddp_naive": (0, _build_data_parallel(DataParallelNaive)),
    "ddp_bucketed": (0, _build_data_parallel(DataParallelBucketed)),
    "zero1": (1, _build_sharded_optimizer(ShardedOptimizer)),
    "zero1_ddp": (1, _build_zero1_ddp),
    "zero1_torch": (1, _build_zero1_torch),
    "zero2": (2, _build_sharded_optimizer(ShardedGradOptimizer)),
    "offload": (2, _build_sharded_optimizer(OffloadOptimizer)),
    "zero3": (3, _build_zero3(None)),
    "fsdp2": (3, _build_fsdp2(False)),
    "zero3_bf16": (3, _build_zero3(torch.bfloat16)),
    "fsdp2_bf16": (3, _build_fsdp2(True)),
}
STAGE = {kind: stage for kind, (stage, _) in BUILDERS.items()}
KINDS = tuple(BUILDERS)


def build(kind, model, lr, weight_decay, mesh=None) -> Built:
    """Wrap ``model`` under scheme ``kind`` with an AdamW optimizer."""
    if kind not in BUILDERS:
        raise ValueError(f"kind={kind!r} is unknown; valid kinds: {list(KINDS)}")
    return BUILDERS[kind][1](model, {"lr": lr, "weight_decay": weight_decay}, mesh)


def train_rank(rank, world_size, kinds=KINDS, steps=4, measure_step=2, *, preset="tiny", global_batch=8,
               seq_len=32, lr=3e-3, weight_decay=0.1, seed=0, save=None, resume=None, threads=1):
    """Train under each scheme in ``kinds``; return {kind: results} for this rank.

    Results: ``losses``, ``memory`` (max bytes by category over the measured step), ``comm``
    (its collectives), ``seconds`` (mean of the unmeasured steps after the first), ``n_params``,
    ``groups`` (Ψ of each flat group), ``state_on`` (devices of the per-element optimizer
    states), on rank 0 ``params`` (the full state dict as NumPy arrays).
    ``save={"dir": d, "at": k}``: after step k, each kind of ``d`` ({kind: folder}, or zero3's
    folder) saves its shards. ``resume=d`` (the same form): "<kind>_resumed" loads them and trains on.
    """
    check_int("global_batch", global_batch, world_size)
    if global_batch % world_size:
        raise ValueError(f"global_batch={global_batch} must be divisible by world_size={world_size}")
    torch.set_num_threads(threads)
    device = rank_device()  # gloo ranks compute on the CPU
    mesh = None
    if any(k.startswith("fsdp2") for k in kinds):
        mesh = ParallelDims(dp_size=world_size).build_mesh(device.type)["dp"]  # torch's FSDP2: one axis
    save_dirs = checkpoint_dirs("save", save["dir"]) if save else {}
    resume_dirs = checkpoint_dirs("resume", resume) if resume else {}
    if any(k not in kinds for k in save_dirs):
        raise ValueError(f"save={save!r} names kinds that are not trained: kinds={list(kinds)}")
    run = dict(rank=rank, world_size=world_size, preset=preset, seed=seed, device=device, mesh=mesh,
               lr=lr, weight_decay=weight_decay, steps=steps, measure_step=measure_step,
               corpus=load_corpus(),  # the same token tensor for every scheme's batches
               data=dict(global_batch=global_batch, seq_len=seq_len, seed=seed))
    out = {}
    for kind in list(kinds) + [f"{k}_resumed" for k in resume_dirs]:
        base = kind.removesuffix("_resumed")
        save_to = (save_dirs[kind], save["at"]) if kind in save_dirs else None
        out[kind] = _train_kind(base, run, resume_dirs.get(base) if kind != base else None, save_to)
    return out


def _train_kind(kind, run, resume_dir, save_to) -> dict:
    """One scheme's run on this rank (see :func:`train_rank`): its results."""
    model = make_model(run["preset"], run["seed"], run["device"])
    n_tensors = len(list(model.parameters()))
    b = build(kind, model, run["lr"], run["weight_decay"], run["mesh"])
    res = {"losses": [], "n_params": count_params(model.cfg), "n_tensors": n_tensors, "seconds": [],
           "groups": list(b.groups)}
    first = load_sharded(resume_dir, b.shards, b.opt)["step"] if resume_dir else 0
    for step in range(first, run["steps"]):
        batch = rank_batch(run["corpus"], step, run["rank"], run["world_size"], device=run["device"],
                           **run["data"])
        if step == run["measure_step"] and not resume_dir:
            with CommCounter() as comm, MemoryMeter(b.meter_model, b.meter_opt) as meter:
                loss = train_step(b.net, b.opt, batch, meter=meter, keep_loss=True)
            res["losses"].append(loss.item())
            rep = meter.report()
            res["memory"] = {**rep.max_by_category, "peak": rep.peak_bytes}
            res["comm"] = comm.stats.as_dict()
        else:
            t0 = time.perf_counter()
            res["losses"].append(train_step(b.net, b.opt, batch, keep_loss=True).item())
            if step > first:  # the first step warms up (allocations, DDP's buckets): not timed
                res["seconds"].append(time.perf_counter() - t0)
        if save_to and step + 1 == save_to[1]:
            save_sharded(save_to[0], b.shards, b.opt, extra={"step": step + 1})
    res["seconds"] = sum(res["seconds"]) / max(len(res["seconds"]), 1)
    state = b.full_state()
    if run["rank"] == 0:
        res["params"] = portable(state)
    if isinstance(b.net, DataParallelBucketed):
        res["buckets"], res["launched_in_backward"] = len(b.net._buckets), b.net.launched_in_backward
    res["params_on"] = sorted({p.device.type for p in b.net.parameters()})
    # per-element states only: torch keeps Adam's 0-d step counter on the CPU, whatever the device
    res["state_on"] = sorted({t.device.type for t in optimizer_tensors(b.meter_opt) if t.dim()})
    return res


def checkpoint_dirs(name, value):
    """{kind: folder} from ``save["dir"]`` or ``resume``: a dict, or one folder for zero3."""
    dirs = dict(value) if isinstance(value, dict) else {"zero3": value}
    for kind in dirs:
        if kind not in RESUMABLE:
            raise ValueError(f"{name} names kind={kind!r}, which has no sharded checkpoint; "
                             f"valid kinds: {list(RESUMABLE)}")
    return dirs


def portable(state: dict) -> dict:
    """Tensors as NumPy arrays: a rank's result must not refer to its (soon gone) shared memory."""
    return {k: v.detach().float().cpu().numpy() for k, v in state.items()}
