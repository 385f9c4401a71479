"""The mixed_fp32_grads (18 bytes per parameter) and mixed_fp32_buffer (20) policies and the
device-aware step counters."""

from __future__ import annotations

import copy

import pytest
import torch

from labkit.data import batches
from labkit.memory import measure_step, model_state_bytes
from labkit.model import build_model, count_params, get_preset
from labkit.precision import make_optimizer, model_dtype

CFG = get_preset("tiny", n_layer=2)
STATES = ("parameters", "gradients", "optimizer")


def _model_and_batches(precision, n=2):
    torch.manual_seed(0)
    model = build_model(CFG, dtype=model_dtype(precision))
    data = batches(2, CFG.seq_len, seed=1)
    return model, [next(data) for _ in range(n)]


@pytest.mark.parametrize("precision, grad_bytes", [("mixed_fp32_grads", 4), ("mixed_fp32_buffer", 2 + 4)])
def test_meter_measures_the_gradient_buffers_bytes_exactly(precision, grad_bytes):
    """18 bytes a parameter with Adam when each 16-bit gradient is freed into the buffer, 20 when
    the 16-bit gradients stay beside it (DeepSpeed's BF16 optimizer)."""
    model, (batch, _) = _model_and_batches(precision)
    opt = make_optimizer(model.parameters(), precision, "adamw", foreach=False)
    measure_step(model, opt, batch)  # Adam's moments are created in the first step
    report = measure_step(model, opt, batch)
    want = model_state_bytes(count_params(CFG), precision, "adamw", n_tensors=len(list(model.parameters())))
    assert [report.max_by_category[c] for c in STATES] == [want.params, want.grads, want.optimizer]
    assert (want.params, want.grads) == (2 * count_params(CFG), grad_bytes * count_params(CFG))


def test_fp32_buffer_sums_micro_batch_gradients_in_fp32():
    model, micro = _model_and_batches("mixed_fp32_grads")
    plain = copy.deepcopy(model)
    opt = make_optimizer(model.parameters(), "mixed_fp32_grads", "sgd", lr=0.0)
    want = [torch.zeros(p.shape) for p in plain.parameters()]
    for x, y in micro:  # the same micro-batches through a copy without the buffers
        plain.zero_grad(set_to_none=True)
        plain(x, y).backward()
        for w, p in zip(want, plain.parameters()):
            w += p.grad.float()
        model(x, y).backward()
    assert all(p.grad is None for p in model.parameters()), "the 16-bit .grad must be freed"
    for got, w in zip(opt.grad_tensors(), want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)  # same bf16 terms added in fp32: exact


def test_one_step_equals_mixed_precision():
    model, (batch, _) = _model_and_batches("mixed_fp32_grads")
    other = copy.deepcopy(model)
    for m, precision in ((model, "mixed_fp32_grads"), (other, "mixed")):
        opt = make_optimizer(m.parameters(), precision, "adamw", foreach=False)
        m(*batch).backward()
        opt.step()
    for a, b in zip(model.parameters(), other.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # one micro-batch: the same fp32 gradient


def test_bf16_optimizer_adds_each_backwards_gradients_when_it_ends():
    model, micro = _model_and_batches("mixed_fp32_buffer", n=3)
    plain = copy.deepcopy(model)
    opt = make_optimizer(model.parameters(), "mixed_fp32_buffer", "sgd", lr=0.0)
    # the embedding's gradient comes last in a backward: every other gradient exists by then
    seen = []
    hook = model.wte.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(sum(float(buf.abs().sum()) for buf in opt.grad_tensors())))
    want = [torch.zeros(p.shape) for p in plain.parameters()]
    for x, y in micro:
        plain.zero_grad(set_to_none=True)
        plain(x, y).backward()
        for w, p in zip(want, plain.parameters()):
            w += p.grad.float()
        model(x, y).backward()
        assert all(not p.grad.any() for p in model.parameters()), "the 16-bit .grad must be added and zeroed"
    hook.remove()
    assert seen[0] == 0, "the buffers must stay untouched until the first backward ends"
    for got, w in zip(opt.grad_tensors(), want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)  # the same bf16 terms added in fp32


def test_bf16_optimizer_after_a_backward_that_raised_still_adds_the_next_one():
    model, (batch, _) = _model_and_batches("mixed_fp32_buffer")
    opt = make_optimizer(model.parameters(), "mixed_fp32_buffer", "sgd", lr=0.0)

    def fail(p):
        raise RuntimeError("a backward interrupted")

    hook = model.wte.weight.register_post_accumulate_grad_hook(fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        model(*batch).backward()
    hook.remove()
    opt.zero_grad()
    model(*batch).backward()
    assert all(not p.grad.any() for p in model.parameters()), "the second backward's gradients were not added"
    assert all(buf.any() for buf in opt.grad_tensors())


def test_step_counters_are_device_memory_only_where_they_live():
    cpu = model_state_bytes(10, "fp32", "adam", n_tensors=3)
    cuda = model_state_bytes(10, "fp32", "adam", n_tensors=3, device_type="cuda")
    fused = model_state_bytes(10, "fp32", "adam", n_tensors=3, device_type="cuda", step_on_device=True)
    assert (cpu.optimizer, cuda.optimizer, fused.optimizer) == (8 * 10 + 4 * 3, 8 * 10, 8 * 10 + 4 * 3)
    with pytest.raises(ValueError, match=r"device_type='tpu' is unknown; valid choices: \['cpu', 'cuda'\]"):
        model_state_bytes(10, device_type="tpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_meter_on_cuda_leaves_adams_host_step_counters_out():
    torch.manual_seed(0)
    model = build_model(CFG, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x, y = next(batches(2, CFG.seq_len, device="cuda"))
    measure_step(model, opt, (x, y))
    report = measure_step(model, opt, (x, y))
    want = model_state_bytes(count_params(CFG), "fp32", "adamw",
                             n_tensors=len(list(model.parameters())), device_type="cuda")
    assert report.max_by_category["optimizer"] == want.optimizer
