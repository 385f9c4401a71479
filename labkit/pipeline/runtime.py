"""Run one rank's share of a pipeline schedule with point-to-point sends and receives.

Each forward receives its input from the previous virtual stage (or takes the micro-batch, at
stage 0), runs the chunk and sends the output on; each backward receives the output's gradient
(or starts from the loss, at the last stage), runs autograd and sends the input's gradient back.
Sends are asynchronous and awaited at the end of the step, receives block, so a rank idles
exactly where the schedule makes it wait. The messages themselves are :mod:`.comm`'s. At the end
of the step the tied embedding's gradient is summed between the two ends, so a plain loop
(``zero_grad()``, ``run_schedule(...)``, ``step()``) trains like one process.
Runs the same under ``torchrun`` with NCCL (tensors on the rank's GPU).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..memory import MemoryMeter
from ..validate import check_int
from .comm import check_backend_order, exchange_tied_grad, message_tag, post
from .schedules import Action

__all__ = ["PipelineResult", "run_schedule", "exchange_tied_grad"]


@dataclass
class PipelineResult:
    """One rank's step: ``losses`` (last stage, one per micro-batch, unscaled), ``events``
    [(action, start, end)] in seconds from the step's start, ``peak_live`` the most
    (micro-batch, chunk) activations the rank held at once, ``peak_saved_bytes`` the most bytes
    of activations the rank held for backward at once (the memory meter's count; 0 when not
    counted), ``sent`` the messages it sent."""

    losses: list
    events: list
    peak_live: int
    peak_saved_bytes: int
    sent: int


class _StageRunner:
    """One rank's state through a step: what each forward keeps for its backward, the losses,
    the sends not yet posted or not yet finished, and the counts."""

    def __init__(self, chunks, *, rank, pp_size, inputs, targets, loss_fn, act_shape, act_dtype,
                 device, group, ranks, scale, count_saved):
        self.chunks, self.rank, self.p = chunks, rank, pp_size
        self.n_stages = pp_size * len(chunks)
        self.inputs, self.targets, self.loss_fn = inputs, targets, loss_fn
        self.act_shape, self.act_dtype, self.device = tuple(act_shape), act_dtype, device
        self.group, self.ranks, self.scale, self.count_saved = group, ranks, scale, count_saved
        self.on_gpu = torch.device(device).type == "cuda"
        self.stash, self.losses, self.saved = {}, {}, {}
        self.outbox, self.pending = [], []
        self.peak = self.sent = self.live_bytes = self.peak_bytes = 0

    def now(self) -> float:
        """On a GPU, wait for the queued kernels and receives: time what ran, not what was queued."""
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _peer(self, k: int) -> int:
        return self.ranks[k % self.p]

    def _recv(self, buf, k_from: int, kind: str, mb: int):
        op = dist.P2POp(dist.irecv, buf, self._peer(k_from), self.group,
                        message_tag(kind, mb, k_from, self.n_stages))
        post(self.outbox, self.pending, op).wait()

    def _send(self, t, k_to: int, kind: str, mb: int, k_from: int):
        self.outbox.append(dist.P2POp(dist.isend, t.contiguous(), self._peer(k_to), self.group,
                                      message_tag(kind, mb, k_from, self.n_stages)))
        self.sent += 1

    def _run_chunk(self, a: Action, k: int, x):
        """The chunk's forward (and loss, at the last stage); the bytes it keeps for backward."""
        if not self.count_saved:
            y = self.chunks[a.chunk](x)
            return y, (self.loss_fn(y, self.targets[a.mb]) if k == self.n_stages - 1 else None), 0
        with MemoryMeter() as meter, meter.phase("forward"):
            y = self.chunks[a.chunk](x)
            loss = self.loss_fn(y, self.targets[a.mb]) if k == self.n_stages - 1 else None
        return y, loss, meter.report().activations

    def forward(self, a: Action) -> float:
        k = a.chunk * self.p + self.rank  # this action's virtual stage
        if k == 0:
            x = self.inputs[a.mb]
            post(self.outbox, self.pending)
        else:
            x = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
            self._recv(x, k - 1, "F", a.mb)
            x.requires_grad_()
        start = self.now()
        y, loss, nbytes = self._run_chunk(a, k, x)
        self.saved[(a.mb, a.chunk)] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if loss is not None:
            self.losses[a.mb] = loss.detach()
            self.stash[(a.mb, a.chunk)] = (x, loss * self.scale)
        else:
            if tuple(y.shape) != self.act_shape:
                raise ValueError(f"virtual stage {k} outputs shape {tuple(y.shape)} but "
                                 f"act_shape={self.act_shape}: give the shape stages exchange")
            self._send(y.detach(), k + 1, "F", a.mb, k)
            self.stash[(a.mb, a.chunk)] = (x, y)
        self.peak = max(self.peak, len(self.stash))
        return start

    def backward(self, a: Action) -> float:
        k = a.chunk * self.p + self.rank
        x, y = self.stash.pop((a.mb, a.chunk))
        self.live_bytes -= self.saved.pop((a.mb, a.chunk))
        grad = None
        if k != self.n_stages - 1:
            grad = torch.empty(y.shape, dtype=y.dtype, device=y.device)  # contiguous, whatever y is
            self._recv(grad, k + 1, "B", a.mb)
        else:
            post(self.outbox, self.pending)
        start = self.now()
        torch.autograd.backward(y, grad)
        if k > 0:
            self._send(x.grad, k - 1, "B", a.mb, k)
        return start

    def finish(self) -> None:
        """Post the last sends and wait for every send of the step."""
        post(self.outbox, self.pending)
        for work in self.pending:
            work.wait()
        if self.stash:
            raise ValueError(f"schedule left forwards without their backward: {sorted(self.stash)}")


