"""What each rank runs in Chapter 2's lab, tests and benchmark.

``train_rank(rank, world_size, kinds, ...)`` trains the tiny GPT under each data-parallel
scheme in ``kinds`` on the same global batches, measures one step with the memory meter and
the communication counter, and returns per-rank results; pass it to :func:`labkit.dist.launch`.
``reference_run`` trains the same model in one process on the whole batch.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from ..data import get_batch, load_corpus
from ..dist import CommCounter
from ..memory import MemoryMeter, optimizer_tensors
from ..model import Block, build_model, count_params
from .checkpoint import CheckpointError, load_sharded, save_sharded
from .ddp import DataParallelBucketed, DataParallelNaive
from .offload import OffloadOptimizer
from .stage1 import ShardedOptimizer
from .stage2 import ShardedGradOptimizer
from .stage3 import FullyShardedModule
from .toy import ToyNet, toy_build, toy_rank

__all__ = ["KINDS", "RESUMABLE", "STAGE", "reference_run", "train_rank"]

# scheme -> ZeRO stage it implements (0: plain data parallelism)
STAGE = {"ddp_torch": 0, "ddp_naive": 0, "ddp_bucketed": 0, "zero1": 1, "zero1_ddp": 1, "zero1_torch": 1,
         "zero2": 2, "offload": 2, "zero3": 3, "fsdp2": 3, "zero3_bf16": 3, "fsdp2_bf16": 3}
KINDS = tuple(STAGE)
RESUMABLE = ("zero1", "zero2", "zero3")  # the kinds that save and load sharded checkpoints


def _batch(corpus, step, rank, world_size, global_batch, seq_len, seed, device="cpu"):
    """Rank ``rank``'s rows of the global batch of ``step``: the same data at any world size."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    x, y = get_batch(corpus, global_batch, seq_len, generator=gen)  # (B, T) each
    b = global_batch // world_size
    return x[rank * b:(rank + 1) * b].to(device), y[rank * b:(rank + 1) * b].to(device)


def _model(preset, seed, device):
    torch.manual_seed(seed)  # the same initial parameters on every rank
    return build_model(preset, device=device)


def _optimizer_kwargs(lr, weight_decay):
    return {"lr": lr, "weight_decay": weight_decay}


def reference_run(steps=4, *, preset="tiny", global_batch=8, seq_len=32, lr=3e-3, weight_decay=0.1, seed=0):
    """Single-process training on the whole global batch: (losses, final state dict)."""
    model = _model(preset, seed, "cpu")
    opt = torch.optim.AdamW(model.parameters(), **_optimizer_kwargs(lr, weight_decay))
    corpus, losses = load_corpus(), []
    for step in range(steps):
        loss = model(*_batch(corpus, step, 0, 1, global_batch, seq_len, seed))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


class _StateView(nn.Module):
    """The model's parameters and the optimizer's slices, so the meter labels both (and their grads)."""

    def __init__(self, model, slices):
        super().__init__()
        self.model = model
        seen = {id(p) for p in model.parameters()}
        self.slices = nn.ParameterList([s for s in slices if id(s) not in seen])


def _build(kind, model, lr, weight_decay, mesh=None):
    """(net, optimizer, full_state_dict fn, sharded object, meter module, n flat groups) for ``kind``."""
    kw = _optimizer_kwargs(lr, weight_decay)
    adamw = torch.optim.AdamW
    if kind in ("ddp_torch", "zero1_ddp", "zero1_torch"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        try:  # the causal mask never changes: no buffer broadcast in each forward
            net = DDP(model, forward_sync_buffers=False)
        except TypeError:  # torch < 2.13
            net = DDP(model, broadcast_buffers=False)
        if kind == "ddp_torch":
            opt = adamw(net.parameters(), **kw)
        elif kind == "zero1_ddp":
            opt = ShardedOptimizer(net.parameters(), adamw, reduce_grads=False, **kw)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=adamw, **kw)
        return net, opt, model.state_dict, model
    if kind in ("ddp_naive", "ddp_bucketed"):
        net = (DataParallelNaive if kind == "ddp_naive" else DataParallelBucketed)(model)
        return net, adamw(net.parameters(), **kw), model.state_dict, model
    if kind in ("zero1", "zero2", "offload"):
        cls = {"zero1": ShardedOptimizer, "zero2": ShardedGradOptimizer, "offload": OffloadOptimizer}[kind]
        opt = cls(model.parameters(), adamw, **kw)
        slices = [s for _, _, _, s in opt.shard_entries()]  # offloaded ones are labelled optimizer states
        return model, opt, model.state_dict, _StateView(model, slices)
    if kind in ("zero3", "zero3_bf16"):
        net = FullyShardedModule(model, unit_types=(Block,),
                                 compute_dtype=torch.bfloat16 if kind == "zero3_bf16" else None)
        return net, adamw(net.parameters(), **kw), net.full_state_dict, net
    if kind in ("fsdp2", "fsdp2_bf16"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) \
            if kind == "fsdp2_bf16" else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        full = lambda: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        return model, adamw(model.parameters(), **kw), full, model
    raise ValueError(f"kind={kind!r} is unknown; valid kinds: {list(KINDS)}")


