"""labkit.accumulate against one full-batch step, on one process (the DDP window: test_accumulate_ddp.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from labkit.accumulate import (
    accumulate_gradients, count_tokens, accumulate_gradients_naive, accumulation_step, accumulation_step_naive,
    measure_microbatch, microbatch_for_budget, split_microbatches,
)
from labkit.data import get_batch, get_padded_batch, load_corpus
from labkit.memory import activation_bytes, model_state_bytes
from labkit.model import build_model, get_preset

CFG = get_preset("tiny", n_layer=2, seq_len=32)


class TokenMLP(torch.nn.Module):
    """embedding -> Linear -> norm -> GELU -> Linear: idx (B, T) -> logits (B, T, V); Lab 4 defines
    the same probe. ``norm="batch"`` normalises each feature over the B*T tokens it sees."""

    def __init__(self, vocab_size: int, d_model: int, norm: str):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab_size, d_model)
        self.fc = torch.nn.Linear(d_model, d_model)
        self.norm = torch.nn.BatchNorm1d(d_model) if norm == "batch" else torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab_size)

    def forward(self, idx):
        B, T = idx.shape
        h = self.fc(self.wte(idx)).view(B * T, -1)  # (B*T, C)
        h = F.gelu(self.norm(h)).view(B, T, -1)  # (B, T, C)
        return self.head(h)  # (B, T, V)
LENGTHS = [32, 30, 4, 3, 28, 5, 31, 2]  # long and short sequences: micro-batches differ in tokens


def batch(kind: str, batch_size: int = 8):
    gen = torch.Generator().manual_seed(0)
    if kind == "padded":
        return get_padded_batch(load_corpus(), LENGTHS[:batch_size], CFG.seq_len, generator=gen)
    return get_batch(load_corpus(), batch_size, CFG.seq_len, generator=gen)


def flat_grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def flat_params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def no_further_than_fp32(got, ref32, ref64, factor=2):
    """The flash-attention test rule: ``got`` (fp32) is no further from the fp64 reference than
    ``factor`` times the plain fp32 reference is, its round-off measured in this run (floored at
    one fp32 ulp of the reference's norm, so that a lucky exact reference cannot demand 0)."""
    floor = max((ref32.double() - ref64).norm(), 2**-24 * ref64.norm())
    return (got.double() - ref64).norm() <= factor * floor


def sgd64(model, x, y, lr=0.1):
    """One full-batch SGD step of a float64 copy of ``model``: its flat parameters."""
    m64 = copy.deepcopy(model).double()
    m64(x, y).backward()
    torch.optim.SGD(m64.parameters(), lr=lr).step()
    return flat_params(m64)


def full_batch_reference(model, x, y):
    """One full-batch step by the model's own loss, fp32 and fp64: (grads32, grads64, loss32, model32)."""
    m32, m64 = copy.deepcopy(model), copy.deepcopy(model).double()
    loss = m32(x, y)  # GPT's mean cross-entropy over targets != -100: no code shared with labkit.accumulate
    loss.backward()
    m64(x, y).backward()
    return flat_grads(m32), flat_grads(m64), loss.item(), m32


def test_split_microbatches_uneven_and_bad_input():
    x, y = batch("equal", batch_size=7)
    parts = split_microbatches(x, y, 3)
    assert [len(px) for px, _ in parts] == [3, 2, 2]
    assert torch.equal(torch.cat([px for px, _ in parts]), x) and torch.equal(torch.cat([py for _, py in parts]), y)
    for k in (0, 8):
        with pytest.raises(ValueError, match=f"num_microbatches={k}"):
            split_microbatches(x, y, k)


@pytest.mark.roundoff
@pytest.mark.parametrize("kind, batch_size, k", [("equal", 8, 4), ("equal", 7, 3), ("padded", 8, 3), ("padded", 8, 4)])
def test_accumulation_equals_full_batch_step(kind, batch_size, k):
    torch.manual_seed(0)
    model = build_model(CFG)
    x, y = batch(kind, batch_size)
    g32, g64, loss_full, ref = full_batch_reference(model, x, y)

    acc = copy.deepcopy(model)
    loss = accumulate_gradients(acc, split_microbatches(x, y, k))
    g_acc = flat_grads(acc)
    # Same sums in another order: the accumulated fp32 gradient may be no further from the fp64
    # gradient than twice the full-batch fp32 gradient is (the flash-attention test rule).
    assert (g_acc.double() - g64).norm() <= 2 * (g32.double() - g64).norm()
    # The loss, in float64: the window's bookkeeping (1/N, the padding) against the model's own
    # mean; round-off there is ~1e-16, so 1e-12 catches any wrong count or scale.
    loss64 = accumulate_gradients(copy.deepcopy(model).double(), split_microbatches(x, y, k))
    assert loss64 == pytest.approx(copy.deepcopy(model).double()(x, y).item(), rel=1e-12, abs=0)
    assert abs(loss - loss_full) <= 4 * 2**-24 * len(y.flatten()) * loss_full  # fp32 sums: n u bound

    # The optimizer step, by the same rule: the accumulated fp32 step no further from the fp64
    # step than twice the full-batch fp32 step is.
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    stepped = copy.deepcopy(model)
    accumulation_step(stepped, torch.optim.SGD(stepped.parameters(), lr=0.1), x, y, k)
    assert no_further_than_fp32(flat_params(stepped), flat_params(ref), sgd64(model, x, y))
    assert not torch.equal(flat_params(stepped), flat_params(model))  # a step was taken


def test_naive_normalisation_differs_by_the_predicted_token_weights():
    torch.manual_seed(0)
    model = build_model(CFG)
    x, y = batch("padded")
    k = 4
    g32, _, _, _ = full_batch_reference(model, x, y)
    model = model.double()  # the prediction is checked in float64: round-off ~1e-16, effect ~50%
    naive = copy.deepcopy(model)
    naive_loss = accumulate_gradients_naive(naive, split_microbatches(x, y, k))
    g_naive = flat_grads(naive)

    # The bug, predicted: a token of micro-batch i weighs N / (k N_i) instead of 1. Rebuild that
    # weighted loss in one full-batch pass with per-token weights and compare gradients.
    weighted = copy.deepcopy(model)
    token_loss = F.cross_entropy(weighted(x).flatten(0, 1), y.flatten(), reduction="none").view_as(y)  # (B, T)
    real = (y != -100).double()  # (B, T)
    rows = torch.arange(len(x)).tensor_split(k)
    counts = [real[r].sum() for r in rows]  # N_i
    weights = torch.cat([torch.full((len(r), 1), 1.0 / (k * float(n)), dtype=torch.float64)
                         for r, n in zip(rows, counts)])  # (B, 1)
    (token_loss * real * weights).sum().backward()
    # The same terms with the same weights, summed in another order, in float64: round-off of
    # gradients |g| < 0.5 is ~1e-17, so 1e-12 is far above it and far below the 50% effect.
    torch.testing.assert_close(g_naive, flat_grads(weighted), rtol=0, atol=1e-12)
    means = [(token_loss[r].detach() * real[r]).sum() / n for r, n in zip(rows, counts)]  # S_i / N_i
    assert naive_loss == pytest.approx(float(sum(means) / k), rel=1e-12)  # float64 sums

    relative = ((g_naive.float() - g32).norm() / g32.norm()).item()
    print(f"token counts per micro-batch {[int(n) for n in counts]}: naive gradient off by {relative:.1%}")
    assert relative > 0.1  # measured about 50% with these lengths; float noise is ~1e-7


def test_naive_equals_correct_when_token_counts_are_equal():
    torch.manual_seed(0)
    model = build_model(CFG)
    x, y = batch("equal")  # 8 full-length sequences, k = 4: every N_i = N / k
    a, b = copy.deepcopy(model).double(), copy.deepcopy(model).double()
    accumulation_step(a, torch.optim.SGD(a.parameters(), lr=0.1), x, y, 4)
    accumulation_step_naive(b, torch.optim.SGD(b.parameters(), lr=0.1), x, y, 4)
    # 1/(k N_i) == 1/N here, the scale applied in another order: in float64 that is ~1e-17 of
    # |p| <= ~1, and 1e-12 is far below any step a wrong scale would change (lr * |g| ~ 1e-3)
    torch.testing.assert_close(flat_params(a), flat_params(b), rtol=0, atol=1e-12)
    assert not torch.equal(flat_params(a), flat_params(copy.deepcopy(model).double()))  # it stepped


@pytest.mark.parametrize("norm", ["batch", "layer"])
def test_batchnorm_breaks_equivalence_layernorm_keeps_it(norm):
    torch.manual_seed(0)
    model = TokenMLP(vocab_size=256, d_model=32, norm=norm).double()  # float64: round-off ~1e-16
    x, y = torch.randint(256, (8, 16)), torch.randint(256, (8, 16))
    full = copy.deepcopy(model)
    F.cross_entropy(full(x).flatten(0, 1), y.flatten()).backward()
    acc = copy.deepcopy(model)
    accumulate_gradients(acc, split_microbatches(x, y, 4))
    relative = ((flat_grads(acc) - flat_grads(full)).norm() / flat_grads(full).norm()).item()
    print(f"{norm} norm: accumulated gradient off by {relative:.2e}")
    if norm == "layer":
        assert relative < 1e-12  # per-token statistics: only float64 summation order differs
    else:
        assert relative > 0.05  # per-micro-batch mean and variance: measured about 25%
        # the running statistics differ too: four updates from micro-batches instead of one
        assert not torch.allclose(acc.norm.running_var, full.norm.running_var, rtol=1e-3)


def test_window_errors_say_why():
    model = build_model(CFG)
    x, y = batch("padded")
    with pytest.raises(ValueError, match="no real tokens"):
        accumulate_gradients(model, split_microbatches(x, torch.full_like(y, -100), 2))
    with pytest.raises(ValueError, match="num_microbatches=0"):
        accumulation_step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y, 0)


