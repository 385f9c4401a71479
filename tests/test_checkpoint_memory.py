"""labkit.checkpoint's memory: the meter against the per-policy formulas, depth scaling, budgets.

The formulas (labkit.checkpoint.analytic) are derived from the model's code; the meter
(labkit.memory.MemoryMeter) watches every storage the step allocates. They share no code.
"activations" is what the forward leaves alive for backward; "peak" is the largest sum of
activations and temporaries at any operator of forward and backward.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from labkit.checkpoint import (
    apply_checkpointing, checkpoint_activation_bytes, min_peak_plan, plan_for_budget, recompute_flops,
)
from labkit.memory import activation_bytes, measure_forward_backward, korthikanti_activation_bytes
from labkit.model import GPTConfig, build_model

POLICIES = [("none", None), ("full", None), ("every_k", 2), ("sqrt", None), ("selective", None)]


def measure(model, batch):
    """(activations kept at the end of forward, peak of activations + temporaries) of one step."""
    report = measure_forward_backward(model, batch)
    return report.activations, report.peak_of("activations", "temporaries")


def _setup(cfg, batch_size, training=True, seed=0):
    torch.manual_seed(seed)
    model = build_model(cfg).train(training)
    g = torch.Generator().manual_seed(seed)
    batch = tuple(torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), generator=g) for _ in range(2))
    return model, batch


# Short sequences (the MLP dominates the peak) and long ones (the s^2 scores do); b = 1 lets
# matmul take q, k, v as views instead of copies, which moves the peak by whole (B, T, C) tensors.
# With a vocabulary far wider than the batch, the tied embedding's two V x h gradients do.
CASES = [
    (GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=4, vocab_size=500, dropout=0.1), 1, True),
    (GPTConfig(n_layer=4, n_head=4, d_model=64, seq_len=32, vocab_size=64, dropout=0.1), 2, True),
    (GPTConfig(n_layer=3, n_head=4, d_model=32, seq_len=128, vocab_size=50, dropout=0.1), 2, True),
    (GPTConfig(n_layer=3, n_head=4, d_model=32, seq_len=128, vocab_size=50, dropout=0.1), 1, False),
]


@pytest.mark.parametrize("cfg, batch_size, training", CASES, ids=["wide-vocab-train-b1", "short-train-b2", "long-train-b2", "long-eval-b1"])
def test_measured_memory_per_policy_equals_the_formulas(cfg, batch_size, training):
    plain, batch = _setup(cfg, batch_size, training)
    for policy, k in POLICIES:
        model = copy.deepcopy(plain)
        apply_checkpointing(model, policy, k=k)
        kept, peak = measure(model, batch)
        want = checkpoint_activation_bytes(cfg, policy, batch_size, k=k, training=training)
        # exact on CPU: every term is a storage of the model's code, sized from its shape
        assert (kept, peak) == (want.kept, want.peak), policy


def test_the_formulas_tie_to_chapter_1_and_to_korthikanti():
    cfg = GPTConfig(n_layer=4, n_head=4, d_model=64, seq_len=32, vocab_size=64, dropout=0.1)
    per_layer = activation_bytes(cfg, 2)
    by_policy = {p: checkpoint_activation_bytes(cfg, p, 2, k=k) for p, k in POLICIES}
    u = 2 * cfg.seq_len * cfg.d_model * 4  # one (B, T, C) fp32 tensor
    scores = cfg.n_head * cfg.seq_len ** 2 * 2 * 4  # one (B, nh, T, T) fp32 tensor
    assert by_policy["none"].kept == per_layer.total
    assert by_policy["full"].kept == per_layer.head + cfg.n_layer * u  # the block inputs: 2sbh in 16 bits
    assert by_policy["selective"].kept == per_layer.total - cfg.n_layer * 3 * scores  # softmax, mask, dropout
    assert by_policy["sqrt"].kept == per_layer.head + 2 * u  # two segments of two blocks
    # In 16 bits with 1-byte masks on CUDA, selective leaves Korthikanti's 34 sbh minus LayerNorm statistics.
    h16 = activation_bytes(cfg, 2, dtype_bytes=2, device_type="cuda")
    sel16 = checkpoint_activation_bytes(cfg, "selective", 2, dtype_bytes=2, device_type="cuda")
    s, b, h, a = cfg.seq_len, 2, cfg.d_model, cfg.n_head
    assert h16.per_layer - h16.terms["layernorm mean and rstd (4 bs)"] == korthikanti_activation_bytes(s, b, h, a)
    assert sel16.kept_per_block[0] == 34 * s * b * h + h16.terms["layernorm mean and rstd (4 bs)"]


def _fit_exponent(depths, values):
    """p in value = c * depth^p, least squares in log-log."""
    return float(np.polyfit(np.log(depths), np.log(values), 1)[0])


def test_peak_grows_linearly_without_checkpointing_and_as_sqrt_n_with_sqrt():
    # A small vocabulary keeps the depth-independent head under 3% of the peak at 4 blocks.
    base = GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=32, vocab_size=16, dropout=0.1)
    depths = [4, 9, 16, 25]  # perfect squares: sqrt cuts them into sqrt(n) segments of sqrt(n) blocks
    peaks = {"none": [], "sqrt": [], "full": []}
    for n in depths:
        cfg = GPTConfig(**{**base.to_dict(), "n_layer": n})
        plain, batch = _setup(cfg, 1)
        for policy in peaks:
            if policy == "full" and n > 9:
                continue  # two depths fix a line; the larger ones only cost time
            model = copy.deepcopy(plain)
            apply_checkpointing(model, policy)
            peaks[policy].append(measure(model, batch)[1])
    p_none, p_sqrt = _fit_exponent(depths, peaks["none"]), _fit_exponent(depths, peaks["sqrt"])
    print(f"peak ~ n^{p_none:.2f} without checkpointing, n^{p_sqrt:.2f} with sqrt(n) segments")
    assert 0.95 < p_none <= 1.0  # linear; the constant head pulls the log-log slope just below 1
    assert 0.45 < p_sqrt < 0.6  # sqrt(n) segments of sqrt(n) blocks: both terms grow as sqrt(n)
    # Full checkpointing is linear again, in the block inputs alone: slope u per block, not A.
    slope = np.polyfit(depths[:2], peaks["full"], 1)[0]
    assert slope == pytest.approx(32 * 32 * 4, rel=1e-9)  # exactly one (B, T, C) fp32 tensor per block


def test_the_budgeted_plan_fits_every_budget_of_a_sweep():
    cfg = GPTConfig(n_layer=4, n_head=4, d_model=64, seq_len=32, vocab_size=64, dropout=0.1)
    plain, batch = _setup(cfg, 2)
    smallest, _ = min_peak_plan(cfg, 2)
    largest = checkpoint_activation_bytes(cfg, "none", 2).peak
    flops = []
    for budget in np.linspace(smallest, largest, 6).astype(int).tolist():
        model = copy.deepcopy(plain)
        plan = apply_checkpointing(model, "budget", budget=budget, batch_size=2)
        _, peak = measure(model, batch)
        assert peak <= budget, (budget, str(plan))
        flops.append(recompute_flops(cfg, plan, 2))
    assert flops == sorted(flops, reverse=True) and flops[-1] == 0 < flops[0]  # more memory, less work


def test_the_planner_scales_to_published_shapes():
    cfg = GPTConfig(n_layer=24, n_head=16, d_model=1024, seq_len=1024, vocab_size=50257)  # GPT-2 medium
    none = checkpoint_activation_bytes(cfg, "none", 8, dtype_bytes=2, device_type="cuda")
    plan = plan_for_budget(cfg, none.peak // 3, 8, dtype_bytes=2, device_type="cuda")
    assert checkpoint_activation_bytes(cfg, plan, 8, dtype_bytes=2, device_type="cuda").peak <= none.peak // 3
    assert 0 < recompute_flops(cfg, plan, 8) < recompute_flops(cfg, "full", 8)  # cheaper than full


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_gradients_and_kept_activations():
    cfg = GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=64, vocab_size=256, dropout=0.1)
    torch.manual_seed(0)
    plain = build_model(cfg, device="cuda")
    batch = tuple(torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), device="cuda") for _ in range(2))

    def grads(model):
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        model(*batch).backward()
        return [p.grad.clone() for p in model.parameters()]

    reference = grads(plain)
    for policy, k in POLICIES:
        for impl in ("scratch", "torch"):
            model = copy.deepcopy(plain)
            apply_checkpointing(model, policy, k=k, impl=impl)
            for a, b in zip(grads(model), reference):
                # CUDA picks reduction orders per call (atomics in some backward kernels): fp32 round-off
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            kept, _ = measure(model, batch)
            want = checkpoint_activation_bytes(cfg, policy, 2, k=k, device_type="cuda").kept
            # the formula is CPU-exact: it counts the q, k, v copies that the CPU's matmul makes for
            # b > 1 and a > 1, 3 (B, T, C) tensors a block; CUDA's batched matmul may read them
            # strided instead, so a block may keep up to that much less, and nothing else may differ
            copies = cfg.n_layer * 3 * 2 * cfg.seq_len * cfg.d_model * 4  # 3 sbh e a block, fp32, b = 2
            assert abs(kept - want) <= copies, (policy, impl, kept, want)
