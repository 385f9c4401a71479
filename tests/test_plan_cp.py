"""labkit.plan with context parallelism: long sequences fit only with cp > 1, Llama 3 405B's
128K configuration fits, short sequences keep cp = 1, the ring's bytes are the analytic
function's and hide behind compute on a fast link, and bad degrees are refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.context_parallel import block_flops, chunk_offsets, hide_chunk_tokens, ring_bytes_per_layer, ring_step_flops
from labkit.estimate import training_memory
from labkit.hardware import get_gpu
from labkit.plan import plan_training
from labkit.plan.sweep import CP_MIN_SEQ_LEN, Dims, cp_degrees
from labkit.shapes import PRESETS

ROOT = Path(__file__).resolve().parents[1]
L405 = PRESETS["llama-3.1-405b"]
LONG = dict(gpu="h100-sxm", num_gpus=16384, seq_len=131072, global_batch=128)  # 16M tokens a step
LEAN = dict(micro_batches=(1,), zero_stages=(1,), sequence_parallel=(True,), interleave=(1,))
# Grattafiori et al. (2024), Table 4, the 131,072-token stage: t, cp, p, N_d on 16,384 H100s
LLAMA3_128K = (8, 16, 16, 8)


def test_at_128k_tokens_only_context_parallel_plans_fit_llama_3_405b_as_labkit_counts_it():
    # labkit's model (attention="eager": the (a, s, s) scores kept): without cp the activations overflow
    found = plan_training(L405, attention="eager", include_unrunnable=True, **LONG, **LEAN)
    assert found.plans and all(pl.cp_size > 1 for pl in found.plans)
    no_cp = [o for o in found.overflows if o.cp_size == 1]
    assert no_cp and all(o.term == "activations" for o in no_cp), [o.message for o in no_cp]
    # every cp = 1 layout the sweep sized overflows: none is missing from the overflows
    every = plan_training(L405, attention="eager", include_unrunnable=True, include_infeasible=True, **LONG, **LEAN)
    layouts = {(pl.tp_size, pl.pp_size, pl.dp_size) for pl in every.plans if pl.cp_size == 1}
    assert layouts == {(o.tp_size, o.pp_size, o.dp_size) for o in no_cp}
    assert (LLAMA3_128K in {(pl.tp_size, pl.cp_size, pl.pp_size, pl.dp_size) for pl in found.plans})
    for pl in found.plans[:: max(1, len(found.plans) // 10)]:  # t cp p N_d fills the GPUs
        assert pl.tp_size * pl.cp_size * pl.pp_size * pl.dp_size == LONG["num_gpus"]


def test_with_a_fused_kernel_cp_1_fits_at_128k_but_leaves_the_pipeline_idle():
    flash = plan_training(L405, include_unrunnable=True, **LONG, **LEAN)
    assert flash.plans[0].attention == "flash" and flash.plans[0].cp_size > 1
    no_cp = [pl for pl in flash.plans if pl.cp_size == 1]
    # 128 sequences over N_d = 16384 / (t p) replicas: m = 128 / N_d micro-batches for p stages,
    # m / p = 1/16 whatever the layout, and the bubble (p - 1)/(m + p - 1) idles most of the step
    assert no_cp and all(pl.recompute == "full" and pl.step.bubble > 0.9 for pl in no_cp)
    assert flash.plans[0].mfu > 5 * max(pl.mfu for pl in no_cp)
    assert LLAMA3_128K in {(pl.tp_size, pl.cp_size, pl.pp_size, pl.dp_size) for pl in flash.plans}
    # what labkit runs: context parallelism composes with the pipeline (tests/test_parallelize.py),
    # so Llama 3's own layout is among the plans labkit runs, and nothing here is refused
    runnable = plan_training(L405, **LONG, **LEAN)
    assert LLAMA3_128K in {(pl.tp_size, pl.cp_size, pl.pp_size, pl.dp_size) for pl in runnable.plans}
    assert not runnable.refused


def test_llama_3_405b_128k_configuration_fits_an_h100_by_the_estimator_and_not_without_cp():
    t, cp, p, dp = LLAMA3_128K
    kw = dict(seq_len=131072, micro_batch=1, zero_stage=1, recompute="full", sequence_parallel=True,
              num_microbatches=LONG["global_batch"] // dp)
    capacity = get_gpu("h100-sxm").memory_bytes
    assert training_memory(L405, dims=Dims(dp, t, p, cp), **kw).total <= 0.9 * capacity
    # the same t and p, the cp ranks given to data parallelism: the sequence's activations overflow
    assert training_memory(L405, dims=Dims(dp * cp, t, p, 1), **kw).total > capacity


def test_short_sequences_keep_cp_1_by_default():
    kw = dict(gpu="h100-sxm", num_gpus=64, seq_len=8192, global_batch=512)
    assert cp_degrees(8192, 64) == (1,) and 8192 < CP_MIN_SEQ_LEN
    default = plan_training(PRESETS["llama-3-70b"], **kw)
    assert default.plans and all(pl.cp_size == 1 for pl in default.plans)
    assert default.to_dict() == plan_training(PRESETS["llama-3-70b"], context_parallel=(1,), **kw).to_dict()
    # from CP_MIN_SEQ_LEN on, the powers of two that divide the GPUs and 2 cp the sequence
    assert cp_degrees(CP_MIN_SEQ_LEN, 48) == (1, 2, 4, 8, 16)
    assert cp_degrees(3 * CP_MIN_SEQ_LEN, 2 ** 15)[-1] == 2 ** 13  # 2 cp divides 3 x 2^14 up to cp = 2^13


def _ring(shape, pl):
    """The ring's bytes of one step by the analytic function: forward (twice when recomputed) and
    backward, per layer of a stage and micro-batch."""
    one = dict(batch_size=pl.micro_batch, seq_len=shape.seq_len, n_kv_head=shape.kv_heads // pl.tp_size,
               head_dim=shape.head_dim, cp_size=pl.cp_size)
    passes = 1 if pl.recompute == "none" else 2
    per_layer = (passes * ring_bytes_per_layer(**one, direction="forward")
                 + ring_bytes_per_layer(**one, direction="backward"))
    return shape.n_layer // pl.pp_size * pl.num_microbatches * per_layer


def test_the_ring_bytes_are_the_analytic_functions_and_hide_only_on_a_fast_enough_link():
    shape = PRESETS["llama-3-8b"].replace(seq_len=65536)
    kw = dict(gpu="h100-sxm", num_gpus=16, seq_len=65536, global_batch=4, micro_batches=(1,), zero_stages=(1,),
              recompute=("none", "full"), sequence_parallel=(False,), interleave=(1,), include_infeasible=True,
              include_unrunnable=True)
    found = plan_training(shape, context_parallel=(1, 2, 4, 8, 16), network_gbps=25.0, **kw)
    ring = [pl for pl in found.plans if pl.cp_size > 1]
    assert {pl.cp_size for pl in ring} == {2, 4, 8, 16} and {pl.recompute for pl in ring} == {"none", "full"}
    for pl in ring:
        assert pl.step.comm_bytes["context"] == _ring(shape, pl)
        replicas = pl.dp_size * pl.cp_size  # the gradient all-reduce spans N_d cp ranks
        params = shape.stage_params(pl.tp_size, pl.pp_size, 0)  # the first stage's, with the embedding
        assert pl.step.comm_bytes["data"] == pytest.approx(2 * (replicas - 1) / replicas * params * 2)
    assert all(pl.step.comm_bytes["context"] == 0 and pl.step.context_s == 0 for pl in found.plans
               if pl.cp_size == 1)
    # a group inside a node (t cp <= 8) rings on NVLink, one that leaves it on a 25 GB/s network; it
    # hides when a rank's tokens are past hide_chunk_tokens' threshold, scaled from NVLink at the
    # peak to the group's link at half the peak (a little past it: backward sends 2 cp - 1 times)
    nvlink, eff = get_gpu("h100-sxm").link_gbps / 2, 0.5
    for pl in ring:
        chunk = 65536 // pl.cp_size
        link = 25.0 if pl.tp_size * pl.cp_size > 8 else nvlink
        threshold = hide_chunk_tokens("h100-sxm", shape.n_head // pl.tp_size, shape.kv_heads // pl.tp_size)
        threshold *= eff * nvlink / link
        if chunk >= 1.1 * threshold:
            assert pl.step.context_s == 0, (pl.tp_size, pl.cp_size)
        elif chunk < threshold:
            assert pl.step.context_s > 0, (pl.tp_size, pl.cp_size)
    assert any(pl.step.context_s > 0 for pl in ring) and any(pl.step.context_s == 0 for pl in ring)
    # on a 0.1 GB/s network, the groups that leave a node pay, and those inside do not
    slow = plan_training(shape, context_parallel=(2, 4, 8, 16), network_gbps=0.1, **kw)
    for pl in slow.plans:
        leaves = pl.tp_size * pl.cp_size > 8
        assert (pl.step.context_s > 0) == leaves, (pl.tp_size, pl.cp_size)
        assert pl.step.total_s == pytest.approx(pl.step.compute_s + pl.step.tensor_s + pl.step.pipeline_s
                                                + pl.step.context_s + pl.step.data_s + pl.step.offload_s
                                                + pl.step.latency_s)


@pytest.mark.parametrize("context_parallel, match", [
    ((3,), r"context_parallel=\(3,\): each degree must divide num_gpus=16"),
    ((True,), "context_parallel=True must be an int"),
    ((0,), "context_parallel=0 must be an int"),
    (True, "context_parallel=True must be None or a tuple"),
    (4, "context_parallel=4 must be None or a tuple"),
    ((), r"context_parallel=\(\) must hold"),
    ((16,), r"context_parallel=\(16,\): seq_len=1040 must be divisible by 2 \* cp_size = 32"),
])
def test_bad_context_parallel_degrees_name_the_argument(context_parallel, match):
    with pytest.raises((ValueError, TypeError), match=match):
        plan_training(PRESETS["gpt2-small"], gpu="a100-80gb", num_gpus=16, seq_len=1040, global_batch=16,
                      context_parallel=context_parallel)


def test_the_command_line_sweeps_cp_and_shows_it():
    args = ["train", "--model", "llama-3.1-405b", "--gpu", "h100-sxm", "--num-gpus", "16384", "--seq-len",
            "131072", "--global-batch", "128", "--micro-batches", "1", "--zero-stages", "1", "--cp", "1,16",
            "--include-unrunnable"]
    run = [sys.executable, "-m", "labkit.plan", *args]
    out = subprocess.run([*run, "--json", "--top", "3"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    want = plan_training(L405, **LONG, micro_batches=(1,), zero_stages=(1,), context_parallel=(1, 16),
                         include_unrunnable=True)
    assert json.loads(out.stdout)["plans"] == json.loads(json.dumps([p.to_dict() for p in want.plans[:3]]))
    assert {p["cp_size"] for p in json.loads(out.stdout)["plans"]} == {16}
    table = subprocess.run([*run, "--top", "1"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    header, row = table.stdout.splitlines()[1:3]
    assert row.split()[header.split().index("cp")] == "16"
    bad = subprocess.run([*run[:-3], "--cp", "3"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 2 and "--context-parallel (3,)" in bad.stderr, bad.stderr


@pytest.mark.parametrize("cp", [2, 4])
def test_a_zigzag_ring_step_meets_half_the_blocks_pairs_as_ring_step_flops_counts(cp):
    """Counted token by token: the (query, key) pairs a causal mask keeps between a rank's tokens
    and the keys it holds at each ring step are half the block's, and on the first step (its own
    keys) c/2 pairs more, the two chunks' own diagonals, which ring_step_flops leaves out."""
    s = 8 * cp
    chunk, d = s // cp, 4

    def tokens(rank):
        return [g + k for _, n, g in chunk_offsets(rank, cp, s) for k in range(n)]

    for rank in range(cp):
        for step in range(cp):
            keys = tokens((rank - step) % cp)  # the ring brings rank - step's keys at step `step`
            kept = sum(1 for q in tokens(rank) for k in keys if k <= q)
            flops = block_flops(1, 1, d, chunk, chunk) * kept / chunk**2
            want = ring_step_flops(1, 1, d, chunk) + (block_flops(1, 1, d, chunk, 1) / 2 if step == 0 else 0)
            assert flops == want, (rank, step, kept)
    assert ring_step_flops(1, 1, d, chunk, causal=False) == block_flops(1, 1, d, chunk, chunk)
    # the threshold doubles under the mask: half the compute hides the same bytes
    causal, unmasked = (hide_chunk_tokens("h100-sxm", 64, 8, causal=c) for c in (True, False))
    assert causal == pytest.approx(2 * unmasked)
