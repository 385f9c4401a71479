"""What Chapter 11's ranks run: a MoE GPT trained with its experts sharded over "ep" against one
process, the all-to-all bytes counted, the model states a rank keeps against ep (the memory
meter), and the benchmark's steps: ep against experts replicated, balanced and skewed routing.

Launch with ``labkit.dist.launch(fn, world_size, ...)``; every rank builds the same seeded model
and the same global batch, so each can compare its share with one process doing all of it.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..dist import CommCounter
from ..memory import MemoryMeter
from ..model import build_model
from ..moe import moe_layers
from ..parallel import ParallelDims, parallelize_gpt

__all__ = ["ep_train_rank", "ep_memory_rank", "ep_bench_rank", "moe_model", "global_batch", "steer_to_rank"]


def moe_model(cfg, dtype=torch.float64, router_std: float = 1.0):
    """The seeded model every rank builds; the router drawn far from uniform (std ``router_std``)
    so that tokens differ in their experts from the first step."""
    torch.manual_seed(0)
    model = build_model(cfg, dtype=dtype)
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.router.weight.normal_(0, router_std)
    return model


def global_batch(cfg, n_seqs: int, step: int):
    """(x, y), (n_seqs, seq_len) each: random token ids and the ids shifted by one, from ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, cfg.vocab_size, (n_seqs, cfg.seq_len), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _reference(cfg, world_size, steps, seqs_per_rank, lr):
    """One process: each step the mean over the world's shards of their losses, then SGD."""
    model = moe_model(cfg)
    opt, losses = torch.optim.SGD(model.parameters(), lr=lr), []
    for step in range(steps):
        x, y = global_batch(cfg, seqs_per_rank * world_size, step)
        opt.zero_grad(set_to_none=True)
        shard = []
        for xs, ys in zip(x.chunk(world_size), y.chunk(world_size)):
            loss = model(xs, ys)
            (loss / world_size).backward()
            shard.append(loss.item())
        opt.step()
        losses.append(shard)
    return model, losses


def ep_train_rank(rank, world_size, cfg, steps=3, seqs_per_rank=2, lr=0.2):
    """``steps`` SGD steps of ``cfg`` (float64) with dp = ep = world_size, and one process on the
    same global batches: this rank's losses and the reference's, the largest gap between this
    rank's parameters (its E / ep experts) and the reference's, and per step the all-to-all bytes
    CommCounter saw and the rows each MoE layer dispatched (after any capacity drop)."""
    dims = ParallelDims(dp_size=world_size, ep_size=world_size)
    pm = parallelize_gpt(moe_model(cfg), dims, dims.build_mesh("cpu"))
    opt = pm.build_optimizer(torch.optim.SGD, lr=lr)
    losses, counted = [], []
    for step in range(steps):
        x, y = global_batch(cfg, seqs_per_rank * world_size, step)
        opt.zero_grad(set_to_none=True)
        with CommCounter() as comm:
            losses.append(pm.forward_backward(*pm.shard_batch(x, y)))
        counted.append({"all_to_all": comm.stats.bytes["all_to_all"],
                        "rows": [m.kept for m in moe_layers(pm.model)]})
        opt.step()
    ref, ref_losses = _reference(cfg, world_size, steps, seqs_per_rank, lr)
    n_local = cfg.n_experts // world_size
    ref_state, gap = dict(ref.named_parameters()), 0.0
    for name, value in pm.full_state().items():
        want = ref_state[name].detach()
        if ".experts." in name:  # this rank's experts: rank r E/ep .. (r + 1) E/ep - 1
            want = want[rank * n_local:(rank + 1) * n_local]
        gap = max(gap, (value - want).abs().max().item())
    return {"losses": losses, "ref_losses": [s[rank] for s in ref_losses], "param_gap": gap, "counted": counted}


