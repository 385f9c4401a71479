"""What Chapter 5's ranks run: labkit's tensor parallelism against the unsharded model and against
PyTorch's DTensor version, its memory and collectives measured, and TP composed with ZeRO-1.

``tp_rank`` serves the lab, the tests and the benchmark; launch it with
``labkit.dist.launch(tp_rank, world_size, cfg, ...)``. Each tp_size in ``tp_sizes`` runs over the
"tp" axis of a (world_size / t, t) device mesh; every rank sees the same batch.
"""

from __future__ import annotations

import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from ..checkpoint import apply_checkpointing
from ..data import get_batch, load_corpus
from ..dist import CommCounter, rank_device
from ..memory import MemoryMeter
from ..model import build_model
from ..tensor_parallel import RECOMPUTE, apply_tensor_parallel, sync_sequence_parallel_grads
from ..zero import ShardedOptimizer

__all__ = ["tp_rank", "tp_zero1_rank", "bench_rank", "apply_dtensor_tp", "dtensor_forward", "make_batch",
           "reference_step", "sharded_like"]


def make_batch(cfg, batch_size: int, seed: int = 0, device="cpu"):
    """(x, y) (B, T) int64 from the shipped corpus, the same on every rank for a seed."""
    return get_batch(load_corpus(), batch_size, cfg.seq_len, generator=torch.Generator().manual_seed(seed),
                     device=device)


def reference_step(model, x, y):
    """Logits, loss and gradients of the unsharded model (gradients left in ``.grad``)."""
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(x)  # (B, T, V)
    loss = model(x, y)
    loss.backward()
    return logits, loss.detach()


def sharded_like(full_model, group, sequence_parallel: bool, grads: bool = False) -> dict:
    """name -> this rank's shard of each parameter (or of its gradient) of ``full_model``, cut
    by the same ``apply_tensor_parallel`` whose output is being checked."""
    twin = copy.deepcopy(full_model)
    if grads:
        for p, q in zip(twin.parameters(), full_model.parameters()):
            p.data = q.grad.detach().clone()
    apply_tensor_parallel(twin, group, sequence_parallel)
    return {n: p.detach() for n, p in twin.named_parameters()}


def _sharded_copy(full, group, sequence_parallel, shard=True):
    """A copy of ``full`` without its gradients, sharded over ``group`` (or left whole)."""
    model = copy.deepcopy(full)
    model.zero_grad(set_to_none=True)
    return apply_tensor_parallel(model, group, sequence_parallel) if shard else model


def _shard_check(model, want: dict, grads: bool) -> dict:
    """name -> (max |ours - want|, max |want|), over this rank's parameters or gradients."""
    out = {}
    for n, p in model.named_parameters():
        ours = (p.grad if grads else p).detach()
        out[n] = ((ours - want[n]).abs().max().item(), want[n].abs().max().item())
    return out


def _activations(model, x, y, measure: bool = True) -> tuple[int, int] | None:
    """(activation bytes kept at the end of forward, parameter bytes) measured by the meter.

    ``measure=False``: the same step unmeasured (the other ranks' half of its collectives).
    """
    if not measure:
        model(x, y).backward()
        return None
    with MemoryMeter(model) as meter:
        with meter.phase("forward"):
            loss = model(x, y)
        with meter.phase("backward"):
            loss.backward()
            del loss
    model.zero_grad(set_to_none=True)
    report = meter.report()
    return report.activations, report.max_by_category["parameters"]


def _layer_collectives(model, cfg, batch_size, t, sp, dev):
    """The collectives of one block's forward and of its backward, counted separately."""
    block = model.blocks[0]
    T = cfg.seq_len // t if sp else cfg.seq_len
    h = torch.randn(batch_size, T, cfg.d_model, device=dev, requires_grad=True)  # same seed on every rank
    with CommCounter() as fwd:
        out = block(h)
    with CommCounter() as bwd:
        out.sum().backward()
    model.zero_grad(set_to_none=True)
    return {"forward": dict(fwd.stats.calls), "backward": dict(bwd.stats.calls),
            "bytes": {"forward": dict(fwd.stats.bytes), "backward": dict(bwd.stats.bytes)}}


