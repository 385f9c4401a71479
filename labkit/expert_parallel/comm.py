"""The all-to-all of expert parallelism as an autograd Function, and the counts exchanged first.

Dispatch sends each rank's rows to the ranks holding their experts; combine sends them back.
Each is one ``all_to_all_single`` with uneven splits (Lepikhin et al. 2021, GShard; Fedus et al.
2022, Switch), and the backward of an all-to-all is the all-to-all with the splits swapped: the
gradient of a row goes back to the rank it came from.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_to_all", "exchange_counts"]


class _AllToAll(torch.autograd.Function):
    """rows (Σ send, ...) -> (Σ recv, ...): ``send[s]`` rows to rank s, ``recv[s]`` from it."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))  # (Σ recv, ...)
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))  # (Σ send, ...)
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group=None) -> torch.Tensor:
    """Rows of ``x`` (Σ send, ...), in rank order, to the ranks of ``group``; (Σ recv, ...) back.

    ``send[s]``: rows for rank s (0 allowed); ``recv[s]``: rows rank s sends here. Differentiable:
    its backward is the inverse all-to-all."""
    if x.size(0) != sum(send):
        raise ValueError(f"x has {x.size(0)} rows but send={send} sums to {sum(send)}")
    return _AllToAll.apply(x, list(send), list(recv), group)


def exchange_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """counts (ep · E_local,) int64, rows this rank sends to each rank's each expert -> the same
    shape: rows each rank sends to this rank's experts, source rank major. Not differentiable."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
