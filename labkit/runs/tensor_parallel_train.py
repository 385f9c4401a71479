"""Chapter 5's training runs: a plain loop over the sharded model, and TP composed with ZeRO-1,
each against one process training the unsharded model (in float32 and float64, see
:mod:`.tensor_parallel_ref`).

SGD, not AdamW: Adam divides each gradient by its own running magnitude, so where a gradient is
near zero it turns round-off into steps of lr; SGD passes round-off through unmagnified.
"""

from __future__ import annotations

import copy

import torch

from ..dist import CommCounter, rank_device
from ..model import build_model
from ..parallel import ParallelDims, parallelize_gpt
from ..tensor_parallel import sync_sequence_parallel_grads
from .tensor_parallel_ref import (check_mesh, make_batch, named_tensors, roundoff, roundoff_named, sharded_copy,
                                  sharded_like)

__all__ = ["train_single", "tp_train_rank", "tp_zero1_rank"]


def train_single(model, batches, lr: float) -> list[float]:
    """One process, a plain SGD loop over ``batches`` of (x, y); the losses (``model`` is trained)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _references(full, batches, lr) -> dict:
    """{"32"/"64": (losses, trained model)}: the unsharded model trained in float32 and float64."""
    out = {}
    for key, model in (("32", copy.deepcopy(full)), ("64", copy.deepcopy(full).double())):
        out[key] = (train_single(model, batches, lr), model)
    return out


def _plain_loop(model, batches, opt, group) -> tuple[list[float], int]:
    """zero_grad, backward, step; step 1 accumulates two half-batch backward passes, and the last
    step calls ``sync_sequence_parallel_grads`` twice: the collectives those calls issued."""
    losses, explicit_calls = [], 0
    for k, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        if k == 1:
            h, loss = x.size(0) // 2, 0.0
            for rows in (slice(0, h), slice(h, None)):  # two halves of equal token counts: mean / 2 each
                part = model(x[rows], y[rows]) / 2
                part.backward()
                loss = loss + part.detach()
        else:
            loss = model(x, y)
            loss.backward()
        if k == len(batches) - 1:
            with CommCounter() as comm:  # the reduction already ran at the end of backward
                sync_sequence_parallel_grads(model, group)
                sync_sequence_parallel_grads(model, group)
            explicit_calls = sum(comm.stats.calls.values())
        opt.step()
        losses.append(loss.item())
    return losses, explicit_calls


def tp_train_rank(rank, world_size, cfg, tp_sizes=(2, 4), steps=3, lr=0.1, batch_size=2, sequence_parallel=True):
    """A plain training loop over ``apply_tensor_parallel(model, group, sequence_parallel)`` for
    each t, against one process: {t: {"losses", "params": (error, floor), "explicit_calls",
    "reductions"}} (``reductions``: end-of-backward sums of the sequence-parallel gradients)."""
    tp_sizes = check_mesh(world_size, tp_sizes)
    dev = rank_device()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    full = build_model(cfg, device=dev)
    batches = [make_batch(cfg, batch_size, seed=k, device=dev) for k in range(steps)]
    refs = _references(full, batches, lr)
    out = {}
    for t in tp_sizes:
        group = ParallelDims(dp_size=world_size // t, tp_size=t).build_mesh(dev.type).get_group("tp")
        model = sharded_copy(full, group, sequence_parallel)
        losses, explicit = _plain_loop(model, batches, torch.optim.SGD(model.parameters(), lr=lr), group)
        want = {k: sharded_like(m, group, sequence_parallel) for k, (_, m) in refs.items()}
        sync = getattr(model, "_sp_grad_sync", None)
        out[t] = {"losses": roundoff(torch.tensor(losses), torch.tensor(refs["32"][0]),
                                     torch.tensor(refs["64"][0], dtype=torch.float64)),
                  "params": roundoff_named(named_tensors(model), want["32"], want["64"]),
                  "explicit_calls": explicit, "reductions": None if sync is None else sync.reductions}
    return out


def tp_zero1_rank(rank, world_size, cfg, batch_size=4, steps=3, lr=0.1, dp_size=2, sequence_parallel=False):
    """TP over the mesh's "tp" axis, labkit's ZeRO-1 over its "dp" axis (composed by
    :func:`labkit.parallel.parallelize_gpt`), a plain SGD loop, against one process on the whole
    batch: per-rank losses, the one process's (float32 and float64) and the (error, floor) of
    every parameter shard at the end."""
    check_mesh(world_size, dp_size=dp_size, batch_size=batch_size)
    dev = rank_device()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    dims = ParallelDims(dp_size=dp_size, tp_size=world_size // dp_size)
    mesh = dims.build_mesh(dev.type)
    torch.manual_seed(0)
    full = build_model(cfg, device=dev)
    batches = [make_batch(cfg, batch_size, seed=k, device=dev) for k in range(steps)]
    refs = _references(full, batches, lr)
    pm = parallelize_gpt(sharded_copy(full, None, sequence_parallel, shard=False), dims, mesh,
                         sequence_parallel=sequence_parallel, zero_stage=1)
    opt = pm.build_optimizer(torch.optim.SGD, lr=lr)
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        losses.append(pm.forward_backward(*pm.shard_batch(x, y)))
        opt.step()
    want = {k: sharded_like(m, mesh.get_group("tp"), sequence_parallel) for k, (_, m) in refs.items()}
    return {"losses": losses, "ref_losses": {k: r[0] for k, r in refs.items()}, "dp_rank": pm.coords.dp,
            "params": roundoff_named(named_tensors(pm.model), want["32"], want["64"])}
