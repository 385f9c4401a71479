"""Functions the distributed tests run on each rank (spawned processes import them from here)."""

import os
import time

import torch
import torch.distributed as dist

from labkit.dist import CommCounter


def collectives(rank, world_size):
    """Issue one of each collective under a CommCounter; return the counts and results."""
    with CommCounter() as comm:
        t = torch.full((6,), float(rank + 1))
        dist.all_reduce(t)
        gathered = torch.empty(6 * world_size)
        dist.all_gather_into_tensor(gathered, torch.full((6,), float(rank)))
        shard = torch.empty(3)
        dist.reduce_scatter_tensor(shard, torch.ones(3 * world_size))
        b = torch.full((4,), float(rank))
        dist.broadcast(b, src=0)
        if rank == 0:
            dist.send(torch.arange(5.0), dst=1)
        elif rank == 1:
            r = torch.empty(5)
            dist.recv(r, src=0)
    return {"stats": comm.stats.as_dict(), "sum": t.tolist(), "gathered": gathered.tolist(),
            "shard": shard.tolist(), "bcast": b.tolist(), "pid": os.getpid()}


def ddp_step(rank, world_size):
    """One DDP backward of a 2-parameter-tensor model; count what DDP's reducer sends."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4), bucket_cap_mb=25)
    with CommCounter() as comm:
        model(torch.randn(3, 8)).sum().backward()
    return comm.stats.as_dict()


def fails_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one was given a bad shard")
    dist.barrier()
    return rank


def hangs_on_rank_one(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: the collective must time out
    else:
        time.sleep(600)
    return rank


def rank_and_pid(rank, world_size, offset=0):
    return rank + offset, os.getpid()


def returns_tensors(rank, world_size):
    return {"t": torch.full((3,), float(rank)), "nested": [torch.arange(rank + 1)]}


def counted_by_both(rank, world_size):
    """Collectives, a DDP backward and a ZeRO-3 step under CommCounter and torch's CommDebugMode."""
    from torch.distributed.tensor.debug import CommDebugMode

    from labkit.zero import FullyShardedModule

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    zero3 = FullyShardedModule(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)),
                               unit_types=(torch.nn.Linear,))
    with CommDebugMode() as debug, CommCounter() as comm:
        t = torch.ones(6)
        dist.all_reduce(t)
        dist.all_gather_into_tensor(torch.empty(6 * world_size), torch.ones(6))
        dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3 * world_size))
        dist.broadcast(t, src=0)
        ddp(torch.randn(3, 8)).sum().backward()
        zero3(torch.randn(3, 8)).sum().backward()
    theirs = {str(op): n for op, n in debug.get_comm_counts().items()}
    return {"ours": {k: v["calls"] for k, v in comm.stats.as_dict().items()}, "theirs": theirs,
            "theirs_total": debug.get_total_counts()}


def pipeline_and_grid(rank, world_size, pipeline_kw, grid_kw):
    """One launch for two suites: labkit.runs.pipeline's cases, then the (dp, tp, pp) grid's."""
    from labkit.runs.parallel3d import parallel_3d_rank
    from labkit.runs.pipeline import pipeline_rank

    out = pipeline_rank(rank, world_size, **pipeline_kw)
    out["grid"] = parallel_3d_rank(rank, world_size, **grid_kw)
    return out


def pipeline_extras(rank, world_size, pipeline_kw):
    """labkit.runs.pipeline's cases, then checks of the pipeline's duties on real ranks: a second
    explicit tied-gradient exchange changes nothing, two steps without ``zero_grad`` accumulate
    the tied gradient like any other, and stages built from different seeds are refused (on every
    rank, with the same error)."""
    from labkit.model import build_model
    from labkit.pipeline import exchange_tied_grad
    from labkit.runs.pipeline import pipeline_rank, train_pipeline

    out = pipeline_rank(rank, world_size, **pipeline_kw)
    torch.manual_seed(0)
    model = build_model("tiny").double()
    train_pipeline(rank, world_size, "1f1b", 4, model=model)
    once = model.wte.weight.grad.clone()
    exchange_tied_grad(model.wte.weight, world_size - 1 - rank, rank == 0)  # already summed
    out["repeat_exchange_equal"] = torch.equal(once, model.wte.weight.grad)
    # a second step on the same batch without zero_grad: gradients accumulate to twice one step's
    train_pipeline(rank, world_size, "1f1b", 4, model=model, check_init=False)
    out["tied_accumulated_error"] = ((model.wte.weight.grad - 2 * once).abs().max() / once.abs().max()).item()
    torch.manual_seed(rank)  # a different model on every rank
    try:
        train_pipeline(rank, world_size, "1f1b", 4, model=build_model("tiny"))
        out["init_error"] = None
    except ValueError as err:
        out["init_error"] = str(err)
    return out


def launches_in_a_row(count):
    """Run ``count`` two-rank launches one after another from this process; return their ranks.
    The collectives' timeout is generous: this runs beside other launches on a loaded machine."""
    from labkit.dist import launch
    return [launch(rank_and_pid, 2, timeout_s=120)[1][0] for _ in range(count)]


def fork_server_command(rank, world_size):
    """The command line of the process this rank was forked from (labkit.dist's fork server), and
    this rank's session."""
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        return rank, f.read().replace(b"\0", b" ").decode(), os.getsid(0)