def ep_memory_rank(rank, world_size, cfg, ep_sizes=(1, 2, 4), seqs_per_rank=1):
    """Per ep in ``ep_sizes`` (dp = world_size): the model states this rank holds during one Adam
    step (float32), as the memory meter counted them: parameters, gradients, optimizer bytes."""
    out = {}
    for ep in ep_sizes:  # new_group is collective: every rank builds every layout, in order
        dims = ParallelDims(dp_size=world_size, ep_size=ep)
        pm = parallelize_gpt(moe_model(cfg, torch.float32), dims, dims.build_mesh("cpu"))
        opt = pm.build_optimizer(torch.optim.Adam, lr=1e-3)
        x, y = pm.shard_batch(*global_batch(cfg, seqs_per_rank * world_size, 0))
        with MemoryMeter(pm.model, opt) as meter:
            pm.forward_backward(x, y)
            opt.step()
        peak = meter.report().max_by_category
        out[ep] = {k: peak[k] for k in ("parameters", "gradients", "optimizer")}
        dist.barrier()
    return out


def steer_to_rank(model, ep_size: int, rank: int = 0, strength: float = 10.0) -> None:
    """Skew the routing: the selection bias of every MoE layer (``router_bias=True``) raised by
    ``strength`` on the E / ep experts ``rank`` of the ep group holds, so every token picks them
    (k must not exceed E / ep)."""
    for layer in moe_layers(model):
        n_local = layer.n_experts // ep_size
        layer.expert_bias.zero_()
        layer.expert_bias[rank * n_local:(rank + 1) * n_local] = strength


def _rows_computed(pm, dims, rank) -> int:
    """Rows this rank's experts ran in the last step (dropless), summed over the MoE layers: the
    loads every rank routed to them, gathered from the ranks of its ep group."""
    load = torch.stack([m.load for m in moe_layers(pm.model)]).sum(0)  # (E,), this rank's routing
    every = [torch.empty_like(load) for _ in range(dist.get_world_size())]
    dist.all_gather(every, load)
    group = next(g for g in dims.expert_groups()[0] if rank in g) if dims.ep_size > 1 else [rank]
    n_local = load.numel() // dims.ep_size
    j = group.index(rank)
    return int(sum(every[r][j * n_local:(j + 1) * n_local].sum().item() for r in group))


def ep_bench_rank(rank, world_size, cfg, ep_sizes=(1, 2, 4), seqs_per_rank=4, repeats=3):
    """Per ep (dp = world_size; ep = 1: every expert replicated on every rank) and per routing
    ("balanced": the router's own; "skewed": every token to the first ep rank's experts): seconds
    of one SGD step (forward, backward, gradient reduction, step; float32), all-to-all bytes this
    rank's counter saw and its all-reduce bytes (the gradients), the rows each of its MoE layers
    dispatched and the rows its experts computed (all layers), and the expert parameters it holds."""
    out = {}
    for ep in ep_sizes:
        if ep > cfg.n_experts or world_size % ep:
            continue
        dims = ParallelDims(dp_size=world_size, ep_size=ep)
        for routing in ("balanced", "skewed"):
            pm = parallelize_gpt(moe_model(cfg, torch.float32, router_std=0.02), dims, dims.build_mesh("cpu"))
            if routing == "skewed":
                steer_to_rank(pm.model, ep)
            opt = pm.build_optimizer(torch.optim.SGD, lr=1e-3)
            x, y = pm.shard_batch(*global_batch(cfg, seqs_per_rank * world_size, 0))

            def step():
                opt.zero_grad(set_to_none=True)
                pm.forward_backward(x, y)
                opt.step()
            step()  # warm-up
            for m in moe_layers(pm.model):
                m.load.zero_()
            with CommCounter() as comm:
                step()
            computed = _rows_computed(pm, dims, rank)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeats):
                step()
            dist.barrier()  # the step of the slowest rank
            out[(ep, routing)] = {
                "seconds": (time.perf_counter() - start) / repeats, "all_to_all": comm.stats.bytes["all_to_all"],
                "all_reduce": comm.stats.bytes["all_reduce"],
                "rows": [m.kept for m in moe_layers(pm.model)], "computed": computed,
                "expert_params": sum(p.numel() for n, p in pm.model.named_parameters() if ".experts." in n)}
    return out
