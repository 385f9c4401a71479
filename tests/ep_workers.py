"""What tests/test_expert_parallel.py's ranks run, and the one-process loop they are held to."""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.comm_counter import CommCounter
from labkit.expert_parallel import all_to_all
from labkit.model import GPTConfig, build_model
from labkit.moe import MoE, moe_layers, update_expert_bias
from labkit.parallel import ParallelDims, parallelize_gpt
from labkit.tensor_parallel import apply_tensor_parallel

BASE = dict(n_layer=2, n_head=2, d_model=8, d_ff=16, vocab_size=32, seq_len=8, norm="rmsnorm", mlp="swiglu",
            pos="rope", bias=False, tie_embeddings=False, n_experts=4, experts_per_token=2, d_expert=8,
            router_bias=True)  # the selection bias steers step 0's routing (steer below)
CONFIGS = {  # name: (config, gamma of the bias update)
    "mixtral": (GPTConfig(**BASE), 0.0),
    "deepseek": (GPTConfig(**{**BASE, "n_layer": 3, "router_score": "sigmoid", "routed_scaling_factor": 2.5,
                              "n_shared_experts": 1, "first_dense_layers": 1, "capacity_factor": 1.0,
                              "aux_loss_coef": 0.01}), 0.05),
}
STEPS, LR, SEQS_PER_RANK, COUNTED_STEP = 3, 0.2, 2, 2
# rows each rank sends each rank, by world size: zeros, and a rank (the last) that sends nothing
SENDS = {2: [[2, 3], [0, 0]], 4: [[1, 0, 2, 0], [0, 0, 0, 0], [3, 1, 0, 2], [0, 2, 0, 1]]}


def make_model(name):
    torch.manual_seed(0)
    model = build_model(CONFIGS[name][0], dtype=torch.float64)
    with torch.no_grad():  # a router far from uniform: routing that differs by token
        for layer in moe_layers(model):
            layer.router.weight.normal_(0, 1.0)
    return model


def batch(step, world):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 32, (SEQS_PER_RANK * world, 8), generator=g)
    return x, torch.roll(x, -1, dims=1)


def steer(model, step):
    """Step 0: every token to experts 0 and 1 (the first ep rank's): experts 2 and 3 get no token,
    and every rank but those holding experts 0 and 1 sends all its rows away and receives none.
    Step 1: the bias cleared; the routing is the router's own from then on."""
    for layer in moe_layers(model):
        if step == 0:
            layer.expert_bias.copy_(torch.tensor([10.0, 10.0, -10.0, -10.0]))
        elif step == 1:
            layer.expert_bias.zero_()


def moe_blocks(model) -> dict:
    """{block index: its MoE layer}."""
    return {i: b.mlp for i, b in enumerate(model.blocks) if isinstance(b.mlp, MoE)}


def reference_train(name, world, dp=None, m=1):
    """One process: each step, the global batch in ``dp`` shards (default ``world``) of ``m``
    micro-batches, each loss / (dp m) backward, SGD, the bias update. Also, each step, each shard's
    mean loss and its mean cross-entropy (the loss less the aux losses: what a pipeline's last
    stage reports), and each MoE layer's load (what the bias update reads)."""
    dp = world if dp is None else dp
    model, gamma = make_model(name), CONFIGS[name][1]
    opt, losses, ces, loads = torch.optim.SGD(model.parameters(), lr=LR), [], [], []
    for step in range(STEPS):
        x, y = batch(step, world)
        steer(model, step)
        opt.zero_grad(set_to_none=True)
        shard, ce = [], []
        for xs, ys in zip(x.chunk(dp), y.chunk(dp)):
            run, run_ce = [], []
            for xm, ym in zip(xs.chunk(m), ys.chunk(m)):
                loss = model(xm, ym)
                (loss / (dp * m)).backward()
                aux = [layer.aux_loss for layer in moe_layers(model) if layer.aux_loss is not None]
                run.append(loss.item())
                run_ce.append(loss.item() - (model.cfg.aux_loss_coef * sum(aux)).item() if aux else loss.item())
            shard.append(sum(run) / m)
            ce.append(sum(run_ce) / m)
        opt.step()
        loads.append({i: layer.load.clone() for i, layer in moe_blocks(model).items()})
        update_expert_bias(model, gamma)
        losses.append(shard)
        ces.append(ce)
    return model, losses, loads, ces


def _loads(model, group):
    """Each MoE layer's load summed over ``group`` (a copy: the bias update sums it itself)."""
    out = {i: layer.load.clone() for i, layer in moe_blocks(model).items()}
    for load in out.values():
        dist.all_reduce(load, group=group)
    return out


def _train_rank(name, dims, zero_stage, knobs):
    mesh = dims.build_mesh("cpu")
    pm = parallelize_gpt(make_model(name), dims, mesh, zero_stage=zero_stage, **knobs)
    opt, gamma, losses, counted = pm.build_optimizer(torch.optim.SGD, lr=LR), CONFIGS[name][1], [], None
    loads = []
    for step in range(STEPS):
        x, y = batch(step, dims.world_size)
        steer(pm.model, step)
        opt.zero_grad(set_to_none=True)
        with CommCounter() as comm:
            losses.append(pm.forward_backward(*pm.shard_batch(x, y)))
        if step == COUNTED_STEP:
            counted = (comm.stats.bytes["all_to_all"], [m.kept for m in moe_layers(pm.model)])
        opt.step()
        loads.append(_loads(pm.model, pm.group["dp"]))
        update_expert_bias(pm.model, gamma, group=pm.group["dp"])
    biases = {i: layer.expert_bias.clone() for i, layer in moe_blocks(pm.model).items()}
    want = None
    if dims.tp_size > 1:  # the one-process model's values, tensor-parallel sharded as this rank's
        twin = reference_train(name, dims.world_size, dims.dp_size, knobs.get("num_microbatches", 1))[0]
        apply_tensor_parallel(twin, pm.group["tp"], knobs.get("sequence_parallel", False), init_sync=None)
        want = {n: p.detach().clone() for n, p in twin.named_parameters()}
    return {"want": want, "state": pm.full_state(), "losses": losses, "counted": counted, "biases": biases, "loads": loads,
            "ep_index": pm.coords.dp % dims.ep_size, "dp_index": pm.coords.dp}


def _all_to_all_grad(rank, world):
    """x's gradient through all_to_all with SENDS' uneven splits, and what arrived."""
    send = SENDS[world][rank]
    recv = [SENDS[world][s][rank] for s in range(world)]
    x = torch.randn(sum(send), 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    x.requires_grad_()
    y = all_to_all(x, send, recv)
    w = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + rank))
    (y * w).sum().backward()
    return y.detach(), x.grad


def ep_rank(rank, world_size, runs):
    """Each (config name, dp_size, ep_size, zero_stage, more knobs) of ``runs`` trained (``more``:
    pairs of ParallelDims fields or parallelize_gpt keywords); then the all-to-all's gradient."""
    out = {}
    for run in runs:
        more = dict(run[4])
        sizes = {k: more.pop(k) for k in ("tp_size", "pp_size") if k in more}
        out[run] = _train_rank(run[0], ParallelDims(dp_size=run[1], ep_size=run[2], **sizes), run[3], more)
    out["all_to_all"] = _all_to_all_grad(rank, world_size)
    dist.barrier()
    return out
