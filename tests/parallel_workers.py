"""What tests/test_parallelize.py's ranks run: parallelize_gpt under a plain training loop, per case."""

import time

import torch
import torch.distributed as dist

from labkit.model import build_model, get_preset
from labkit.parallel import ParallelDims, parallelize_gpt
from labkit.runs.parallel3d import held_like
from labkit.runs.parallel3d import references as one_process_run
from labkit.runs.pipeline import make_batch


def _trained_state(pm) -> dict:
    """{name: value} of what this rank holds after training (ZeRO-3: gathered over "dp")."""
    return pm.full_state()


def _plain_loop(pm, cfg, global_batch, steps, seed, lr) -> list:
    """zero_grad, forward_backward on this replica's rows, step: the loss of each step (last stage)."""
    opt = pm.build_optimizer(torch.optim.SGD, lr=lr)
    losses = []
    for k in range(steps):
        x, y = make_batch(cfg, global_batch, seed + k)
        opt.zero_grad(set_to_none=True)
        losses.append(pm.forward_backward(*pm.shard_batch(x, y)))
        opt.step()
    return losses


_SHARDED = {}  # held_like's copies on this rank, shared by the cases of a launch


def run_case(rank, case, cfg, global_batch, steps, seed, lr, refs) -> dict:
    """One case: the rank's trained values beside the one-process model's, sharded alike."""
    degrees, kwargs = case  # (dp, tp, pp) or (dp, tp, pp, cp)
    dims = ParallelDims(*degrees)
    tp = dims.tp_size
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(seed)
    pm = parallelize_gpt(build_model(cfg).double(), dims, mesh, **kwargs)
    losses = _plain_loop(pm, cfg, global_batch, steps, seed, lr)
    # the grid ParallelDims computes is the one torch's DeviceMesh built: coordinates and groups
    c = pm.coords
    groups = {axis: dist.get_process_group_ranks(mesh.get_group(axis)) for axis in ("dp", "pp", "cp", "tp")}
    along = {axis: [dims.rank_of(**{**c._asdict(), axis: i}) for i in range(getattr(dims, f"{axis}_size"))]
             for axis in groups}
    out = {"losses": losses, "coords": tuple(c), "mesh_coords": tuple(mesh.get_coordinate()),
           "groups": groups, "groups_from_dims": along, "replicas": dist.get_world_size(pm.group["replicas"])}
    group = mesh.get_group("tp") if tp > 1 else None
    for key, full in (("want", refs[1]), ("start", refs[2])):
        out[key] = held_like(full, group, kwargs.get("sequence_parallel", False), _SHARDED)
    out["got"] = {n: v for n, v in _trained_state(pm).items() if n in out["want"]}
    for key in ("want", "start"):
        out[key] = {n: out[key][n].detach().clone() for n in out["got"]}
    return out


def references(cfg="tiny", global_batch=8, steps=3, seed=0, lr=0.1) -> tuple:
    """The one process's run the ranks compare with: its losses, its trained model and the model
    it started from (float64)."""
    return one_process_run(cfg, global_batch, steps, seed, lr, torch.float64)


def parallelize_rank(rank, world_size, cases, cfg="tiny", global_batch=8, steps=3, seed=0, lr=0.1, refs=None):
    """Every case of ``cases`` ((dp, tp, pp[, cp]), parallelize_gpt's keywords), one after the other, and
    a mesh built for the wrong number of ranks; the one-process losses as "ref_losses". ``refs``:
    :func:`references` of the same arguments, computed once by the launching process (each rank
    computes them if not given)."""
    torch.set_num_threads(1)
    if refs is None:
        refs = references(cfg, global_batch, steps, seed, lr)
    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    ref_losses = refs[0]
    out = {"ref_losses": ref_losses, "seconds": {}}
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        out[i] = run_case(rank, case, cfg, global_batch, steps, seed, lr, refs)
        out["seconds"][i] = time.perf_counter() - t0
    try:
        ParallelDims(dp_size=2, tp_size=2).build_mesh("cpu")
        out["wrong_world"] = None
    except ValueError as err:
        out["wrong_world"] = str(err)
    return out


def counted_step_rank(rank, world_size, cases, cfg, global_batch=8, seed=0):
    """Per case (zero_stage, num_microbatches): the collectives of one step, counted by CommCounter
    on this rank (the second step: the first may differ by its setup), and the model's parameter count."""
    from labkit.comm_counter import CommCounter

    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    out = []
    for zero_stage, m in cases:
        torch.manual_seed(seed)
        model = build_model(cfg).double()
        n_params = sum(p.numel() for p in model.parameters())
        dims = ParallelDims(dp_size=world_size)
        pm = parallelize_gpt(model, dims, dims.build_mesh("cpu"), zero_stage=zero_stage, num_microbatches=m)
        opt = pm.build_optimizer(torch.optim.SGD, lr=0.1)
        for k in range(2):
            x, y = make_batch(cfg, global_batch, seed + k)
            with CommCounter() as comm:
                opt.zero_grad(set_to_none=True)
                pm.forward_backward(*pm.shard_batch(x, y))
                opt.step()
        out.append({"zero_stage": zero_stage, "m": m, "n_params": n_params, "comm": comm.stats.as_dict()})
    return out
