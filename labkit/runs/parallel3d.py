"""Data x tensor x pipeline parallelism (Chapter 6): labkit's GPT trained on a (N_d, p, t) grid.

The ranks form the ``DeviceMesh`` of :class:`labkit.parallel.ParallelDims` (axes dp, pp, cp, tp;
cp of size 1 here), tensor parallelism innermost (consecutive ranks: inside a node), the pipeline
next, data parallelism outermost. Every rank builds the same seeded model and hands it to
:func:`labkit.parallel.parallelize_gpt`, which cuts its pipeline ranges, shards it over its "tp"
group and keeps the chunks of its stage. A step of the plain loop: the replica's share of the
global batch through the pipeline schedule (tensor-parallel collectives inside each chunk, sends
between stages), the tied embedding's gradient summed between the two ends, sequence-parallel
gradients summed over "tp", all gradients averaged over "dp" (all inside ``forward_backward``),
one SGD step. A degree of 1 keeps its axis, of size 1, so the 2-D pairs run through the same code.

``parallel_3d_rank`` also trains the unsharded model in one process on the same batches
(:func:`references`: on each rank, or once in the launching process, which passes it as
``refs``) and cuts its updated weights with the same sharding (:func:`held_like`), so that each
rank returns what it holds beside what it should hold.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..dist import rank_device
from ..model import build_model, get_preset
from ..parallel import ParallelDims, parallelize_gpt
from .pipeline import make_batch
from .tensor_parallel_ref import sharded_like

__all__ = ["train_3d", "reference_train", "references", "held_like", "parallel_3d_rank"]


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


def references(cfg="tiny", global_batch: int = 8, steps: int = 2, seed: int = 0, lr: float = 0.1,
               dtype: torch.dtype = torch.float32) -> tuple:
    """The one-process run a grid's ranks compare with: (its loss at each step, its trained model,
    the model it started from), all from :func:`reference_train`."""
    ref_losses, ref_model = reference_train(cfg, global_batch, steps, seed, lr, dtype)
    _, start_model = reference_train(cfg, global_batch, 0, seed, lr, dtype)
    return ref_losses, ref_model, start_model


def held_like(full: torch.nn.Module, group=None, sequence_parallel: bool = False, cache: dict | None = None) -> dict:
    """{name: parameter} of the one-process model ``full`` as a rank of the tensor-parallel
    ``group`` holds it: ``full``'s own parameters when ``group`` is None or of one rank, else
    :func:`labkit.runs.tensor_parallel_ref.sharded_like`'s shards of it (a tied weight under its
    first name only). Clone what you keep. ``cache``: a dict that keeps the shards per model, group
    (its ranks) and ``sequence_parallel``, for the cases of a launch that share them."""
    if group is None or dist.get_world_size(group) == 1:
        return dict(full.named_parameters())
    if cache is None:
        return sharded_like(full, group, sequence_parallel)
    key = (id(full), tuple(dist.get_process_group_ranks(group)), bool(sequence_parallel))
    if key not in cache:
        cache[key] = (full, sharded_like(full, group, sequence_parallel))  # holding full keeps its id
    return cache[key][1]


def train_3d(rank: int, world_size: int, dp_size: int, tp_size: int, pp_size: int, schedule: str = "1f1b",
             num_microbatches: int = 2, v: int = 1, *, sequence_parallel: bool = False, steps: int = 2, cfg="tiny",
             global_batch: int = 8, seed: int = 0, lr: float = 0.1, dtype: torch.dtype = torch.float32) -> dict:
    """Train ``steps`` SGD steps on the (N_d, p, t) grid with m micro-batches, in ``dtype``; this rank's view.

    The model is composed by :func:`labkit.parallel.parallelize_gpt` (plain data parallelism over
    "dp") and trained by a plain loop. Returns {"coords" (d, stage, tp rank), "losses" (per step,
    the replica's m micro-batch losses; on the last stage only), "params" {name: this rank's
    updated shard}, "model" (the sharded model), "mesh", "ranges" (the pipeline's layer ranges)}.
    """
    dims = ParallelDims(dp_size=dp_size, tp_size=tp_size, pp_size=pp_size)
    dims.check_world_size(world_size)
    if global_batch % (dp_size * num_microbatches):
        raise ValueError(f"global_batch={global_batch} must split into dp_size={dp_size} replicas of "
                         f"num_microbatches={num_microbatches} micro-batches")
    if sequence_parallel and tp_size == 1:  # refused before any process group is built
        raise ValueError("sequence_parallel=True needs tp_size > 1")
    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    dev = rank_device()
    torch.manual_seed(seed)
    model = build_model(cfg).to(dev, dtype)
    mesh = dims.build_mesh(dev.type)
    pm = parallelize_gpt(model, dims, mesh, sequence_parallel=sequence_parallel, schedule=schedule,
                         num_microbatches=num_microbatches, v=v)
    opt = pm.build_optimizer(torch.optim.SGD, lr=lr)
    losses = []
    for x, y in _batches(cfg, global_batch, steps, seed):
        opt.zero_grad(set_to_none=True)
        pm.forward_backward(*(t.to(dev) for t in pm.shard_batch(x, y)))
        opt.step()
        losses.append(pm.last_losses)
    d, stage, _, r = pm.coords
    return {"coords": (d, stage, r), "losses": losses, "ranges": pm.ranges, "model": model, "mesh": mesh,
            "params": {n: p.detach().to("cpu", copy=True) for n, p in pm.named_parameters()}}


def parallel_3d_rank(rank: int, world_size: int, cases=(), steps: int = 2, cfg="tiny", global_batch: int = 8,
                     seed: int = 0, lr: float = 0.1, dtype: torch.dtype = torch.float32, refs=None) -> dict:
    """Run each case with :func:`train_3d`: (dp_size, tp_size, pp_size, schedule, num_microbatches, v,
    sequence_parallel).

    Returns {case: {"coords", "losses", "params", "names", "want", "start", "ref_losses"}}:
    ``names`` lists every parameter of the (sharded) model, held by this stage or not; ``want`` is
    the one-process reference's updated weights and ``start`` its initial ones, both sharded like
    ``params`` (same names); ``ref_losses`` its loss at each step. ``refs``: :func:`references`
    of the same ``cfg``, ``global_batch``, ``steps``, ``seed``, ``lr`` and ``dtype``, computed once
    by the launching process (each rank computes it if not given).
    """
    torch.set_num_threads(1)  # tensors this small gain nothing from threads on a shared CPU
    if refs is None:
        refs = references(cfg, global_batch, steps, seed, lr, dtype)
    ref_losses, ref_model, start_model = refs
    if len(ref_losses) != steps or next(ref_model.parameters()).dtype != dtype:
        raise ValueError(f"refs holds a run of {len(ref_losses)} steps in "
                         f"{next(ref_model.parameters()).dtype}, not steps={steps} in dtype={dtype}: "
                         "pass references() of the same arguments")
    out, cache = {}, {}
    for case in cases:
        dp, tp, pp, schedule, m, v, sp = case
        res = train_3d(rank, world_size, dp, tp, pp, schedule, m, v, sequence_parallel=sp, steps=steps, cfg=cfg,
                       global_batch=global_batch, seed=seed, lr=lr, dtype=dtype)
        out[case] = {"coords": res["coords"], "losses": res["losses"], "params": res["params"],
                     "ref_losses": ref_losses, "names": [n for n, _ in res["model"].named_parameters()]}
        group = res["mesh"].get_group("tp") if tp > 1 else None
        for key, full in (("want", ref_model), ("start", start_model)):
            named = held_like(full, group, sp, cache)
            out[case][key] = {n: named[n].detach().clone() for n in res["params"]}
    return out
