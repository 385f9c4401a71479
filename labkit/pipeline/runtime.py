"""Run one rank's share of a pipeline schedule with point-to-point sends and receives.

Each forward receives its input from the previous virtual stage (or takes the micro-batch, at
stage 0), runs the chunk and sends the output on; each backward receives the output's gradient
(or starts from the loss, at the last stage), runs autograd and sends the input's gradient back.
Sends are asynchronous and awaited at the end of the step, receives block, so a rank idles
exactly where the schedule makes it wait. An action's sends are posted at the start of the next
action, in one ``batch_isend_irecv`` with that action's receive: NCCL runs a batch's operations
together, so two ranks that each send to the other before receiving cannot deadlock there.
Messages carry a tag per (kind, micro-batch, stage); gloo matches by tag, NCCL by order, which
agree except for interleaving on p = 2.
Runs the same under ``torchrun`` with NCCL (tensors on the rank's GPU).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .schedules import Action

__all__ = ["PipelineResult", "run_schedule", "exchange_tied_grad"]


@dataclass
class PipelineResult:
    """One rank's step: ``losses`` (last stage, one per micro-batch, unscaled), ``events``
    [(action, start, end)] in seconds from the step's start, ``peak_live`` the most
    (micro-batch, chunk) activations the rank held at once, ``peak_saved_bytes`` the most bytes
    autograd held saved for backward at once (parameters and buffers excluded), ``sent`` the
    messages it sent."""

    losses: list
    events: list
    peak_live: int
    peak_saved_bytes: int
    sent: int


class _SavedBytes:
    """Count the bytes of the distinct storages autograd saves, parameters and buffers excluded."""

    def __init__(self, chunks):
        self.skip = {t.untyped_storage().data_ptr() for c in chunks
                     for t in [*c.parameters(), *c.buffers()]}
        self.seen, self.nbytes = set(), 0

    def pack(self, t):
        st = t.untyped_storage()
        if st.data_ptr() not in self.skip and st.data_ptr() not in self.seen:
            self.seen.add(st.data_ptr())
            self.nbytes += st.nbytes()
        return t


def _post(outbox: list, pending: list, recv=None):
    """Issue the sends in ``outbox`` (emptied) and the receive ``recv`` (a ``P2POp`` or None) as one
    batch; the sends' work joins ``pending``. Returns the receive's work (None without one)."""
    ops = outbox + ([recv] if recv is not None else [])
    outbox.clear()
    if not ops:
        return None
    works = dist.batch_isend_irecv(ops)
    if recv is None:
        pending.extend(works)
        return None
    pending.extend(works[:-1])
    return works[-1]  # NCCL may return one work for the whole batch: it covers the receive too


def _tag(kind: str, mb: int, k: int, n_stages: int) -> int:
    return (mb * n_stages + k) * 2 + (kind == "B")


def run_schedule(chunks, actions: list[Action], *, rank: int, pp_size: int, inputs=None, targets=None,
                 loss_fn=None, act_shape=None, act_dtype=torch.float32, device="cpu",
                 group=None, ranks=None, loss_scale: float | None = None) -> PipelineResult:
    """Execute ``actions`` (this rank's list from a schedule) on ``chunks`` (its v modules).

    ``inputs``/``targets``: the m micro-batches (needed on the ranks of the first / last virtual
    stage); ``loss_fn(output, target)``; ``act_shape``: the (B, T, C) shape stages exchange;
    ``ranks``: global ranks of the pipeline's stages (default 0..p-1) in ``group``. Each
    micro-batch's loss is scaled by ``loss_scale`` (default 1/m) before backward, so the summed
    gradients are those of the mean loss. Gradients accumulate in the chunks' ``.grad``.
    """
    p, v = pp_size, len(chunks)
    n_stages, last = p * v, p * v - 1
    ranks = list(range(p)) if ranks is None else list(ranks)
    if len(ranks) != p:
        raise ValueError(f"ranks={ranks} must list pp_size={p} global ranks")
    if act_shape is None:
        raise ValueError("act_shape=None: give the (B, T, C) shape of the activations stages exchange")
    m = 1 + max(a.mb for a in actions)
    scale = 1.0 / m if loss_scale is None else loss_scale
    stash, losses, events, pending, saved, outbox = {}, {}, [], [], {}, []
    peak = sent = live_bytes = peak_bytes = 0
    on_gpu = torch.device(device).type == "cuda"

    def now():  # on a GPU, wait for the queued kernels and receives: time what ran, not what was queued
        if on_gpu:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    t0 = now()
    for a in actions:
        k = a.chunk * p + rank  # this action's virtual stage
        if a.kind == "F":
            if k == 0:
                x = inputs[a.mb]
                _post(outbox, pending)
            else:
                x = torch.empty(act_shape, dtype=act_dtype, device=device)
                _post(outbox, pending, dist.P2POp(dist.irecv, x, ranks[(k - 1) % p], group,
                                                  _tag("F", a.mb, k - 1, n_stages))).wait()
                x.requires_grad_()
            start = now()
            counter = _SavedBytes(chunks)
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
                y = chunks[a.chunk](x)
                loss = loss_fn(y, targets[a.mb]) if k == last else None
            saved[(a.mb, a.chunk)] = counter.nbytes
            live_bytes += counter.nbytes
            peak_bytes = max(peak_bytes, live_bytes)
            if k == last:
                losses[a.mb] = loss.detach()
                stash[(a.mb, a.chunk)] = (x, loss * scale)
            else:
                outbox.append(dist.P2POp(dist.isend, y.detach().contiguous(), ranks[(k + 1) % p], group,
                                         _tag("F", a.mb, k, n_stages)))
                stash[(a.mb, a.chunk)] = (x, y)
                sent += 1
            peak = max(peak, len(stash))
        elif a.kind == "B":
            x, y = stash.pop((a.mb, a.chunk))
            live_bytes -= saved.pop((a.mb, a.chunk))
            grad = None
            if k != last:
                grad = torch.empty(y.shape, dtype=y.dtype, device=y.device)  # contiguous, whatever y is
                _post(outbox, pending, dist.P2POp(dist.irecv, grad, ranks[(k + 1) % p], group,
                                                  _tag("B", a.mb, k + 1, n_stages))).wait()
            else:
                _post(outbox, pending)
            start = now()
            torch.autograd.backward(y, grad)
            if k > 0:
                outbox.append(dist.P2POp(dist.isend, x.grad.contiguous(), ranks[(k - 1) % p], group,
                                         _tag("B", a.mb, k, n_stages)))
                sent += 1
            del x, y, grad
        else:
            raise ValueError(f"action {a!r} has kind={a.kind!r}; valid kinds are 'F' and 'B'")
        events.append((a, start - t0, now() - t0))
    _post(outbox, pending)
    for work in pending:
        work.wait()
    if stash:
        raise ValueError(f"schedule left forwards without their backward: {sorted(stash)}")
    return PipelineResult([losses[i].item() for i in sorted(losses)], events, peak, peak_bytes, sent)


@torch.no_grad()
def exchange_tied_grad(param: torch.Tensor, peer: int, is_first: bool, group=None) -> None:
    """Sum a weight's gradient between the first and last stage, which both hold a copy (the tied
    embedding): each sends its own and adds the other's, first stage's term first, on both."""
    mine = param.grad.clone()
    theirs = torch.empty_like(mine)
    # one batch of a send and a receive: NCCL runs them together (a send and then a receive on
    # both ends, each waiting for the other's receive, could deadlock there)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer, group),
                                        dist.P2POp(dist.irecv, theirs, peer, group)]):
        work.wait()
    param.grad.copy_(mine + theirs if is_first else theirs + mine)
