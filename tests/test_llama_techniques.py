"""The techniques on the Llama family: tensor parallelism, the pipeline split, checkpointing.

One 4-rank gloo launch serves every distributed test (tests/llama_workers.py): tensor parallelism
at t = 2 and 4, with and without sequence parallelism, on a Llama model (RMSNorm, SwiGLU with its
own d_ff, rotary positions, grouped-query attention, untied embeddings, no biases) and on GPT-2's
block with grouped-query attention and untied embeddings; then two 2-stage pipelines of the Llama
model. GPT-2's own block is tested the same way in test_tensor_parallel.py and test_pipeline_dist.py.

Tensor parallelism is judged by the round-off measured in the same run (labkit.runs.tensor_parallel_ref:
the sharded float32 error against float64 within ROUNDOFF times the unsharded float32 model's own
error); the pipeline and checkpointing in float64.
"""

import copy

import pytest
import torch
from torch.testing import assert_close

from labkit.checkpoint import apply_checkpointing
from labkit.dist import launch
from labkit.memory import measure_forward_backward
from labkit.model import GPTConfig, build_model
from labkit.runs.pipeline import reference_grads
from labkit.runs.tensor_parallel import make_batch
from labkit.tensor_parallel import check_tp_size, collectives_per_layer, shard_indices
from llama_workers import llama_checks

# Its module fixtures launch ranks once: every test of the file on one xdist worker, or each
# worker that picked one up would launch them again.
pytestmark = pytest.mark.xdist_group("dist:llama_techniques")

# t = 2 and 4 both divide n_head = 8, n_kv_head = 4, d_ff = 96 and the vocabulary
LLAMA = GPTConfig(n_layer=2, n_head=8, n_kv_head=4, d_model=64, d_ff=96, seq_len=16, vocab_size=256,
                  norm="rmsnorm", mlp="swiglu", pos="rope", tie_embeddings=False, bias=False)
# GPT-2's block (LayerNorm, GELU, learned positions: the position table is sharded under SP)
# with grouped-query attention, its own d_ff and untied embeddings
GPT2_GQA = GPTConfig(n_layer=2, n_head=8, n_kv_head=4, d_model=64, d_ff=128, seq_len=16, vocab_size=256,
                     tie_embeddings=False)
CONFIGS = {"llama": LLAMA, "gpt2-gqa": GPT2_GQA}
GEN = GPTConfig(**{**LLAMA.to_dict(), "n_kv_head": None})  # the KV caches hold n_head heads: multi-head
PIPE = GPTConfig(**{**LLAMA.to_dict(), "n_layer": 4})  # interleaving needs v p = 4 | n_layer
PIPE_CASES = [("1f1b", 4, 1), ("interleaved", 4, 2)]
PIPE_BATCH = 8
GLOO = dict(backend="gloo", timeout_s=120, join_timeout_s=900)  # a loaded 2-core machine is slow
ROUNDOFF = 4  # as in test_tensor_parallel.py: a missing or doubled collective is orders of magnitude more
TP_CASES = [(name, t, sp) for name in CONFIGS for t in (2, 4) for sp in (False, True)]


def within_roundoff(pair, what=""):
    err, floor = pair
    assert err <= ROUNDOFF * floor, f"{what}: error {err:.3g} > {ROUNDOFF} x the run's round-off {floor:.3g}"


@pytest.fixture(scope="module")
def runs():
    return launch(llama_checks, 4, CONFIGS, LLAMA, GEN, PIPE, PIPE_CASES, PIPE_BATCH, **GLOO)


@pytest.mark.roundoff
@pytest.mark.parametrize("name,t,sp", TP_CASES)
def test_tp_outputs_loss_and_every_gradient_equal_one_process(runs, name, t, sp):
    n_params = len(list(build_model(CONFIGS[name]).parameters()))
    for r in runs:
        res = r["tp"][name][(t, sp)]
        assert res["n_grads"] == n_params  # every parameter has its shard and its gradient
        within_roundoff(res["logits"], (name, t, sp, "logits"))
        within_roundoff(res["loss"], (name, t, sp, "loss"))
        within_roundoff(res["grads"], (name, t, sp, "gradients"))


@pytest.mark.parametrize("name,t,sp", TP_CASES)
def test_tp_collectives_per_layer_are_gpt2s(runs, name, t, sp):
    cfg = CONFIGS[name]
    u = 2 * cfg.seq_len * cfg.d_model * 4  # one (B, T, C) float32 tensor, B = 2 (tp_rank's default)
    for r in runs:
        layer = r["tp"][name][(t, sp)]["layer_comm"]
        # SwiGLU's gate and up share one f (one all-gather under SP); smaller k and v change nothing
        assert {"forward": layer["forward"], "backward": layer["backward"]} == collectives_per_layer(sp)
        assert all(layer["bytes"][pas][k] == n * u for pas in ("forward", "backward")
                   for k, n in layer[pas].items())


@pytest.mark.roundoff
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("sp", [False, True])
def test_tp_plain_training_loop_trains_like_one_process(runs, name, sp):
    for r in runs:
        for t in (2, 4):
            res = r["train"][name][sp][t]
            within_roundoff(res["losses"], (name, t, sp, "losses"))
            within_roundoff(res["params"], (name, t, sp, "parameters after 3 steps"))
            # the RMSNorm weights' partial gradients were summed at the end of each backward pass
            assert res["reductions"] == (4 if sp else None)  # 3 steps, one of two backward passes


