"""The published runs as they ran (labkit.plan.published) and the fused-kernel activation count.

Each published run is a RunConfig the shapes allow; the model's numbers come from the same
estimator and step-time model the planner uses (checked elsewhere against the meter and
CommCounter), so what is tested here is that each case states what its source reports, and the
fused count's structure: it keeps less than labkit's unfused block and drops what each
recomputation policy drops."""

from __future__ import annotations

import pytest

from labkit.estimate import training_memory
from labkit.memory import fused_llama_layer_bytes, llama_layer_bytes
from labkit.plan.published import NARAYANAN_TABLE1, PUBLISHED, model_run, narayanan_run


@pytest.mark.parametrize("key", sorted(PUBLISHED))
def test_each_published_run_is_a_valid_run_of_its_model_and_fills_its_cluster(key):
    case = PUBLISHED[key]
    run = case.run.check(case.shape)
    assert run.world_size == case.num_gpus and case.counts in ("hfu", "mfu") and case.source
    out = model_run(case)
    assert out["published_tflops"] == case.tflops and out["tflops"] > 0


def test_the_runs_use_what_their_sources_report():
    bloom, l8k, l128k = PUBLISHED["bloom-176b"], PUBLISHED["llama3-405b-8k"], PUBLISHED["llama3-405b-128k"]
    # BLOOM: no sequence parallelism, full checkpointing, the BF16 optimizer's fp32 gradients, ZeRO-1
    assert (bloom.run.sequence_parallel, bloom.run.recompute, bloom.run.zero_stage) == (False, "full", 1)
    assert bloom.run.precision == "bf16-mixed-fp32-buffer" and round(bloom.shape.num_params() / 1e9) == 176
    # Llama 3 at 8K: no activation checkpointing, interleaved, FSDP without resharding after forward
    assert (l8k.run.recompute, l8k.run.schedule, l8k.run.reshard_after_forward) == ("none", "interleaved", False)
    assert (l8k.run.tp_size, l8k.run.pp_size, l8k.run.dp_size, l8k.run.global_batch) == (8, 16, 64, 2048)
    assert (l128k.run.tp_size, l128k.run.cp_size, l128k.run.pp_size, l128k.run.dp_size) == (8, 16, 16, 8)
    # 126 layers on 16 stages, v = 2: chunks of unequal size, which the planner now runs
    assert l8k.shape.n_layer % (l8k.run.pp_size * l8k.run.v)


def test_narayanan_rows_fill_their_gpus_and_interleave_only_with_a_pipeline():
    for row in NARAYANAN_TABLE1:
        case = narayanan_run(row, v=2)
        assert case.run.world_size == row[6] and case.run.global_batch == row[7]
        assert case.run.v == (2 if row[5] > 1 and (row[7] // case.run.dp_size) % row[5] == 0 else 1)


@pytest.mark.parametrize("t, sp", [(1, False), (8, False), (8, True)])
@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_fused_kernels_keep_less_than_labkits_block_and_recomputation_drops_the_same(t, sp, attention):
    s, b, h, a, kv, f = 8192, 1, 16384, 128, 8, 53248  # Llama 3 405B's layer
    kw = dict(dtype_bytes=2, tp_size=t, sequence_parallel=sp, attention=attention)
    for rc in ("none", "selective"):
        fused = sum(fused_llama_layer_bytes(s, b, h, a, kv, f, recompute=rc, **kw).values())
        assert fused < sum(llama_layer_bytes(s, b, h, a, kv, f, recompute=rc, **kw).values())
    full = [sum(c(s, b, h, a, kv, f, recompute="full", **kw).values()) for c in (fused_llama_layer_bytes,
                                                                                  llama_layer_bytes)]
    assert full[0] == full[1] == s * b * h * 2 // (t if sp else 1)  # the block's input, either way
    none, sel = (fused_llama_layer_bytes(s, b, h, a, kv, f, recompute=rc, **kw) for rc in ("none", "selective"))
    dropped = {k: v for k, v in none.items() if k not in sel}
    assert len(dropped) == 1 and next(iter(dropped)).startswith("log-sum-exp" if attention == "flash" else "softmax")


def test_the_kernels_knob_reaches_the_estimate():
    case = PUBLISHED["llama3-405b-8k"]
    fused = training_memory(case.shape, case.run)
    labkit = training_memory(case.shape, case.run.replace(kernels="labkit"))
    assert fused.activations < labkit.activations and fused.params == labkit.params
    with pytest.raises(ValueError, match="kernels='triton'"):
        case.run.replace(kernels="triton")