def test_a_padding_marker_other_than_minus_100_is_passed_as_ignore_index():
    # a caller who marks padded targets with 0, a real byte here, must say so: then the loss and
    # the gradient equal those of the same batch padded with -100; left at the default, the
    # padding counts as targets and the loss silently changes
    torch.manual_seed(0)
    model = build_model(CFG)
    x, y = batch("padded")
    assert (y == 0).sum() == 0  # no real target is 0 here, so 0 marks padding unambiguously
    y0 = y.masked_fill(y == -100, 0)  # (B, T): padding marked with 0
    ref, zero_marked, default = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    loss_ref = accumulate_gradients(ref, split_microbatches(x, y, 4))
    loss_zero = accumulate_gradients(zero_marked, split_microbatches(x, y0, 4), ignore_index=0)
    loss_default = accumulate_gradients(default, split_microbatches(x, y0, 4))
    # the same terms summed in the same order: bit for bit
    assert loss_zero == loss_ref and torch.equal(flat_grads(zero_marked), flat_grads(ref))
    assert count_tokens(y0, ignore_index=0) == count_tokens(y) < count_tokens(y0)
    assert abs(loss_default - loss_ref) > 0.1  # the padding's loss is in it: a different number


def test_microbatch_for_budget_picks_the_largest_that_fits():
    torch.manual_seed(0)
    model = build_model(CFG)
    cache = {}

    def peak(b):  # measured, steady-state AdamW step
        if b not in cache:
            cache[b] = measure_microbatch(model, lambda p: torch.optim.AdamW(p, lr=1e-3), b, CFG.seq_len).peak_bytes
        return cache[b]

    global_batch = 8
    budget = (peak(5) + peak(6)) // 2  # between two sizes: 5 fits, 6 does not
    b, k = microbatch_for_budget(peak, global_batch, budget)
    brute = max(m for m in range(1, global_batch + 1) if peak(m) <= budget)  # linear scan
    assert (b, k) == (brute, 2) == (5, 2)
    sizes = [len(px) for px, _ in split_microbatches(*batch("equal"), k)]
    assert max(sizes) <= b and sum(sizes) == global_batch  # k steps of at most b reach the batch
    with pytest.raises(ValueError, match="below the peak of one sample"):
        microbatch_for_budget(peak, global_batch, peak(1) - 1)


