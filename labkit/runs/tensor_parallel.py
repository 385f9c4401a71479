"""What Chapter 5's ranks run: labkit's tensor parallelism against the unsharded model and against
PyTorch's DTensor version, its memory and collectives measured, plain training loops, and TP
composed with ZeRO-1.

``tp_rank`` serves the lab, the tests and the benchmark; launch it with
``labkit.dist.launch(tp_rank, world_size, cfg, ...)``. Each tp_size in ``tp_sizes`` runs over the
"tp" axis of a (world_size / t, t) device mesh; every rank sees the same batch. Equivalences are
reported as (error, floor): the error against the unsharded model in float64, and the floor, the
unsharded model's own float32 error against it (:func:`roundoff`).
"""

from __future__ import annotations

import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..checkpoint import apply_checkpointing
from ..dist import CommCounter, rank_device
from ..memory import MemoryMeter
from ..model import build_model
from ..parallel import ParallelDims
from ..tensor_parallel import RECOMPUTE
from .tensor_parallel_ref import (check_mesh, make_batch, named_tensors, reference_step, roundoff, roundoff_named,
                                  sharded_copy, sharded_like)
from .tensor_parallel_train import tp_train_rank, tp_zero1_rank

__all__ = ["tp_rank", "tp_train_rank", "tp_zero1_rank", "bench_rank", "apply_dtensor_tp", "dtensor_forward",
           "make_batch", "reference_step", "sharded_like", "roundoff", "roundoff_named"]

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
        # the gradient of h runs every collective of the layer's backward (the weight gradients are
        # computed in the same Functions); the sequence-parallel gradients' sum is once per step
        torch.autograd.grad(out.sum(), h)
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


def _references(full, x, y) -> dict:
    """The unsharded model's logits, loss and gradients in float32 (``full`` itself) and float64."""
    refs = {}
    for key, m in (("32", full), ("64", copy.deepcopy(full).double())):
        logits, loss = reference_step(m, x, y)
        refs[key] = {"logits": logits.cpu(), "loss": loss.cpu(), "model": m}
    return refs


def _check_step(model, refs, x, y, group, sp) -> dict:
    """One plain step of the sharded model against the references, as (error, floor) pairs, and
    the collectives of that step (the first forward, which checks the batch, is not counted)."""
    with torch.no_grad():
        logits = model(x).cpu()  # (B, T, V) on every rank, gathered from the V/t columns
    with CommCounter() as comm:
        loss = model(x, y)
        loss.backward()  # the sequence-parallel gradients are summed at its end, by themselves
    grads = named_tensors(model, grads=True)
    want = {k: sharded_like(r["model"], group, sp, grads=True) for k, r in refs.items()}
    return {"comm": comm.stats.as_dict(), "n_grads": len(grads),
            "logits": roundoff(logits, refs["32"]["logits"], refs["64"]["logits"]),
            "loss": roundoff(loss.detach().cpu(), refs["32"]["loss"], refs["64"]["loss"]),
            "grads": roundoff_named(grads, want["32"], want["64"])}


def _dtensor_check(full, refs, x, y, mesh, sp) -> dict:
    """PyTorch's DTensor tensor parallelism on the same ranks: logits and loss as (error, floor)."""
    ref = apply_dtensor_tp(copy.deepcopy(full), mesh, sp)
    with torch.no_grad():
        logits = dtensor_forward(ref, x, mesh, sp)  # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    return {"dtensor_logits": roundoff(logits.cpu(), refs["32"]["logits"], refs["64"]["logits"]),
            "dtensor_loss": roundoff(loss.cpu(), refs["32"]["loss"], refs["64"]["loss"])}


def tp_rank(rank, world_size, cfg, batch_size=2, tp_sizes=None, dtensor=True, recomputes=RECOMPUTE):
    """For each t in ``tp_sizes`` (default: world_size) and with/without sequence parallelism:
    logits, loss and gradients against the unsharded model, collectives counted, DTensor's
    logits and loss, and (on rank 0, whose shards are the size of every rank's) activation and
    parameter bytes measured per recomputation policy; a dict."""
    tp_sizes = check_mesh(world_size, tp_sizes or (world_size,))
    dev = rank_device()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # several ranks share a few cores: one thread each is faster
    x, y = make_batch(cfg, batch_size, device=dev)
    torch.manual_seed(0)
    full = build_model(cfg, device=dev)
    refs = _references(full, x, y)
    results = {}
    for t in tp_sizes:
        mesh = ParallelDims(dp_size=world_size // t, tp_size=t).build_mesh(dev.type)
        group = mesh.get_group("tp")
        for sp in (False, True):
            model = sharded_copy(full, group, sp)
            res = results[(t, sp)] = {"tp_rank": dist.get_rank(group), **_check_step(model, refs, x, y, group, sp)}
            res["layer_comm"] = _layer_collectives(model, cfg, batch_size, t, sp, dev)
            if recomputes:
                res["memory"] = {}
                for recompute in recomputes:
                    m = sharded_copy(full, group, sp)
                    if recompute != "none":
                        apply_checkpointing(m, recompute)
                    res["memory"][recompute] = _activations(m, x, y, measure=rank == 0)
            if dtensor:
                res.update(_dtensor_check(full, refs, x, y, mesh["tp"], sp))
    if recomputes and rank == 0:
        results["memory_t1"] = _activations(sharded_copy(full, None, False, shard=False), x, y)
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
    tp_sizes = check_mesh(world_size, tp_sizes)
    dev = rank_device()
    if dev.type == "cpu":
        torch.set_num_threads(max(os.cpu_count() // world_size, 1))  # the ranks share the cores
    x, y = make_batch(cfg, batch_size, device=dev)
    torch.manual_seed(0)
    full = build_model(cfg, device=dev)
    out = {}
    for t in tp_sizes:
        mesh = ParallelDims(dp_size=world_size // t, tp_size=t).build_mesh(dev.type)
        group, sp = mesh.get_group("tp"), sequence_parallel and t > 1
        ours = sharded_copy(full, group, sp, shard=t > 1)
        theirs = apply_dtensor_tp(copy.deepcopy(full), mesh["tp"], sp) if t > 1 else copy.deepcopy(full)

        def ours_step():
            ours(x, y).backward()  # the sequence-parallel gradients are summed at its end

        def theirs_step():
            logits = dtensor_forward(theirs, x, mesh["tp"], sp) if t > 1 else theirs(x)
            F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()

        for name, step in (("labkit", ours_step), ("dtensor", theirs_step)):
            step()  # a first step: labkit's first forward also checks that the ranks' batches agree
            with CommCounter() as comm:
                step()
            out[(t, name)] = {"seconds": _timed(step, steps, dev), "bytes": sum(comm.stats.bytes.values()),
                              "calls": sum(comm.stats.calls.values())}
    return out
