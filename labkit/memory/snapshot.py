"""Export a memory meter's record as a PyTorch memory snapshot, for https://pytorch.org/memory_viz.

On a GPU, ``torch.cuda.memory._record_memory_history()`` then ``_dump_snapshot(path)`` write a
pickle with ``"segments"`` (the allocator's state at the end) and ``"device_traces"`` (every
alloc and free). :func:`memory_snapshot` writes the same structure from what the meter saw, on
any device: one trace event per storage allocated or freed, its frame naming the category, the
phase and the operator, its ``time_us`` the index of the operator after which it happened. Addresses are synthetic (the meter sees storages, not the allocator's
blocks), so each live storage is its own segment; there is no fragmentation to see.
"""

from __future__ import annotations

import pickle
from pathlib import Path

__all__ = ["memory_snapshot", "dump_memory_snapshot"]

_ALIGN = 512  # the caching allocator's rounding, so that the picture looks like a real one


def _frame(rec, op_name, op_index):
    return {"filename": "labkit.memory", "line": op_index,
            "name": f"{rec.category or 'temporaries'} ({rec.phase}: {op_name})"}


def memory_snapshot(meter) -> dict:
    """The meter's allocations and frees as a snapshot dict (``segments``, ``device_traces``).

    ``meter`` is a :class:`MemoryMeter` after its ``with`` block has ended.
    """
    events = getattr(meter, "_events", None)
    if events is None or not hasattr(meter, "_ops"):
        raise TypeError(f"meter={type(meter).__name__} must be a labkit.memory.MemoryMeter")
    ops = meter._ops
    trace, live, next_addr = [], {}, 0  # live: id(record) -> (addr, size, frame)
    for op_index, rec, nbytes in sorted(events, key=lambda e: e[0]):  # time_us: the op index
        op = min(op_index, len(ops) - 1)
        key = id(rec)
        if key in live:  # a free (negative), or a resize in place (the change in size)
            addr, size, frames = live.pop(key)
            for action in ("free_requested", "free_completed"):
                trace.append({"action": action, "addr": addr, "size": size, "stream": 0,
                              "frames": frames, "time_us": op})
            if nbytes < 0:
                continue
            nbytes = size + nbytes  # resized in place: the new size
        if nbytes <= 0:
            continue
        frames = [_frame(rec, ops[op], op)]
        live[key] = (next_addr, nbytes, frames)
        trace.append({"action": "alloc", "addr": next_addr, "size": nbytes, "stream": 0,
                      "frames": frames, "time_us": op})
        next_addr += -(-nbytes // _ALIGN) * _ALIGN
    segments = []
    for addr, size, frames in sorted(live.values(), key=lambda v: v[0]):
        block = {"address": addr, "size": size, "requested_size": size,
                 "state": "active_allocated", "frames": frames}
        segments.append({"device": 0, "address": addr, "total_size": size, "allocated_size": size,
                         "active_size": size, "requested_size": size, "stream": 0,
                         "segment_type": "large", "segment_pool_id": (0, 0),
                         "is_expandable": False, "frames": frames, "blocks": [block]})
    return {"segments": segments, "device_traces": [trace]}


def dump_memory_snapshot(meter, path) -> Path:
    """Write :func:`memory_snapshot` as a pickle that pytorch.org/memory_viz opens; return path."""
    path = Path(path)
    with open(path, "wb") as f:
        pickle.dump(memory_snapshot(meter), f)
    return path
