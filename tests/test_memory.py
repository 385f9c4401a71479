"""labkit.memory and labkit.precision: the formulas, bad input, and the meter against references.

References that share no code with the meter: the closed-form byte counts of Chapter 1, torch's
own ``MemTracker`` (another TorchDispatchMode, written independently) on the very same step,
and, on a GPU, the CUDA caching allocator's peak.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from labkit.data import get_batch, load_corpus
from labkit.memory import (
    CATEGORIES, MemoryMeter, activation_bytes, korthikanti_activation_bytes, measure_step,
    model_state_bytes,
)
from labkit.model import GPTConfig, build_model, count_params
from labkit.precision import PRECISIONS, MasterWeightOptimizer, make_optimizer, model_dtype

SMALL = GPTConfig(n_layer=2, n_head=4, d_model=64, seq_len=32, vocab_size=256)


def _batch(batch_size, seq_len, device="cpu"):
    x, y = get_batch(load_corpus(), batch_size, seq_len, generator=torch.Generator().manual_seed(0))
    return x.to(device), y.to(device)


def _model_and_optimizer(cfg, precision, optimizer, device="cpu"):
    torch.manual_seed(0)
    model = build_model(cfg, device=device, dtype=model_dtype(precision))
    # The per-parameter loop on every device: "foreach" would allocate other temporaries on CUDA.
    return model, make_optimizer(model.parameters(), precision, optimizer, foreach=False)


# --- the formulas ---------------------------------------------------------------------------

def test_mixed_precision_adam_is_16_bytes_per_parameter():
    states = model_state_bytes(1, "mixed", "adam")
    assert (states.params, states.grads, states.optimizer) == (2, 2, 12)  # 2Ψ + 2Ψ + (4 + 4 + 4)Ψ
    assert states.total == 16


def test_a_7p5b_model_needs_120_gb_of_model_states():
    assert model_state_bytes(7_500_000_000, "mixed", "adam").total == 120 * 10**9  # ZeRO's example


@pytest.mark.parametrize("precision, optimizer, per_param", [
    ("fp32", "adam", 16), ("fp32", "adamw", 16), ("fp32", "sgd_momentum", 12), ("fp32", "sgd", 8),
    ("mixed", "adam", 16), ("mixed", "sgd_momentum", 12), ("mixed", "sgd", 8),
    ("bf16", "adam", 8), ("bf16", "sgd_momentum", 6), ("bf16", "sgd", 4),
])
def test_policy_table(precision, optimizer, per_param):
    n = 1000
    assert model_state_bytes(n, precision, optimizer).total == per_param * n


def test_adam_step_counters_are_four_bytes_per_tensor():
    assert model_state_bytes(10, "fp32", "adam", n_tensors=3).optimizer == 8 * 10 + 4 * 3
    assert model_state_bytes(10, "fp32", "sgd_momentum", n_tensors=3).optimizer == 4 * 10  # SGD keeps no step


def test_activation_formula_reduces_to_korthikanti_under_its_assumptions():
    # 16-bit activations, 1-byte dropout masks (CUDA), LayerNorm statistics left out: sbh(34 + 5as/h).
    cfg = GPTConfig(n_layer=2, n_head=8, d_model=256, seq_len=128, vocab_size=256, dropout=0.1)
    ours = activation_bytes(cfg, 3, dtype_bytes=2, device_type="cuda")
    without_ln_stats = ours.per_layer - ours.terms["layernorm mean and rstd (4 bs)"]
    assert without_ln_stats == korthikanti_activation_bytes(128, 3, 256, 8)


def test_activation_terms_scale_as_claimed():
    cfg = GPTConfig(n_layer=1, n_head=4, d_model=64, seq_len=64, vocab_size=256)
    one, two_b = activation_bytes(cfg, 1, 32), activation_bytes(cfg, 2, 32)
    two_s = activation_bytes(cfg, 1, 64)
    assert two_b.per_layer == 2 * one.per_layer  # every term is linear in b
    softmax = "softmax output (a s^2 b)"
    assert two_s.terms[softmax] == 4 * one.terms[softmax]  # the attention scores grow with s²
    assert two_s.terms["fc output = GELU input (4 sbh)"] == 2 * one.terms["fc output = GELU input (4 sbh)"]


def test_model_dtype_of_each_policy():
    assert [model_dtype(p) for p in ("fp32", "mixed", "bf16")] == [torch.float32, torch.bfloat16, torch.bfloat16]


def test_master_weight_optimizer_updates_fp32_copies_and_writes_them_back():
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    opt = make_optimizer(model.parameters(), "mixed", "sgd", lr=0.1)
    assert isinstance(opt, MasterWeightOptimizer)
    assert [m.dtype for m in opt.master] == [torch.float32, torch.float32]
    model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    # SGD's update applied to the fp32 master with the gradient cast to fp32 (torch's own add_)
    expected = [m.detach().clone().add_(p.grad.float(), alpha=-0.1) for p, m in zip(opt.params, opt.master)]
    opt.step()
    for p, m, want in zip(opt.params, opt.master, expected):
        assert torch.equal(m.detach(), want)  # the same fp32 arithmetic: bit for bit
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))  # the bf16 weight is the rounded master
        assert m.grad is None  # the fp32 gradient copies are dropped after the step


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: model_state_bytes(10, "fp8"), r"precision='fp8' is unknown; valid choices: " + re.escape(str(list(PRECISIONS)))),
    (lambda: model_state_bytes(10, "mixed", "lion"), r"optimizer='lion' is unknown; valid choices: .*'adamw'"),
    (lambda: model_state_bytes(-1), r"n_params=-1 must be an int >= 0"),
    (lambda: model_state_bytes(1.5e9), r"n_params=1500000000.0 must be an int"),
    (lambda: model_state_bytes(10, n_tensors=-2), r"n_tensors=-2"),
    (lambda: activation_bytes(SMALL, 0), r"batch_size=0 must be an int >= 1"),
    (lambda: activation_bytes(SMALL, 2, -5), r"seq_len=-5"),
    (lambda: activation_bytes(SMALL, 2, dtype_bytes=3), r"dtype_bytes=3 is unknown; valid choices: \[2, 4\]"),
    (lambda: activation_bytes(SMALL, 2, device_type="tpu"), r"device_type='tpu' is unknown; valid choices: \['cpu', 'cuda'\]"),
    (lambda: model_dtype("fp16"), r"precision='fp16' is unknown; valid choices"),
    (lambda: make_optimizer([torch.nn.Parameter(torch.ones(2))], "fp32", "adagrad"), r"optimizer='adagrad'"),
    (lambda: MasterWeightOptimizer([]), r"params is empty"),
    (lambda: measure_step(torch.nn.Linear(2, 2), None, (torch.ones(1, 2),)), r"optimizer=None"),
])
def test_bad_input_raises_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- the meter against the formulas -----------------------------------------------------------

@pytest.mark.parametrize("precision, optimizer, batch_size, cfg", [
    ("fp32", "adamw", 2, SMALL),
    ("mixed", "adam", 3, GPTConfig(n_layer=3, n_head=2, d_model=32, seq_len=48, vocab_size=256, dropout=0.1)),
    ("bf16", "sgd_momentum", 4, GPTConfig(n_layer=1, n_head=4, d_model=64, seq_len=16, vocab_size=256, dropout=0.2)),
])
def test_meter_matches_the_formulas_on_cpu(precision, optimizer, batch_size, cfg):
    model, opt = _model_and_optimizer(cfg, precision, optimizer)
    batch = _batch(batch_size, cfg.seq_len)
    measure_step(model, opt, batch)  # step 1 creates the optimizer states
    report = measure_step(model, opt, batch)
    states = model_state_bytes(count_params(cfg), precision, optimizer, n_tensors=len(list(model.parameters())))
    # Model states: every byte is a storage the meter sees, so they must agree exactly.
    assert report.max_by_category["parameters"] == states.params
    assert report.max_by_category["gradients"] == states.grads
    assert report.max_by_category["optimizer"] == states.optimizer
    # Activations: the CPU kernels save exactly the tensors of the derivation (masks in the activation dtype).
    e = model_dtype(precision).itemsize
    assert report.activations == activation_bytes(cfg, batch_size, dtype_bytes=e, device_type="cpu").total


def test_timeline_is_consistent():
    model, opt = _model_and_optimizer(SMALL, "mixed", "adamw")
    report = measure_step(model, opt, _batch(2, SMALL.seq_len))
    n = len(report.ops)
    assert len(report.phases) == n and all(len(report.timeline[c]) == n for c in CATEGORIES)
    totals = [sum(report.timeline[c][i] for c in CATEGORIES) for i in range(n)]
    assert report.peak_bytes == max(totals) == totals[report.peak_index]
    assert sum(report.at_peak.values()) == report.peak_bytes
    assert report.max_by_category == {c: max(report.timeline[c]) for c in CATEGORIES}
    # After zero_grad only the model and the optimizer remain, byte for byte what they hold.
    last = {c: report.timeline[c][-1] for c in CATEGORIES}
    assert last["gradients"] == last["activations"] == last["temporaries"] == 0
    assert last["parameters"] == sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert last["optimizer"] == sum(t.untyped_storage().nbytes() for t in opt.state_tensors())
    assert list(report.phase_bounds()) == ["(start)", "forward", "backward", "optimizer"]
    assert report.phases[report.peak_index] == report.peak_phase


# --- the meter against torch's MemTracker -----------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_meter_agrees_with_torch_memtracker(precision):
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    cfg = GPTConfig(n_layer=2, n_head=4, d_model=64, seq_len=32, vocab_size=256, dropout=0.1)
    model, opt = _model_and_optimizer(cfg, precision, "adamw")
    x, y = _batch(4, cfg.seq_len)
    measure_step(model, opt, (x, y))  # the optimizer states exist before both trackers start
    tracker = MemTracker()
    inner = getattr(opt, "inner", opt)  # MemTracker knows torch optimizers, not our master-weight wrapper
    tracker.track_external(model, inner, *getattr(opt, "master", []), x, y)
    cpu = torch.device("cpu")
    # Both modes watch the same execution, so both see every storage live and die at the same op.
    with MemoryMeter(model, opt) as meter, tracker:
        with meter.phase("forward"):
            loss = model(x, y)
        end_of_forward = tracker.get_tracker_snapshot("current")[cpu]
        with meter.phase("backward"):
            loss.backward()
            del loss
        with meter.phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    report = meter.report()
    peak = tracker.get_tracker_snapshot("peak")[cpu]
    # MemTracker also counts the batch (we handed it x and y); on CPU it counts exact storage bytes
    # (it rounds to 512 bytes only on CUDA), so the peaks must agree to the byte.
    batch_bytes = x.untyped_storage().nbytes() + y.untyped_storage().nbytes()
    assert peak["Total"] - batch_bytes == report.peak_bytes
    # Its "Activation" is what forward created and still holds when forward ends: our activations.
    assert end_of_forward[_MemRefType.ACT] == report.activations
    assert end_of_forward[_MemRefType.PARAM] == report.max_by_category["parameters"]


# --- a 7B step on fake tensors ------------------------------------------------------------------

_FAKE_7B = textwrap.dedent("""
    import json, resource, sys
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from labkit.memory import activation_bytes, measure_step, model_state_bytes
    from labkit.model import build_model, count_params, get_preset
    from labkit.precision import make_optimizer
    KIB = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in bytes on macOS, KiB on Linux
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB
    cfg = get_preset("llama-7b-like")
    with FakeTensorMode():
        model = build_model(cfg, dtype=torch.bfloat16)
        opt = make_optimizer(model.parameters(), "mixed", "adamw", foreach=False)
        x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
        y = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
        report = measure_step(model, opt, (x, y))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB
    states = model_state_bytes(count_params(cfg), "mixed", "adamw", n_tensors=len(list(model.parameters())))
    print(json.dumps({
        "rss_before": before, "rss_after": after,
        "measured": [report.max_by_category[c] for c in ("parameters", "gradients", "optimizer")],
        "predicted": [states.params, states.grads, states.optimizer],
        "activations": [report.activations, activation_bytes(cfg, 1, dtype_bytes=2, device_type="cpu").total],
        "peak": report.peak_bytes,
    }))