def test_tp_refuses_a_t_that_does_not_divide_n_kv_head(runs):
    for r in runs:
        msg = r["gqa_refusal"]
        assert msg is not None and "tp_size=4" in msg and "n_kv_head=2" in msg, msg
    with pytest.raises(ValueError, match=r"tp_size=4 must divide n_kv_head=2"):
        check_tp_size(4, n_head=8, n_kv_head=2)
    with pytest.raises(ValueError, match=r"tp_size=4 must divide d_ff=90"):
        check_tp_size(4, d_ff=90)


def test_shard_indices_take_each_ranks_query_and_key_value_heads():
    # c_attn of 4 query heads and 2 key-value heads of 2 rows each: q rows 0-7, k 8-11, v 12-15
    assert shard_indices(16, 1, 2, chunks=(8, 4, 4)).tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    assert torch.equal(shard_indices(12, 1, 2, chunks=(4, 4, 4)), shard_indices(12, 1, 2, chunks=3))
    with pytest.raises(ValueError, match=r"chunks=\(8, 2, 2\) must sum to n=12 and each be divisible by tp_size=4"):
        shard_indices(12, 0, 4, chunks=(8, 2, 2))


def test_tp_generation_with_rotary_positions_through_the_kv_cache(runs):
    ref = runs[0]["generation"]
    # float64 greedy tokens flip only where two logits tie within ~1e-16: this reference has none
    assert ref["margin"] > 1e6 * torch.finfo(torch.float64).eps
    for r in runs:
        gen = r["generation"]
        assert torch.equal(gen["uncached"], ref["want"])
        assert torch.equal(gen["cached"], ref["want"])  # the cache's offsets are the rotary positions


def test_checkpointing_a_tensor_parallel_llama_model_recomputes_exactly(runs):
    for r in runs:  # selective: the core of this rank's heads; full: the blocks with their collectives
        assert r["checkpointed"] == {"none": True, "selective": True, "full": True}


# float64: the pipeline reassociates the batch mean over micro-batches, ~1e-16 relative; a lost or
# doubled micro-batch, or a wrongly summed (here: absent) tied gradient, is ~1e-3 or more
RTOL, ATOL = 1e-9, 1e-12


@pytest.mark.roundoff
@pytest.mark.parametrize("case", PIPE_CASES, ids=[c[0] for c in PIPE_CASES])
def test_pipeline_stages_of_a_llama_model_equal_one_process(runs, case):
    ref_loss, ref_grads = reference_grads(PIPE, PIPE_BATCH, dtype=torch.float64)
    for pair in (runs[:2], runs[2:]):
        res = [r["pipeline"][case] for r in pair]
        assert len(res[1]["losses"]) == case[1] and not res[0]["losses"]
        # the mean of m micro-batch means is the batch mean, reordered
        assert_close(torch.tensor(res[1]["losses"], dtype=torch.float64).mean(),
                     torch.tensor(ref_loss, dtype=torch.float64), rtol=RTOL, atol=0)
        # untied: the first stage holds wte, the last lm_head, and no parameter is on both
        held = [set(r["grads"]) for r in res]
        assert "wte.weight" in held[0] and "lm_head.weight" in held[1] and not held[0] & held[1]
        assert held[0] | held[1] == set(ref_grads)
        for r in res:
            for n, g in r["grads"].items():
                assert_close(g, ref_grads[n], rtol=RTOL, atol=ATOL, msg=n)


def _grads_and_memory(model, batch):
    """The gradients of one step, and (kept, peak) activation bytes of another measured by the meter."""
    report = measure_forward_backward(model, batch)  # leaves the gradients None
    model(*batch).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, report.activations, report.peak_of("activations", "temporaries")


@pytest.mark.roundoff
def test_checkpointing_policies_on_a_llama_model_recompute_exactly_and_save_memory():
    cfg = GPTConfig(**{**LLAMA.to_dict(), "n_layer": 4, "seq_len": 64})
    torch.manual_seed(0)
    plain = build_model(cfg).double()
    batch = make_batch(cfg, 2)
    want, kept_none, peak_none = _grads_and_memory(copy.deepcopy(plain), batch)
    measured = {}
    for policy, k in (("full", None), ("every_k", 2), ("sqrt", None), ("selective", None)):
        for impl in ("scratch", "torch"):
            model = copy.deepcopy(plain)
            apply_checkpointing(model, policy, k=k, impl=impl)
            grads, kept, peak = _grads_and_memory(model, batch)
            for n in want:  # recomputation reruns the same operations on the same inputs: bit for bit
                assert torch.equal(grads[n], want[n]), (policy, impl, n)
            measured[policy, impl] = kept, peak
    for (policy, impl), (kept, peak) in measured.items():
        assert kept < kept_none, (policy, impl, kept, kept_none)  # RMSNorm, SwiGLU, rope: not kept
    # full recomputation keeps each block's input only: less than selective, which keeps the rest
    assert measured["full", "scratch"][0] < measured["selective", "scratch"][0]
    assert measured["full", "scratch"][1] < peak_none


def test_the_budget_policy_refuses_a_block_its_byte_formulas_do_not_describe():
    model = build_model(GPTConfig(**{**LLAMA.to_dict(), "n_layer": 4}))
    with pytest.raises(ValueError, match=r"policy='budget'.*norm='rmsnorm'"):
        apply_checkpointing(model, "budget", budget=10**9, batch_size=2)