def _qkv_by_rank(w, t):
    """Rows of c_attn reordered so that a contiguous 1/t slice is [q_r; k_r; v_r] (rank r's heads)."""
    n = w.size(0)
    return w[torch.arange(n).view(3, t, n // (3 * t)).transpose(0, 1).reshape(-1)]


def apply_dtensor_tp(model, mesh, sequence_parallel: bool = False):
    """The same sharding with PyTorch's DTensor API (``parallelize_module``); returns the model.

    ``ColwiseParallel`` takes contiguous rows, so c_attn's rows are first reordered by rank.
    With ``sequence_parallel`` run it through :func:`dtensor_forward`, which shards the positions.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    t = mesh.size()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.c_attn.weight.copy_(_qkv_by_rank(block.attn.c_attn.weight, t))
            block.attn.c_attn.bias.copy_(_qkv_by_rank(block.attn.c_attn.bias, t))
    out = Shard(1) if sequence_parallel else Replicate()
    for block in model.blocks:
        plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(output_layouts=out),
                "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(output_layouts=out)}
        if sequence_parallel:
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan.update({"ln_1": SequenceParallel(), "attn": gather, "ln_2": SequenceParallel(), "mlp": gather})
        parallelize_module(block, mesh, plan)
    top = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=out),
           "lm_head": ColwiseParallel(input_layouts=out, output_layouts=Replicate())}
    if sequence_parallel:
        top["ln_f"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    model.lm_head.weight = model.wte.weight  # re-tie: both are the same Shard(0) DTensor
    return model


def dtensor_forward(model, idx, mesh, sequence_parallel: bool):
    """Logits (B, T, V) of a model from :func:`apply_dtensor_tp` (with SP, positions sharded here)."""
    if not sequence_parallel:
        return model(idx)
    t, r = mesh.size(), mesh.get_local_rank()
    x = model.wte(idx) + model.wpe(torch.arange(idx.size(1), device=idx.device).view(t, -1)[r])  # (B, T/t, C)
    for block in model.blocks:
        x = block(x)
    return model.lm_head(model.ln_f(x))


def tp_rank(rank, world_size, cfg, batch_size=2, tp_sizes=None, dtensor=True, recomputes=RECOMPUTE):
    """For each t in ``tp_sizes`` (default: world_size) and with/without sequence parallelism:
    logits, loss and gradients against the unsharded model, collectives counted, DTensor's
    logits and loss, and (on rank 0, whose shards are the size of every rank's) activation and
    parameter bytes measured per recomputation policy; a dict."""
    dev = rank_device()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # several ranks share a few cores: one thread each is faster
    x, y = make_batch(cfg, batch_size, device=dev)
    torch.manual_seed(0)
    full = build_model(cfg, device=dev)
    ref_logits, ref_loss = reference_step(full, x, y)
    results = {"ref_loss": ref_loss.item()}
    for t in tp_sizes or (world_size,):
        mesh = init_device_mesh(dev.type, (world_size // t, t), mesh_dim_names=("dp", "tp"))
        group = mesh.get_group("tp")
        for sp in (False, True):
            res = results[(t, sp)] = {"tp_rank": dist.get_rank(group)}
            model = _sharded_copy(full, group, sp)
            with CommCounter() as comm:
                loss = model(x, y)
                loss.backward()
                sync_sequence_parallel_grads(model, group)
            res["comm"], res["loss"] = comm.stats.as_dict(), loss.item()
            res["grads"] = _shard_check(model, sharded_like(full, group, sp, grads=True), grads=True)
            with torch.no_grad():
                res["logits"] = model(x).cpu()  # (B, T, V/t): this rank's vocabulary columns
            res["layer_comm"] = _layer_collectives(model, cfg, batch_size, t, sp, dev)
            if recomputes:
                res["memory"] = {}
                for recompute in recomputes:
                    m = _sharded_copy(full, group, sp)
                    if recompute != "none":
                        apply_checkpointing(m, recompute)
                    res["memory"][recompute] = _activations(m, x, y, measure=rank == 0)
            if dtensor:
                tmesh = mesh["tp"]
                ref = apply_dtensor_tp(copy.deepcopy(full), tmesh, sp)
                with torch.no_grad():
                    res["dtensor_logits"] = dtensor_forward(ref, x, tmesh, sp).cpu()  # (B, T, V)
                res["dtensor_loss"] = F.cross_entropy(dtensor_forward(ref, x, tmesh, sp).flatten(0, 1),
                                                      y.flatten()).item()
    if recomputes and rank == 0:
        results["memory_t1"] = _activations(_sharded_copy(full, None, False, shard=False), x, y)
    results["ref_logits"] = ref_logits.cpu()
    return results


def _timed(step, n, dev):
    """The best of ``n`` timed calls after one warm-up (seconds)."""
    times = []
    for _ in range(n + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def bench_rank(rank, world_size, cfg, batch_size=2, tp_sizes=(1, 2, 4), steps=5, sequence_parallel=False):
    """Step time (best of ``steps``) and bytes sent per rank, labkit's TP and DTensor's, per t."""
    dev = rank_device()
    if dev.type == "cpu":
        torch.set_num_threads(max(os.cpu_count() // world_size, 1))  # the ranks share the cores
    x, y = make_batch(cfg, batch_size, device=dev)
    torch.manual_seed(0)
    full = build_model(cfg, device=dev)
    out = {}
    for t in tp_sizes:
        mesh = init_device_mesh(dev.type, (world_size // t, t), mesh_dim_names=("dp", "tp"))
        group, sp = mesh.get_group("tp"), sequence_parallel and t > 1
        ours = _sharded_copy(full, group, sp, shard=t > 1)
        theirs = apply_dtensor_tp(copy.deepcopy(full), mesh["tp"], sp) if t > 1 else copy.deepcopy(full)

        def ours_step():
            ours(x, y).backward()
            sync_sequence_parallel_grads(ours, group)

        def theirs_step():
            logits = dtensor_forward(theirs, x, mesh["tp"], sp) if t > 1 else theirs(x)
            F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()

        for name, step in (("labkit", ours_step), ("dtensor", theirs_step)):
            with CommCounter() as comm:
                step()
            out[(t, name)] = {"seconds": _timed(step, steps, dev), "bytes": sum(comm.stats.bytes.values()),
                              "calls": sum(comm.stats.calls.values())}
    return out


def tp_zero1_rank(rank, world_size, cfg, batch_size=4, steps=3, lr=3e-3, dp_size=2, sequence_parallel=False):
    """TP over the mesh's "tp" axis, labkit's ZeRO-1 over its "dp" axis, against one process.

    Each data-parallel rank trains on its rows of the global batch; returns per-rank losses and
    the (max |ours - one process|, max |one process|) of every parameter shard at the end.
    """
    dev = rank_device()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    tp_size = world_size // dp_size
    mesh = init_device_mesh(dev.type, (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    dp_rank = dist.get_rank(dp_group)
    torch.manual_seed(0)
    full = build_model(cfg, device=dev)
    single = copy.deepcopy(full)
    model = _sharded_copy(full, tp_group, sequence_parallel)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, group=dp_group, lr=lr)
    ref_opt = torch.optim.AdamW(single.parameters(), lr=lr)
    rows = batch_size // dp_size
    losses, ref_losses = [], []
    for step in range(steps):
        x, y = make_batch(cfg, batch_size, seed=step, device=dev)
        loss = model(x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows])
        loss.backward()
        sync_sequence_parallel_grads(model, tp_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        ref_loss = single(x, y)  # one process, the whole global batch
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(ref_loss.item())
    want = sharded_like(single, tp_group, sequence_parallel)
    return {"losses": losses, "ref_losses": ref_losses, "dp_rank": dp_rank,
            "params": _shard_check(model, want, grads=False)}