""")


def test_fake_7b_step_allocates_nothing_and_matches_the_formulas():
    proc = subprocess.run([sys.executable, "-c", _FAKE_7B], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # A real step would hold well over 100 GB; the fake one stays a small Python process.
    assert out["rss_after"] < 2 * 2**30, f"peak RSS {out['rss_after'] / 2**30:.2f} GiB"
    assert out["rss_after"] - out["rss_before"] < 1 * 2**30
    assert out["measured"] == out["predicted"]  # model states: exact
    assert out["activations"][0] == out["activations"][1]  # fake tensors follow the CPU kernels' saved tensors
    assert out["peak"] > sum(out["predicted"])  # the step needs more than its model states


# --- CUDA: the caching allocator as the reference ------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_meter_agrees_with_the_cuda_allocator(precision):
    cfg = GPTConfig(n_layer=4, n_head=8, d_model=256, seq_len=256, vocab_size=256, dropout=0.1)
    model, opt = _model_and_optimizer(cfg, precision, "adamw", device="cuda")
    batch = _batch(8, cfg.seq_len, device="cuda")
    measure_step(model, opt, batch)  # step 1: optimizer states, cuBLAS workspaces and the like exist after it
    report = measure_step(model, opt, batch)
    # Growth over the step, on both sides: what existed before the step cancels out.
    start = sum(report.timeline[c][0] for c in CATEGORIES)
    meter_growth = report.peak_bytes - start
    allocator_growth = report.allocator_peak_bytes - report.allocator_start_bytes
    # The allocator rounds every block up to a multiple of 512 bytes and may hold a few library
    # buffers the dispatcher never sees; with a growth of tens of MB that stays within 5 %.
    assert allocator_growth >= meter_growth * 0.99
    assert abs(allocator_growth - meter_growth) <= 0.05 * meter_growth
    # CUDA's fused dropout keeps 1-byte masks and LayerNorm keeps fp32 statistics: the formula knows.
    e = model_dtype(precision).itemsize
    predicted = activation_bytes(cfg, 8, dtype_bytes=e, device_type="cuda").total
    assert abs(report.activations - predicted) <= 0.05 * predicted


def test_a_collectives_late_release_is_not_counted_as_kept(tmp_path):
    """gloo's worker thread holds a finished collective's tensors a moment after the rank resumes
    (Lab 9 once counted such a 128-byte loss buffer as an activation). Here the release is late on
    purpose and for good: the Work, which holds the tensors it ran on, is kept past the forward.
    The meter runs collectives on copies it does not track, so the count stays that of what the
    caller keeps; the values and the autograd version counter are as without the meter."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        kept_plain = torch.full((16,), 3.0, dtype=torch.float64)
        version = kept_plain._version
        dist.all_reduce(kept_plain)
        bumps = kept_plain._version - version  # what the in-place collective does to the counter
        with MemoryMeter() as meter:
            with meter.phase("forward"):
                temp = torch.full((16,), 1.0, dtype=torch.float64)  # 128 bytes, dropped below
                late = dist.all_reduce(temp, async_op=True)  # its Work holds the tensor it ran on
                late.wait()
                kept = torch.full((16,), 2.0, dtype=torch.float64)  # 128 bytes, kept past forward
                version = kept._version
                dist.all_reduce(kept)
                gathered = torch.empty(16, dtype=torch.float64)  # written by the collective
                dist.all_gather_into_tensor(gathered, kept)
                del temp
        report = meter.report()
        assert report.activations == 2 * 128, report.table()  # kept and gathered; not temp
        assert late is not None  # the Work was alive past the forward: a late release, for good
        assert kept.tolist() == [2.0] * 16 and gathered.tolist() == [2.0] * 16  # written back
        assert kept._version - version == bumps  # bumped by the collective, not again by the copy
    finally:
        dist.destroy_process_group()


def test_strided_tensors_finds_what_tree_leaves_finds():
    """The meter's walk over an operator's arguments finds the strided tensors pytree finds, in
    the same order: in nested tuples, lists, dicts and named tuples, past scalars and None."""
    from collections import namedtuple

    from torch.utils._pytree import tree_leaves

    from labkit.memory.tensors import strided_tensors

    pair = namedtuple("pair", "a b")
    a, b, c, d = (torch.zeros(2) for _ in range(4))
    sparse = torch.zeros(2, 2).to_sparse()
    args = ((a, [b, 3, None, {"x": c, "y": (sparse, 1.5)}]), {"out": pair(d, "s")}, torch.float32)
    expected = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.layout == torch.strided]
    assert [id(t) for t in strided_tensors(args)] == [id(t) for t in expected] == [id(a), id(b), id(c), id(d)]
    assert strided_tensors(a) == [a] and strided_tensors(sparse) == [] and strided_tensors(None) == []