def _check_args(chunks, actions, rank, pp_size, ranks, act_shape):
    check_int("pp_size", pp_size, 1)
    check_int("rank", rank, 0, pp_size - 1)
    if not chunks:
        raise ValueError("chunks=[]: give this rank's model chunks (build_chunks)")
    if len(ranks) != pp_size:
        raise ValueError(f"ranks={ranks} must list pp_size={pp_size} global ranks")
    if act_shape is None:
        raise ValueError("act_shape=None: give the (B, T, C) shape of the activations stages exchange")
    for i, d in enumerate(act_shape):
        check_int(f"act_shape[{i}]", d, 1)
    bad = [a for a in actions if a.kind not in ("F", "B") or not 0 <= a.chunk < len(chunks)]
    if bad:
        raise ValueError(f"action {bad[0]!r}: kind must be 'F' or 'B' and chunk in "
                         f"[0, {len(chunks)})")


def run_schedule(chunks, actions: list[Action], *, rank: int, pp_size: int, inputs=None,
                 targets=None, loss_fn=None, act_shape=None, act_dtype=torch.float32,
                 device="cpu", group=None, ranks=None, loss_scale: float | None = None,
                 tied=None, count_saved: bool = True) -> PipelineResult:
    """Execute ``actions`` (this rank's list from a schedule) on ``chunks`` (its v modules).

    ``inputs``/``targets``: the m micro-batches (first / last virtual stage); ``loss_fn(output,
    target)``; ``act_shape``: the (B, T, C) shape stages exchange; ``ranks``: the stages' global
    ranks in ``group`` (default 0..p-1). Each micro-batch's loss is scaled by ``loss_scale``
    (default 1/m). Gradients accumulate in the chunks' ``.grad``; ``tied``: a parameter the first
    and last stage both hold, whose gradient the two sum at the end (the tied embedding); left
    alone where the chunks say their model's embeddings are untied (``StageChunk.tied_embeddings``).
    """
    ranks = list(range(pp_size)) if ranks is None else list(ranks)
    _check_args(chunks, actions, rank, pp_size, ranks, act_shape)
    check_backend_order(pp_size, len(chunks), group)
    m = 1 + max(a.mb for a in actions)
    # every stage is cut from the same model (check_same_model): all chunks agree on tying
    shared = all(getattr(c, "tied_embeddings", True) for c in chunks)
    ends = tied is not None and shared and pp_size > 1 and rank in (0, pp_size - 1)
    before = tied.grad.detach().clone() if ends and tied.grad is not None else None  # accumulated
    runner = _StageRunner(chunks, rank=rank, pp_size=pp_size, inputs=inputs, targets=targets,
                          loss_fn=loss_fn, act_shape=act_shape, act_dtype=act_dtype,
                          device=device, group=group, ranks=ranks, count_saved=count_saved,
                          scale=1.0 / m if loss_scale is None else loss_scale)
    events, t0 = [], runner.now()
    for a in actions:  # the schedule's loop: each action waits for its input, runs, sends on
        start = runner.forward(a) if a.kind == "F" else runner.backward(a)
        events.append((a, start - t0, runner.now() - t0))
    runner.finish()
    if ends:  # this step's part of the tied gradient, summed between the two ends
        exchange_tied_grad(tied, ranks[pp_size - 1 - rank], rank == 0, group, since=before)
    losses = [runner.losses[i].item() for i in sorted(runner.losses)]
    return PipelineResult(losses, events, runner.peak, runner.peak_bytes, runner.sent)
