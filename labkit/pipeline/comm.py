"""The pipeline's point-to-point communication: tags, batched sends and receives, the tied
embedding's gradient exchange and the check that every stage was cut from the same model.

gloo matches a receive to a send by (peer, tag); NCCL by the order of the messages between two
ranks. An action's sends go out with the next action's receive in one ``batch_isend_irecv``,
which NCCL runs as a group (Megatron-LM's pipeline does the same), so two neighbours that each
send before receiving cannot wait for each other.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ..collectives import check_same_across_ranks

__all__ = ["message_tag", "post", "exchange_tied_grad", "check_same_model", "check_backend_order"]


def message_tag(kind: str, mb: int, k: int, n_stages: int) -> int:
    """The tag of the message virtual stage ``k`` sends for micro-batch ``mb``: "F" (its output)
    or "B" (its input's gradient); one tag per (kind, micro-batch, stage)."""
    return (mb * n_stages + k) * 2 + (kind == "B")


def post(outbox: list, pending: list, recv=None):
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


def check_backend_order(pp_size: int, v: int, group=None) -> None:
    """Refuse interleaving on two stages under a backend that matches messages by order (NCCL).

    With p = 2 both neighbours of a rank are the same peer, and the interleaved schedule sends
    it activations of one chunk while it waits for the gradient of another: the order in which
    one rank sends differs from the order in which the other receives. Tags keep them apart under
    gloo; NCCL ignores tags and would pair the wrong messages."""
    if pp_size == 2 and v > 1 and dist.is_initialized() and dist.get_backend(group) == "nccl":
        raise ValueError(f"pp_size=2 with v={v} chunks a rank under NCCL: both neighbours are one "
                         "peer and NCCL pairs messages by order, not by tag, which this schedule "
                         "breaks; use pp_size >= 3, v=1, or the gloo backend")


def _exchanged(param: torch.Tensor) -> bool:
    """Whether ``param.grad`` is, unchanged, the gradient the last exchange wrote."""
    ref, version = getattr(param, "_labkit_tied_mark", (None, None))
    return ref is not None and ref() is param.grad and param.grad._version == version


@torch.no_grad()
def exchange_tied_grad(param: torch.Tensor, peer: int, is_first: bool, group=None, since=None) -> None:
    """Sum a weight's gradient between the first and last stage, which both hold a copy (the tied
    embedding): each sends its own and adds the other's, first stage's term first, on both.

    ``since``: the gradient before this step (already summed), so that only the step's own part
    is exchanged and gradients accumulated over steps stay right. Calling it again on the same
    gradient does nothing (the exchanged gradient is marked), so a repeated call is harmless."""
    if param.grad is None:
        raise ValueError("exchange_tied_grad: param.grad is None; run the step's backward first")
    if _exchanged(param):
        return  # already summed: a second exchange would add the peer's term twice
    mine = param.grad.clone() if since is None else param.grad - since
    theirs = torch.empty_like(mine)
    # one batch of a send and a receive: NCCL runs them together (a send and then a receive on
    # both ends, each waiting for the other's receive, could deadlock there)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer, group),
                                        dist.P2POp(dist.irecv, theirs, peer, group)]):
        work.wait()
    total = mine + theirs if is_first else theirs + mine
    param.grad.copy_(total if since is None else since + total)
    param._labkit_tied_mark = (weakref.ref(param.grad), param.grad._version)


def check_same_model(model: torch.nn.Module, group=None) -> None:
    """Raise ValueError on every rank of ``group`` unless all hold bit-identical parameters.

    Every pipeline stage cuts its chunks from its own copy of the model: ranks built from
    different seeds would train a model that is none of theirs. Run once, before training."""
    check_same_across_ranks(model.named_parameters(), group, what="parameters (pipeline stages)")