def test_microbatch_for_budget_search_is_logarithmic():
    calls = []

    def peak(b):
        calls.append(b)
        return 1000 + 100 * b

    assert microbatch_for_budget(peak, 1000, 1000 + 100 * 37 + 50) == (37, 28)  # ceil(1000 / 37) = 28
    assert len(calls) <= 12  # log2(1000) + 2, against 1000 for a scan
    assert microbatch_for_budget(peak, 10, 10**9) == (10, 1)  # never larger than the global batch
    with pytest.raises(ValueError, match="global_batch_size=0"):
        microbatch_for_budget(peak, 0, 10**9)


def test_activations_scale_with_microbatch_model_states_do_not():
    torch.manual_seed(0)
    model = build_model(CFG)
    n_params = sum(p.numel() for p in model.parameters())
    states = model_state_bytes(n_params, "fp32", "adamw", n_tensors=len(list(model.parameters())))
    reports = {b: measure_microbatch(model, lambda p: torch.optim.AdamW(p, lr=1e-3), b, CFG.seq_len) for b in (1, 2, 4)}
    for b, r in reports.items():
        assert r.activations == activation_bytes(CFG, b, CFG.seq_len).total  # exact on CPU (Chapter 1)
        assert (r.max_by_category["parameters"], r.max_by_category["gradients"], r.max_by_category["optimizer"]) \
            == (states.params, states.grads, states.optimizer)  # the same bytes at every micro-batch
    a = {b: r.activations for b, r in reports.items()}
    assert a[4] - a[2] == 2 * (a[2] - a[1]) > 0  # linear in b
    assert reports[4].peak_bytes > reports[1].peak_bytes
