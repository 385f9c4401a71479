"""labkit.plan: the plans come from the estimator, fit, rank by the stated step-time model, and
name what overflowed; Narayanan et al.'s Table 1 configurations fit where the paper ran them."""

from __future__ import annotations

import json

import pytest

from labkit.estimate import serving_memory, training_memory
from labkit.hardware import get_gpu
from labkit.plan import TERMS, plan_serving, plan_training
from labkit.plan.sweep import Dims
from labkit.shapes import PRESETS, ModelShape


def _gpt(L, a, h, s=2048, V=51200):
    return ModelShape(n_layer=L, d_model=h, n_head=a, vocab_size=V, seq_len=s)


# Narayanan et al. (2021), Table 1: (L, a, h), t, p, GPUs, global batch; A100 80 GB, s = 2048,
# V = 51200, full recomputation.
NARAYANAN = {
    "7.5B": ((36, 32, 4096), 4, 1, 128, 512),
    "18.4B": ((40, 48, 6144), 8, 1, 256, 1024),
    "39.1B": ((48, 64, 8192), 8, 2, 512, 1536),
    "76.1B": ((60, 80, 10240), 8, 4, 1024, 1792),
    "145.6B": ((80, 96, 12288), 8, 8, 1536, 2304),
    "310.1B": ((96, 128, 16384), 8, 16, 1920, 2160),
    "529.6B": ((105, 128, 20480), 8, 35, 2520, 2520),
    "1T": ((128, 160, 25600), 8, 64, 3072, 3072),
}