def _step(net, opt, batch, meter=None):
    def phase(name):
        return meter.phase(name) if meter is not None else contextlib.nullcontext()
    with phase("forward"):
        loss = net(*batch)
    with phase("backward"):
        loss.backward()
    with phase("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.item()


def train_rank(rank, world_size, kinds=KINDS, steps=4, measure_step=2, *, preset="tiny", global_batch=8,
               seq_len=32, lr=3e-3, weight_decay=0.1, seed=0, save=None, resume=None, bad_checkpoints=(),
               save_other=None, check_refusals=False, toy_kinds=(), threads=1):
    """Train under each scheme in ``kinds``; return {kind: results} for this rank.

    Results: ``losses``, ``memory`` (max bytes by category over the measured step), ``comm``
    (its collectives), ``seconds`` (mean of the unmeasured steps after the first), ``n_params``,
    ``groups`` (Ψ of each flat group), ``state_on`` (devices of the per-element optimizer
    states), on rank 0 ``params`` (the full state dict as NumPy arrays).
    ``save={"dir": d, "at": k}``: after step k, each kind of ``d`` ({kind: folder}, or zero3's
    folder) saves its shards. ``resume=d`` (the same form): "<kind>_resumed" loads them and trains
    on; "zero3_resumed" then tries each of ``bad_checkpoints``. ``save_other=d``: a ToyNet checkpoint.
    ``check_refusals``: answers to parameters that differ across ranks. ``toy_kinds``: toy_rank.
    """
    if global_batch % world_size:
        raise ValueError(f"global_batch={global_batch} must be divisible by world_size={world_size}")
    torch.set_num_threads(threads)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # gloo ranks compute on the CPU
    mesh = None
    if any(k.startswith("fsdp2") for k in kinds):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device, (world_size,))
    save_dirs = _checkpoint_dirs("save", save["dir"]) if save else {}
    resume_dirs = _checkpoint_dirs("resume", resume) if resume else {}
    if any(k not in kinds for k in save_dirs):
        raise ValueError(f"save={save!r} names kinds that are not trained: kinds={list(kinds)}")
    if bad_checkpoints and "zero3" not in resume_dirs:
        raise ValueError(f"bad_checkpoints are tried by zero3_resumed: resume={resume!r} must include zero3")
    cfg = dict(global_batch=global_batch, seq_len=seq_len, seed=seed)
    corpus = load_corpus()  # the same token tensor for every scheme's batches
    out = {}
    for kind in list(kinds) + [f"{k}_resumed" for k in resume_dirs]:
        base = kind.removesuffix("_resumed")
        resumed = kind != base
        model = _model(preset, seed, device)
        n_tensors = len(list(model.parameters()))
        net, opt, full_state, meter_model = _build(base, model, lr, weight_decay, mesh)
        shards = net if isinstance(net, FullyShardedModule) else opt  # what holds the shard entries
        res = {"losses": [], "n_params": count_params(model.cfg), "n_tensors": n_tensors, "seconds": [],
               "groups": _group_numels(net, opt)}
        first = load_sharded(resume_dirs[base], shards, opt)["step"] if resumed else 0
        for step in range(first, steps):
            batch = _batch(corpus, step, rank, world_size, device=device, **cfg)
            if step == measure_step and not resumed:
                with CommCounter() as comm, MemoryMeter(meter_model, getattr(opt, "optim", opt)) as meter:
                    res["losses"].append(_step(net, opt, batch, meter))
                rep = meter.report()
                res["memory"] = {**rep.max_by_category, "peak": rep.peak_bytes}
                res["comm"] = comm.stats.as_dict()
            else:
                t0 = time.perf_counter()
                res["losses"].append(_step(net, opt, batch))
                if step > first:  # the first step warms up (allocations, DDP's buckets): not timed
                    res["seconds"].append(time.perf_counter() - t0)
            if kind in save_dirs and step + 1 == save["at"]:
                save_sharded(save_dirs[kind], shards, opt, extra={"step": step + 1})
        if kind == "zero3_resumed" and bad_checkpoints:
            out["bad_checkpoints"] = _try_bad_checkpoints(net, opt, bad_checkpoints)
        res["seconds"] = sum(res["seconds"]) / max(len(res["seconds"]), 1)
        state = full_state()
        if rank == 0:
            res["params"] = _portable(state)
        if isinstance(net, DataParallelBucketed):
            res["buckets"], res["launched_in_backward"] = len(net._buckets), net.launched_in_backward
        res["params_on"] = sorted({p.device.type for p in net.parameters()})
        # per-element states only: torch keeps Adam's 0-d step counter on the CPU, whatever the device
        res["state_on"] = sorted({t.device.type for t in optimizer_tensors(getattr(opt, "optim", opt)) if t.dim()})
        out[kind] = res
    if save_other:
        net, opt, _ = toy_build("zero3")
        save_sharded(save_other, net, opt, extra={"step": 0})
    if check_refusals:
        out["refusals"] = _refusals(rank, world_size)
    if toy_kinds:
        out["toy"] = toy_rank(rank, world_size, toy_kinds)
    return out


