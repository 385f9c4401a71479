"""What Chapter 6's ranks run: the GPT through labkit's pipeline runtime or through
``torch.distributed.pipelining``, and a synthetic workload of controlled stage costs.

Every rank builds the same model from the seed and keeps its chunks; the global batch is cut
into m micro-batches. ``pipeline_rank`` runs a list of cases and returns, per case, the losses,
the gradients the rank holds, what it ran and when, and its peak of live activations.
"""

from __future__ import annotations

import time

import torch

from ..dist import rank_device
from ..model import GPT, GPTConfig, build_model, get_preset
from ..pipeline import build_chunks, check_same_model, make_schedule, run_schedule, split_stages
from ..validate import check_int

__all__ = ["make_batch", "reference_grads", "train_pipeline", "train_plain_loop", "torch_pipelining_losses",
           "sleep_pipeline", "chain_message_s", "pipeline_rank", "bench_rank", "SleepChunk"]


def make_batch(cfg: GPTConfig, global_batch: int, seed: int = 0):
    """A fixed random batch of token ids and targets: (global_batch, seq_len) each."""
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, cfg.vocab_size, (global_batch, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (global_batch, cfg.seq_len), generator=g)
    return x, y


def reference_grads(cfg: GPTConfig | str = "tiny", global_batch: int = 8, seed: int = 0,
                    dtype: torch.dtype = torch.float32):
    """One process, whole batch: (loss, {name: grad}); the model in ``dtype``."""
    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    torch.manual_seed(seed)
    model = build_model(cfg).to(dtype)
    loss = model(*make_batch(cfg, global_batch, seed))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def train_pipeline(rank, pp_size, schedule, num_microbatches, v=1, cfg="tiny", global_batch=8, seed=0, *,
                   group=None, ranks=None, model=None, batch=None, ranges=None, loss_fn=None, act_shape=None,
                   check_init=True, count_saved=True, dtype=torch.float32):
    """One pipeline step of the GPT on this rank (forward and backward, tied gradient summed).

    ``rank``: the stage; ``ranks``: the pipeline's global ranks in ``group``; ``ranges``: the
    layer split (default ``split_stages(model, pp_size, v=v)``); ``loss_fn`` (default ``GPT.loss``)
    and ``act_shape`` (default (B/m, T, C)) for a model whose stages differ (tensor-parallel);
    ``check_init``: first check that every stage holds the same model (a collective); ``dtype``:
    the model's, when this function builds it.

    Returns {"losses", "grads" (this rank's, by the model's parameter names), "events",
    "peak_live", "peak_saved_bytes", "sent", "ranges"}.
    """
    m = check_int("num_microbatches", num_microbatches, 1)
    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    dev = rank_device()
    if model is None:
        torch.manual_seed(seed)
        model = build_model(cfg).to(dev, dtype)
    if check_init:
        check_same_model(model, group)
    x, y = (t.to(dev) for t in (make_batch(cfg, global_batch, seed) if batch is None else batch))
    if x.shape[0] % m:
        raise ValueError(f"num_microbatches={m} must divide the batch of {x.shape[0]} sequences")
    ranges = split_stages(model, pp_size, v=v) if ranges is None else ranges
    chunks = build_chunks(model, ranges, pp_size, rank)
    actions = make_schedule(schedule, pp_size, m, v)[rank]
    act_shape = (x.shape[0] // m, x.shape[1], cfg.d_model) if act_shape is None else act_shape
    res = run_schedule(chunks, actions, rank=rank, pp_size=pp_size, inputs=x.chunk(m), targets=y.chunk(m),
                       loss_fn=GPT.loss if loss_fn is None else loss_fn, act_shape=act_shape, group=group,
                       ranks=ranks, device=x.device, tied=model.wte.weight, count_saved=count_saved,
                       act_dtype=model.wte.weight.dtype)
    return {"ranges": ranges, "losses": res.losses, "events": res.events, "peak_live": res.peak_live,
            "sent": res.sent, "peak_saved_bytes": res.peak_saved_bytes,
            "grads": {n: p.grad.detach().to("cpu", copy=True) for n, p in model.named_parameters()
                      if p.grad is not None}}


def train_plain_loop(rank, pp_size, schedule, num_microbatches, v=1, cfg="tiny", global_batch=8, seed=0,
                     steps=2, lr=0.1, dtype=torch.float32):
    """``steps`` SGD steps through the pipeline as a plain loop: ``zero_grad()``, one
    :func:`run_schedule` (the tied gradient summed by it), ``step()``. Step k's batch is
    ``make_batch(cfg, global_batch, seed + k)``. Returns {"losses" per step, "params" held}."""
    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    dev, m = rank_device(), num_microbatches
    torch.manual_seed(seed)
    model = build_model(cfg).to(dev, dtype)
    check_same_model(model)
    chunks = build_chunks(model, split_stages(model, pp_size, v=v), pp_size, rank)
    params = list({id(p): p for c in chunks for p in c.parameters()}.values())
    opt = torch.optim.SGD(params, lr=lr)
    actions = make_schedule(schedule, pp_size, m, v)[rank]
    losses = []
    for k in range(steps):
        x, y = (t.to(dev) for t in make_batch(cfg, global_batch, seed + k))
        opt.zero_grad(set_to_none=True)
        res = run_schedule(chunks, actions, rank=rank, pp_size=pp_size, inputs=x.chunk(m), targets=y.chunk(m),
                           loss_fn=GPT.loss, act_shape=(global_batch // m, cfg.seq_len, cfg.d_model),
                           device=dev, tied=model.wte.weight, count_saved=False, act_dtype=dtype)
        opt.step()
        losses.append(res.losses)
    held = {id(p) for p in params}
    return {"losses": losses, "params": {n: p.detach().to("cpu", copy=True)
                                         for n, p in model.named_parameters() if id(p) in held}}


def torch_pipelining_losses(rank, pp_size, schedule, num_microbatches, v=1, cfg="tiny", global_batch=8,
                            seed=0, dtype=torch.float32):
    """The same split and batch through ``torch.distributed.pipelining``: the last stage's losses."""
    m = check_int("num_microbatches", num_microbatches, 1)
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    cfg = get_preset(cfg) if isinstance(cfg, str) else cfg
    dev = rank_device()
    torch.manual_seed(seed)
    model = build_model(cfg).to(dev, dtype)
    x, y = (t.to(dev) for t in make_batch(cfg, global_batch, seed))
    ranges = split_stages(model, pp_size, v=v)
    chunks = build_chunks(model, ranges, pp_size, rank)
    stages = [PipelineStage(c, stage_index=k, num_stages=len(ranges), device=x.device)
              for k, c in zip(range(rank, len(ranges), pp_size), chunks)]
    if schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=GPT.loss)
    else:
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        sched = cls(stages[0], n_microbatches=m, loss_fn=GPT.loss)
    losses = []
    args = (x,) if rank == 0 else ()
    kwargs = dict(target=y, losses=losses) if rank == pp_size - 1 else {}
    start = time.perf_counter()
    sched.step(*args, **kwargs)
    return {"losses": [t.item() for t in losses], "seconds": time.perf_counter() - start}


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each sleep a set time: a stage of known cost."""

    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s):
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.bwd_s)
        return g * 1.0, None, None


class SleepChunk(torch.nn.Module):
    """A chunk whose forward takes ``fwd_s`` seconds and backward ``bwd_s``, whatever the load."""

    def __init__(self, fwd_s: float, bwd_s: float):
        super().__init__()
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x):
        return _Sleep.apply(x, self.fwd_s, self.bwd_s)


def _sum_loss(y, target):
    return y.sum()


def sleep_pipeline(rank, pp_size, schedule, num_microbatches, v=1, fwd_s=0.02, bwd_s=0.04):
    """Run a schedule on chunks of controlled cost (split evenly over v chunks); return its events,
    its peak of live micro-batches and, on rank 0, ``message_s``: a message's cost measured just
    before and just after the step (:func:`chain_message_s`, the mean of the two)."""
    m = check_int("num_microbatches", num_microbatches, 1)
    import torch.distributed as dist

    chunks = [SleepChunk(fwd_s / v, bwd_s / v) for _ in range(v)]
    dev = rank_device()
    inputs = [torch.ones(1, 4, device=dev, requires_grad=True) for _ in range(m)]
    actions = make_schedule(schedule, pp_size, m, v)[rank]
    before = chain_message_s(rank, pp_size)
    dist.barrier()  # start together: the step's clock starts here on every rank
    res = run_schedule(chunks, actions, rank=rank, pp_size=pp_size, inputs=inputs, targets=[None] * m,
                       loss_fn=_sum_loss, act_shape=(1, 4), device=dev, count_saved=False)
    after = chain_message_s(rank, pp_size)
    message_s = None if before is None else (before + after) / 2
    return {"events": res.events, "peak_live": res.peak_live, "message_s": message_s}


def chain_message_s(rank, pp_size, rounds=3):
    """Seconds one message between neighbouring stages costs now: a token passed along the chain
    0 -> p-1 -> 0, ``rounds`` times, timed on rank 0 (which returns the mean per message; the other
    ranks return None). These are the messages on a GPipe step's critical path, 2 (p - 1) of them,
    each received by a rank that waits for it; the cost includes the machine's load at the time."""
    import torch.distributed as dist

    if pp_size == 1:
        return 0.0 if rank == 0 else None
    box = torch.zeros(1, device=rank_device())

    def now():  # on a GPU, wait for the queued messages: time what ran, not what was queued
        if box.is_cuda:
            torch.cuda.synchronize(box.device)
        return time.perf_counter()

    start = now()
    for _ in range(rounds):
        if rank > 0:
            dist.recv(box, src=rank - 1)
        if rank < pp_size - 1:
            dist.send(box, dst=rank + 1)
            dist.recv(box, src=rank + 1)
        if rank > 0:
            dist.send(box, dst=rank - 1)
    if rank != 0:
        return None
    return (now() - start) / (2 * (pp_size - 1) * rounds)


def _connect_ring(rank, world_size):
    """Exchange a message with both ring neighbours, so that no timed step pays for opening a
    connection (gloo connects a pair of ranks on its first message; interleaving adds p-1 -> 0)."""
    import torch.distributed as dist

    if world_size == 1:
        return
    box = torch.zeros(1, device=rank_device())
    for peer in sorted({(rank + 1) % world_size, (rank - 1) % world_size}):
        if rank < peer:
            dist.send(box, dst=peer)
            dist.recv(box, src=peer)
        else:
            dist.recv(box, src=peer)
            dist.send(box, dst=peer)


def pipeline_rank(rank, world_size, cases=(), torch_cases=(), sleep_cases=(), loop_cases=(),
                  cfg="tiny", global_batch=8, seed=0, sleep_costs=(0.03, 0.06), sleep_repeats=1,
                  dtype=torch.float32):
    """Run every case on this rank; cases are (schedule, m, v). Returns {kind: {case: result}};
    a sleep case's result is a list of ``sleep_repeats`` runs; a loop case trains two SGD steps
    through :func:`train_plain_loop`; the GPT's cases run in ``dtype``."""
    torch.set_num_threads(1)  # tensors this small gain nothing from threads on a shared CPU
    out = {"labkit": {}, "torch": {}, "sleep": {}, "loop": {}}
    for case in loop_cases:
        out["loop"][case] = train_plain_loop(rank, world_size, *case, cfg=cfg, global_batch=global_batch,
                                             seed=seed, dtype=dtype)
    for case in cases:
        out["labkit"][case] = train_pipeline(rank, world_size, *case, cfg=cfg, global_batch=global_batch,
                                             seed=seed, dtype=dtype)
    for case in torch_cases:
        out["torch"][case] = torch_pipelining_losses(rank, world_size, *case, cfg=cfg,
                                                     global_batch=global_batch, seed=seed, dtype=dtype)
    if sleep_cases:
        _connect_ring(rank, world_size)
    for case in sleep_cases:
        sleep_pipeline(rank, world_size, *case, 1e-3, 2e-3)  # untimed: one-time costs of a first step
        out["sleep"][case] = [sleep_pipeline(rank, world_size, *case, *sleep_costs)
                              for _ in range(sleep_repeats)]
    return out


def bench_rank(rank, world_size, cases, steps=3, cfg="tiny", global_batch=8):
    """Per case (schedule, m, v): the fastest of ``steps`` step times on this rank, labkit's
    runtime and ``torch.distributed.pipelining``'s (the schedules' own ``step`` only)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = {}
    for case in cases:
        ours, theirs = [], []
        for _ in range(steps):  # alternate, so that a busy moment slows both
            dist.barrier()
            res = train_pipeline(rank, world_size, *case, cfg=cfg, global_batch=global_batch,
                                 count_saved=False)
            ours.append(res["events"][-1][2])
            dist.barrier()
            theirs.append(torch_pipelining_losses(rank, world_size, *case, cfg=cfg,
                                                  global_batch=global_batch)["seconds"])
        out[case] = (min(ours), min(theirs))
    return out