def _paper_memory(row, t, p):
    (L, a, h), _, _, n, batch = NARAYANAN[row]
    dp = n // (t * p)
    return training_memory(_gpt(L, a, h), seq_len=2048, micro_batch=1, dims=Dims(dp, t, p),
                           recompute="full", num_microbatches=batch // dp)


@pytest.mark.parametrize("row", NARAYANAN)
def test_narayanans_configurations_fit_an_80_gb_a100_and_t_p_1_does_not(row):
    _, t, p, _, _ = NARAYANAN[row]
    capacity = get_gpu("a100-80gb").memory_bytes
    assert _paper_memory(row, t, p).total <= capacity, f"{row}: the paper's t={t}, p={p} should fit"
    assert _paper_memory(row, 1, 1).total > capacity, f"{row}: t = p = 1 should not fit"


def test_every_plan_is_the_estimators_memory_fits_and_comes_fastest_first():
    shape = PRESETS["llama-2-7b"]
    found = plan_training(shape, gpu="a100-80gb", num_gpus=8, seq_len=4096, global_batch=16)
    assert found.plans and found.considered >= len(found.plans)
    times = [pl.step_time_s for pl in found.plans]
    assert times == sorted(times)
    for pl in found.plans[:: max(1, len(found.plans) // 20)]:
        want = training_memory(shape.replace(seq_len=4096), seq_len=4096, micro_batch=pl.micro_batch,
                               dims=Dims(pl.dp_size, pl.tp_size, pl.pp_size), zero_stage=pl.zero_stage,
                               recompute=pl.recompute, sequence_parallel=pl.sequence_parallel,
                               num_microbatches=pl.num_microbatches, schedule=pl.schedule, v=pl.v,
                               attention=pl.attention)
        assert pl.attention == "flash"  # the planner's default: a fused kernel, as real runs use
        assert pl.memory.to_dict() == want.to_dict() == training_memory(shape, pl.run).to_dict()
        assert want.total <= pl.limit_bytes
        assert pl.tp_size * pl.pp_size * pl.dp_size * pl.cp_size == 8
        assert pl.dp_size * pl.micro_batch * pl.num_microbatches == 16
    json.dumps(found.to_dict())  # what a script or a page reads


def test_a_layout_that_does_not_fit_names_the_term_that_overflowed():
    found = plan_training(PRESETS["llama-3-70b"], gpu="a100-80gb", num_gpus=8, seq_len=8192, global_batch=8)
    by_layout = {(o.tp_size, o.pp_size, o.dp_size): o for o in found.overflows}
    one = by_layout[(1, 1, 8)]  # ZeRO-3 over 8 leaves 16 bytes x 70.6B / 8 = 141 GB: states alone
    assert one.term in TERMS and one.message.startswith(f"{one.term}: ")
    terms = [getattr(one.leanest.memory, k) for k in TERMS]
    cut = TERMS.index(one.term)
    assert sum(terms[:cut]) <= one.limit_bytes < sum(terms[:cut + 1]) == one.bytes_so_far
    assert one.leanest.memory.total == min(pl.memory.total for pl in [one.leanest])


def test_nothing_fits_says_why():
    found = plan_training(PRESETS["llama-3-70b"], gpu="t4", num_gpus=1, seq_len=4096, global_batch=1,
                          precision="fp16-mixed")
    assert not found.plans and "params" in found.reason()


def test_a_bf16_plan_on_a_gpu_without_bf16_is_refused_by_name():
    kw = dict(num_gpus=1, seq_len=1024, global_batch=8)
    with pytest.raises(ValueError, match="precision='bf16-mixed' computes in bf16, which t4 has no peak for"):
        plan_training("gpt2-small", gpu="t4", **kw)  # the T4 (Turing) has fp16 tensor cores, no bf16
    fp16 = plan_training("gpt2-small", gpu="t4", precision="fp16-mixed", **kw).plans[0]
    for dtype, same in (("fp16", True), ("fp32", False)):  # timed at the fp16 peak, not fp32's
        other = plan_training("gpt2-small", gpu="t4", precision="fp16-mixed", dtype=dtype, **kw).plans[0]
        assert (fp16.step_time_s == other.step_time_s) == same


def test_a_smaller_memory_fraction_never_adds_plans():
    kw = dict(gpu="a100-80gb", num_gpus=8, seq_len=4096, global_batch=16)
    loose = plan_training(PRESETS["llama-2-13b"], **kw)
    tight = plan_training(PRESETS["llama-2-13b"], memory_fraction=0.5, **kw)
    assert {p.to_dict()["memory"]["total"] for p in tight.plans} <= {p.to_dict()["memory"]["total"] for p in loose.plans}
    assert len(tight.plans) < len(loose.plans)


@pytest.mark.parametrize("kw, match", [
    (dict(num_gpus=0), "num_gpus"), (dict(num_gpus=True), "num_gpus"), (dict(global_batch=2.0), "global_batch"),
    (dict(recompute=("some",)), "recompute"), (dict(zero_stages=(4,)), "zero_stages"),
    (dict(sequence_parallel=(1,)), "sequence_parallel"), (dict(micro_batches=()), "micro_batches"),
    (dict(efficiency=1.5), "efficiency"), (dict(gpu="b200"), "gpu"), (dict(precision="fp8"), "precision"),
])
def test_bad_planner_input_names_the_argument(kw, match):
    args = {**dict(gpu="a100", num_gpus=8, seq_len=1024, global_batch=8), **kw}
    with pytest.raises(ValueError, match=match):
        plan_training(PRESETS["gpt2-small"], **args)


def test_serving_plans_are_the_estimators_blocks_per_degree():
    shape = PRESETS["llama-3-70b"]
    found = plan_serving(shape, gpu="h100-sxm", num_gpus=8, context_len=8192)
    for pl in found.plans + found.refused:
        est = serving_memory(shape, gpu="h100-sxm", tp_size=pl.tp_size)
        assert (pl.num_blocks, pl.max_tokens) == (est.num_blocks, est.max_tokens)
        assert pl.total_concurrency == pl.max_concurrency * pl.replicas and pl.replicas * pl.tp_size == 8
    refused = {pl.tp_size: pl.bound for pl in found.refused}
    assert refused.get(1) == "weights"  # 141 GB of bf16 weights on one 80 GB GPU
    assert all(pl.bound in ("kv_cache", "max_num_seqs") for pl in found.plans)


def test_serving_refuses_a_context_past_the_model():
    with pytest.raises(ValueError, match="context_len"):
        plan_serving(PRESETS["llama-2-7b"], gpu="a100-80gb", context_len=5000)


def test_a_preset_name_plans_as_its_shape():
    kw = dict(gpu="a100-80gb", num_gpus=8, seq_len=4096, global_batch=16)
    assert plan_training("llama-2-7b", **kw).to_dict() == plan_training(PRESETS["llama-2-7b"], **kw).to_dict()


def test_even_stages_and_include_infeasible_narrow_and_widen_the_sweep():
    kw = dict(gpu="a100-80gb", num_gpus=16, seq_len=4096, global_batch=16)
    every = plan_training(PRESETS["llama-2-13b"], include_infeasible=True, **kw)
    fitting = plan_training(PRESETS["llama-2-13b"], **kw)
    even = plan_training(PRESETS["llama-2-13b"], even_stages=True, include_infeasible=True, **kw)
    assert len(every.plans) == every.considered > len(fitting.plans) == sum(pl.fits for pl in every.plans)
    assert {pl.pp_size for pl in every.plans} - {pl.pp_size for pl in even.plans} == {16}  # 40 layers
    assert all(40 % pl.pp_size == 0 for pl in even.plans)


def test_stepwise_sweep_reports_progress_and_ends_with_the_same_plans():
    kw = dict(gpu="a100-80gb", num_gpus=8, seq_len=2048, global_batch=16)
    steps = list(plan_training("gpt2-medium", stepwise=True, **kw))
    done = [d for d, _, found in steps if found is None]
    total = steps[-1][1]
    assert done == sorted(done) and done[0] == 0 and done[-1] == total > 1
    found, whole = steps[-1][2], plan_training("gpt2-medium", **kw)
    # a step per configuration and one at the end of each layout, then the plans
    assert len(steps) == whole.considered + total + 1 and sum(f is not None for _, _, f in steps) == 1
    assert [p.to_dict() for p in found.plans] == [p.to_dict() for p in whole.plans]
    with pytest.raises(ValueError, match="global_batch=0"):  # checked when asked, not at the first step
        plan_training("gpt2-medium", stepwise=True, **{**kw, "global_batch": 0})


def test_the_bf16_optimizer_is_planned_at_the_zero_stages_it_runs_at():
    """DeepSpeed's BF16 optimizer keeps its fp32 buffer unsharded: the sweep sizes ZeRO 0 and 1 only
    (labkit.zero.analytic.check_zero's rule), and refuses none of the other knobs for it."""
    kw = dict(gpu="a100-80gb", num_gpus=8, seq_len=2048, global_batch=64)
    found = plan_training("llama-3-8b", precision="bf16-mixed-fp32-buffer", **kw)
    assert found.plans and {pl.zero_stage for pl in found.plans} <= {0, 1}
    mixed = plan_training("llama-3-8b", precision="bf16-mixed-fp32-grads", **kw)
    assert {pl.zero_stage for pl in mixed.plans} >= {2, 3}  # the others still sweep every stage
    for pl in found.plans[:5]:  # 2 bytes a parameter more than the Megatron-style buffer, unsharded
        twin = next(q for q in mixed.plans if q.run == pl.run.replace(precision="bf16-mixed-fp32-grads"))
        assert pl.memory.grads - twin.memory.grads == pl.memory.params
