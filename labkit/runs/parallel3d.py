"""Data x tensor x pipeline parallelism (Chapter 6): labkit's GPT trained on a (N_d, p, t) grid.

The ranks form the ``DeviceMesh`` of :class:`labkit.parallel.ParallelDims` (axes dp, pp, cp, tp; cp of
size 1 here), tensor parallelism innermost (consecutive ranks: inside a node), the pipeline next,
data parallelism outermost. Every rank builds the same
seeded model, cuts its pipeline ranges, shards it over its "tp" group with
:func:`labkit.tensor_parallel.apply_tensor_parallel` and keeps the chunks of its stage. A step:
the replica's share of the global batch through the pipeline schedule (tensor-parallel
collectives inside each chunk, sends between stages), the tied embedding's gradient summed
between the two ends, sequence-parallel gradients summed over "tp", all gradients averaged over
"dp", one SGD step. A degree of 1 leaves its axis out, so the 2-D pairs run through the same code.

``parallel_3d_rank`` also trains the unsharded model in one process on the same batches and cuts
its updated weights with the same sharding, so that each rank returns what it holds beside what
it should hold.
"""

from __future__ import annotations

import copy

import torch

from ..collectives import all_reduce_mean_
from ..dist import rank_device
from ..model import build_model, get_preset
from ..parallel import ParallelDims
from ..pipeline import check_same_model, split_stages
from ..tensor_parallel import apply_tensor_parallel
from ..validate import check_int
from .pipeline import make_batch, train_pipeline

__all__ = ["train_3d", "reference_train", "parallel_3d_rank"]


def _batches(cfg, global_batch: int, steps: int, seed: int):
    """The step-k batch of every run here: ``make_batch`` with seed + k."""
    return [make_batch(cfg, global_batch, seed + k) for k in range(steps)]


def reference_train(cfg="tiny", global_batch: int = 8, steps: int = 2, seed: int = 0, lr: float = 0.1,
                    dtype: torch.dtype = torch.float32):
    """One process, whole batches, ``steps`` SGD steps: (losses, the trained model in ``dtype``)."""
    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    torch.manual_seed(seed)
    model = build_model(cfg).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in _batches(cfg, global_batch, steps, seed):
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def train_3d(rank: int, world_size: int, dp_size: int, tp_size: int, pp_size: int, schedule: str = "1f1b",
             num_microbatches: int = 2, v: int = 1, *, sequence_parallel: bool = False, steps: int = 2, cfg="tiny",
             global_batch: int = 8, seed: int = 0, lr: float = 0.1, dtype: torch.dtype = torch.float32) -> dict:
    """Train ``steps`` SGD steps on the (N_d, p, t) grid with m micro-batches, in ``dtype``; this rank's view.

    Returns {"coords" (d, stage, tp rank), "losses" (per step, the replica's m micro-batch losses;
    on the last stage only), "params" {name: this rank's updated shard}, "model" (the sharded
    model), "mesh", "ranges" (the pipeline's layer ranges)}.
    """
    dp, tp, pp, m = dp_size, tp_size, pp_size, num_microbatches  # N_d, t, p, m
    dims = ParallelDims(dp_size=dp, tp_size=tp, pp_size=pp)
    dims.check_world_size(world_size)
    if global_batch % (dp * m):
        raise ValueError(f"global_batch={global_batch} must split into dp_size={dp} replicas of "
                         f"num_microbatches={m} micro-batches")
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel=True needs tp_size > 1")
    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    dev = rank_device()
    mesh = dims.build_mesh(dev.type)
    d, stage, _, r = dims.coords(rank)
    pp_ranks = [dims.rank_of(dp=d, pp=s, tp=r) for s in range(pp)]  # the global ranks of this rank's pipeline
    tp_group, pp_group, dp_group = (mesh.get_group(n) for n in ("tp", "pp", "dp"))
    torch.manual_seed(seed)
    model = build_model(cfg).to(dev, dtype)
    check_same_model(model)  # every rank cuts its shard and its stage from the same model
    ranges = split_stages(model, pp, v=v)  # cut by the unsharded model's parameters
    if tp > 1:
        apply_tensor_parallel(model, tp_group, sequence_parallel)
    rows = slice(d * global_batch // dp, (d + 1) * global_batch // dp)  # this replica's sequences
    seq = cfg.seq_len // tp if sequence_parallel else cfg.seq_len  # what stages exchange
    held = opt = None
    losses = []
    for x, y in _batches(cfg, global_batch, steps, seed):
        model.zero_grad(set_to_none=True)
        res = train_pipeline(stage, pp, schedule, m, v, cfg=cfg, group=pp_group, ranks=pp_ranks, model=model,
                             batch=(x[rows].to(dev), y[rows].to(dev)), ranges=ranges, loss_fn=model.loss,
                             act_shape=(global_batch // (dp * m), seq, cfg.d_model), check_init=False,
                             count_saved=False)  # the tied embedding's gradient is summed in the step
        if held is None:  # the parameters of this stage: those that received a gradient
            held = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
            opt = torch.optim.SGD([p for _, p in held], lr=lr)
        for _, p in held:
            all_reduce_mean_(p.grad, dp, group=dp_group)
        opt.step()
        losses.append(res["losses"])
    return {"coords": (d, stage, r), "losses": losses, "ranges": ranges, "model": model, "mesh": mesh,
            "params": {n: p.detach().to("cpu", copy=True) for n, p in held}}


def parallel_3d_rank(rank: int, world_size: int, cases=(), steps: int = 2, cfg="tiny", global_batch: int = 8,
                     seed: int = 0, lr: float = 0.1, dtype: torch.dtype = torch.float32) -> dict:
    """Run each case with :func:`train_3d`: (dp_size, tp_size, pp_size, schedule, num_microbatches, v,
    sequence_parallel).

    Returns {case: {"coords", "losses", "params", "names", "want", "start", "ref_losses"}}:
    ``names`` lists every parameter of the (sharded) model, held by this stage or not; ``want`` is
    the one-process reference's updated weights and ``start`` its initial ones, both sharded like
    ``params`` (same names); ``ref_losses`` its loss at each step.
    """
    torch.set_num_threads(1)  # tensors this small gain nothing from threads on a shared CPU
    ref_losses, ref_model = reference_train(cfg, global_batch, steps, seed, lr, dtype)
    _, start_model = reference_train(cfg, global_batch, 0, seed, lr, dtype)
    out = {}
    for case in cases:
        dp, tp, pp, schedule, m, v, sp = case
        res = train_3d(rank, world_size, dp, tp, pp, schedule, m, v, sequence_parallel=sp, steps=steps, cfg=cfg,
                       global_batch=global_batch, seed=seed, lr=lr, dtype=dtype)
        out[case] = {"coords": res["coords"], "losses": res["losses"], "params": res["params"],
                     "ref_losses": ref_losses, "names": [n for n, _ in res["model"].named_parameters()]}
        for key, full in (("want", ref_model), ("start", start_model)):
            twin = copy.deepcopy(full)
            if tp > 1:
                apply_tensor_parallel(twin, res["mesh"].get_group("tp"), sp)
            named = dict(twin.named_parameters())
            out[case][key] = {n: named[n].detach().clone() for n in res["params"]}
    return out
