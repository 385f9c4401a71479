"""The meter's record exported as a PyTorch memory snapshot (the pytorch.org/memory_viz format)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.cuda._memory_viz as memory_viz

from labkit.data import batches
from labkit.memory import CATEGORIES, MemoryMeter
from labkit.memory.snapshot import dump_memory_snapshot, memory_snapshot
from labkit.model import build_model, get_preset
from labkit.precision import make_optimizer


@pytest.fixture(scope="module")
def recorded():
    """One measured training step of a two-layer GPT: (meter, report)."""
    cfg = get_preset("tiny", n_layer=2)
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = make_optimizer(model.parameters(), "fp32", "adamw", foreach=False)
    x, y = next(batches(2, cfg.seq_len))
    with MemoryMeter(model, opt) as meter:
        with meter.phase("forward"):
            loss = model(x, y)
        with meter.phase("backward"):
            loss.backward()
            del loss
        with meter.phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    return meter, meter.report()


def test_snapshot_has_the_structure_the_viewer_reads(recorded, tmp_path):
    meter, _ = recorded
    path = dump_memory_snapshot(meter, tmp_path / "step.pickle")
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert set(snap) == {"segments", "device_traces"} and len(snap["device_traces"]) == 1
    trace = snap["device_traces"][0]
    assert trace and {e["action"] for e in trace} == {"alloc", "free_requested", "free_completed"}
    for e in trace:
        assert {"action", "addr", "size", "stream", "frames", "time_us"} <= set(e), e
        assert e["frames"] and {"filename", "line", "name"} <= set(e["frames"][0])
    for seg in snap["segments"]:
        assert seg["total_size"] == sum(b["size"] for b in seg["blocks"])
        assert all(b["state"] == "active_allocated" for b in seg["blocks"])
    # torch's own readers accept it on a CPU (the html plots embed the same pickle the site reads)
    assert "segments: " in memory_viz.segsum(snap)
    assert f"{len(trace)} entries" in memory_viz.trace(snap)
    assert "Active Memory Timeline" in memory_viz.trace_plot(snap)


def test_replaying_the_trace_gives_the_meters_timeline(recorded):
    meter, report = recorded
    snap = memory_snapshot(meter)
    live, by_op = {}, {}
    for e in snap["device_traces"][0]:  # time_us is the op after which the event happened
        if e["action"] == "alloc":
            assert e["addr"] not in live, "an address allocated twice while live"
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            assert live.pop(e["addr"]) == e["size"], "a free that matches no allocation"
        by_op[e["time_us"]] = sum(live.values())
    totals = [sum(report.timeline[c][i] for c in CATEGORIES) for i in range(len(report.ops))]
    replayed, current = [], 0
    for i in range(len(totals)):
        current = by_op.get(i, current)
        replayed.append(current)
    assert replayed == totals
    assert sum(live.values()) == sum(s["total_size"] for s in snap["segments"]) == totals[-1]
    assert max(replayed) == report.peak_bytes


def test_only_a_memory_meter_is_accepted():
    with pytest.raises(TypeError, match="meter=dict must be a labkit.memory.MemoryMeter"):
        memory_snapshot({})
