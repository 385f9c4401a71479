"""Count what the collectives move: calls and bytes per kind, on one rank (``labkit.dist.CommCounter``)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["CommCounter", "CommStats"]

_C10D = {  # dispatcher op name -> collective it implements
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "broadcast_": "broadcast", "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "send": "send", "recv_": "recv",
    "recv_any_source_": "recv",
}
_FUNCTIONAL = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "broadcast": "broadcast", "all_to_all_single": "all_to_all",
}


@dataclass
class CommStats:
    """Per-collective counts on one rank: calls, and bytes / elements of the full-size tensor."""

    calls: dict = field(default_factory=lambda: defaultdict(int))
    bytes: dict = field(default_factory=lambda: defaultdict(int))
    numel: dict = field(default_factory=lambda: defaultdict(int))

    def as_dict(self) -> dict:
        return {k: {"calls": self.calls[k], "bytes": self.bytes[k], "numel": self.numel[k]} for k in sorted(self.calls)}


def _payload(kind: str, args) -> tuple[int, int]:
    """(numel, bytes) of the full-size tensor a collective works on.

    all_reduce, broadcast, reduce: the tensor itself; all_gather: the gathered output;
    reduce_scatter: the unscattered input; send/recv: the message.
    """
    tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    if not tensors:
        return 0, 0
    if kind == "all_gather":  # c10d: (output(s), input); take the larger side
        big = max(sum(t.numel() for t in tensors[:-1]), tensors[-1].numel())
        return big, big * tensors[-1].element_size()
    if kind == "reduce_scatter":
        big = max(sum(t.numel() for t in tensors[1:]), tensors[0].numel())
        return big, big * tensors[0].element_size()
    numel = sum(t.numel() for t in tensors)
    return numel, sum(t.numel() * t.element_size() for t in tensors)


class CommCounter(TorchDispatchMode):
    """Count the collectives this process issues while active, by kind, in calls and bytes.

    Sees every collective that reaches the dispatcher, from ``torch.distributed`` calls in
    Python and from DDP's and FSDP's C++ code alike. Use one per rank::

        with CommCounter() as comm:
            train_step()
        comm.stats.calls["all_reduce"], comm.stats.bytes["all_reduce"]
    """

    def __init__(self):
        super().__init__()
        self.stats = CommStats()
        self.log: list[tuple[str, int]] = []  # (collective, bytes) in issue order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns, name = func.namespace, func.overloadpacket.__name__
        kind = _C10D.get(name) if ns == "c10d" else _FUNCTIONAL.get(name) if "functional" in ns else None
        if kind is not None:
            numel, nbytes = _payload(kind, args)
            self.stats.calls[kind] += 1
            self.stats.bytes[kind] += nbytes
            self.stats.numel[kind] += numel
            self.log.append((kind, nbytes))
        return func(*args, **(kwargs or {}))