def _checkpoint_dirs(name, value):
    """{kind: folder} from ``save["dir"]`` or ``resume``: a dict, or one folder for zero3."""
    dirs = dict(value) if isinstance(value, dict) else {"zero3": value}
    for kind in dirs:
        if kind not in RESUMABLE:
            raise ValueError(f"{name} names kind={kind!r}, which has no sharded checkpoint; "
                             f"valid kinds: {list(RESUMABLE)}")
    return dirs


def _try_bad_checkpoints(net, opt, dirs):
    """Load each damaged checkpoint: (error message, whether shards and states stayed unchanged)."""
    def snapshot():
        return [t.detach().clone() for t in list(net.parameters()) + optimizer_tensors(opt)]
    results = []
    for d in dirs:
        before = snapshot()
        try:
            load_sharded(d, net, opt)
            message = None
        except CheckpointError as e:
            message = str(e)
        after = snapshot()
        unchanged = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
        results.append((message, unchanged))
    return results


def _refusals(rank, world_size):
    """What each wrapper says when rank ``world_size - 1`` starts from other parameters."""
    answers = {}
    for name in ("ShardedOptimizer", "ShardedGradOptimizer", "FullyShardedModule", "DataParallelBucketed"):
        torch.manual_seed(0)
        model = ToyNet()
        if rank == world_size - 1:
            with torch.no_grad():
                model.fc2.bias[0] += 1e-3
        try:
            if name == "FullyShardedModule":
                FullyShardedModule(model, unit_types=(nn.Linear,))
            elif name == "DataParallelBucketed":
                DataParallelBucketed(model)
            else:
                cls = ShardedOptimizer if name == "ShardedOptimizer" else ShardedGradOptimizer
                cls(model.named_parameters(), torch.optim.AdamW, lr=1e-3)
            answers[name] = None
        except ValueError as e:
            answers[name] = str(e)
    return answers


def _portable(state: dict) -> dict:
    """Tensors as NumPy arrays: a rank's result must not refer to its (soon gone) shared memory."""
    return {k: v.detach().float().cpu().numpy() for k, v in state.items()}


def _group_numels(net, opt):
    if isinstance(net, FullyShardedModule):
        return net.unit_numels()
    if isinstance(opt, ShardedOptimizer):
        return opt.bucket_numels()
    return []
