"""labkit.estimate: published numbers, the memory meter on the real model, and bad input.

The estimator is pure Python (tests/test_architecture.py checks that importing it loads no torch);
here it is held against what papers publish and against what labkit's memory meter counts when
the model runs in one process on the CPU, where every tensor's size follows from its shape.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from labkit.estimate import (GPUS, PRECISIONS, MemoryEstimate, ModelShape, ServingEstimate, serving_memory,
                             training_memory)
from labkit.checkpoint import apply_checkpointing
from labkit.memory import measure_forward_backward, measure_step
from labkit.memory.analytic import RECOMPUTE, embedding_bytes, head_bytes, korthikanti_activation_bytes, llama_layer_bytes
from labkit.model import GPTConfig, build_model
from labkit.paged_attention.analytic import cached_tokens, kv_bytes_per_token_of
from labkit.precision import OPTIMIZERS, make_optimizer
from labkit.precision import PRECISIONS as POLICIES
from labkit.shapes import preset
from labkit.zero.analytic import zero_bytes_per_param, zero_model_state_bytes


def dims(dp=1, tp=1, pp=1, cp=1):
    """Any object with the four degrees will do (labkit.parallel.ParallelDims is one)."""
    return SimpleNamespace(dp_size=dp, tp_size=tp, pp_size=pp, cp_size=cp)


# --- published numbers ---------------------------------------------------------------------------

# Key-value bytes per token in 16 bits, 2 L n_kv head_dim 2, from each paper's own table (written
# out here, not read from the presets): Llama 2 (touvron2023llama2, Table 1 and Sec. 2.2: 70B has 8
# KV heads; head_dim 128), Llama 3 (grattafiori2024llama3, Table 3: 8 KV heads for every size),
# Mistral 7B (jiang2023mistral, Table 1: 32 layers, 8 KV heads, head_dim 128).
PUBLISHED_KV_BYTES = {
    "llama-2-7b": 2 * 32 * 32 * 128 * 2,       # 524,288: 0.5 MiB
    "llama-2-13b": 2 * 40 * 40 * 128 * 2,      # 819,200
    "llama-2-70b": 2 * 80 * 8 * 128 * 2,       # 327,680: GQA, 8x less than 64 KV heads
    "llama-3-8b": 2 * 32 * 8 * 128 * 2,        # 131,072
    "llama-3-70b": 2 * 80 * 8 * 128 * 2,       # 327,680
    "llama-3.1-405b": 2 * 126 * 8 * 128 * 2,   # 516,096
    "mistral-7b": 2 * 32 * 8 * 128 * 2,        # 131,072
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_KV_BYTES))
def test_kv_bytes_per_token_of_each_preset_equal_the_published_shape(name):
    assert kv_bytes_per_token_of(preset(name), 2) == PUBLISHED_KV_BYTES[name]
    est = serving_memory(name, gpu="h200")
    assert est.bytes_per_block == 16 * PUBLISHED_KV_BYTES[name]  # vLLM's 16-token blocks
    assert serving_memory(name, gpu="h200", tp_size=8).bytes_per_block * 8 == est.bytes_per_block


def test_gqa_is_counted_and_head_dim_is_not_h_over_a_by_assumption():
    gqa = preset("llama-2-70b")
    mha = gqa.replace(n_kv_head=None)
    assert kv_bytes_per_token_of(mha) == 8 * kv_bytes_per_token_of(gqa)  # 64 KV heads against 8


def test_mistral_sliding_window_caches_8x_less_at_32k():
    # Jiang et al. (2023), Sec. 2: the rolling buffer "reduces the cache memory usage by 8x" on a
    # 32k-token sequence (window 4096)
    est = serving_memory("mistral-7b", gpu="a100-80gb")
    no_window = serving_memory(preset("mistral-7b").replace(sliding_window=None), gpu="a100-80gb")
    assert est.num_blocks == no_window.num_blocks  # the same pool of blocks
    assert cached_tokens(preset("mistral-7b"), 32768) * 8 == 32768
    assert est.max_concurrency(32768) == est.num_blocks // (4096 // 16) == est.max_concurrency(4096)
    assert no_window.max_concurrency(32768) == est.num_blocks // (32768 // 16)


def test_zero_paper_worked_example_7_5b_on_64_gpus():
    # Rajbhandari et al. (2020, rajbhandari2020zero), Figure 1: Psi = 7.5B, N_d = 64, K = 12:
    # 120 GB without ZeRO, 31.4, 16.6 and 1.88 GB per GPU with stages 1, 2, 3.
    psi = 7_500_000_000
    gb = [zero_model_state_bytes(psi, 64, stage, "mixed", "adam").total / 1e9 for stage in range(4)]
    assert [round(gb[0]), round(gb[1], 1), round(gb[2], 1), round(gb[3], 2)] == [120, 31.4, 16.6, 1.88]
    per_param = [zero_bytes_per_param(stage, 64) for stage in range(4)]
    assert [round(b * psi / 1e9, 2) for b in per_param] == [round(g, 2) for g in gb]


@pytest.mark.parametrize("degrees, peers", [
    (dict(), 0),  # one GPU: the CUDA context alone
    (dict(dp_size=2), 1), (dict(dp_size=8), 2),  # a ring over 2 ranks has one peer, over more two
    (dict(dp_size=8, tp_size=8, pp_size=4), 6), (dict(dp_size=2, pp_size=2), 2),  # pp = 2: one neighbour
    (dict(dp_size=4, cp_size=4, tp_size=2), 2 + 2 + 1),  # the gradient ring spans the dp x cp replicas
    (dict(dp_size=8, ep_size=8), 2 + 7),  # the all-to-all reaches every other rank of its group
])
def test_memory_outside_pytorch_grows_with_the_nccl_peers_of_a_rank(degrees, peers):
    from labkit.estimate.training import run_peers
    from labkit.memory.runtime import CONTEXT_BYTES, NCCL_BUFFSIZE, NCCL_CHANNELS
    from labkit.parallel.config import RunConfig

    run = RunConfig(micro_batch=1, num_microbatches=4, seq_len=4096, precision="bf16-mixed", **degrees)
    assert run_peers(run) == peers
    if run.ep_size == 1:  # a mixture of experts' training estimate is refused (the experts' terms)
        est = training_memory(preset("llama-3-8b"), run)
        assert est.non_torch == CONTEXT_BYTES + peers * NCCL_CHANNELS * NCCL_BUFFSIZE


def test_an_estimate_prints_a_breakdown_and_converts_to_a_dict():
    est = training_memory("llama-3-8b", seq_len=8192, micro_batch=1, dims=dims(dp=8), zero_stage=1)
    d = est.to_dict()
    assert d["total"] == sum(d[k] for k in ("params", "grads", "optimizer", "activations", "transient", "non_torch"))
    text = str(est)
    for part in ("params", "grads", "optimizer", "activations", "transient", "non_torch", "total", "GB", "%"):
        assert part in text
    assert f"{est.total / 1e9:.3f} GB" in text
    s = serving_memory("llama-3-8b", gpu="a100-80gb")
    assert isinstance(s, ServingEstimate) and "KV cache" in str(s)
    assert s.to_dict()["max_tokens"] == s.num_blocks * 16 == s.max_tokens


def test_vllm_rule_per_gpu():
    s = serving_memory("llama-3-8b", gpu="a100-80gb", gpu_memory_utilization=0.9)
    g = GPUS["a100-80gb"]
    assert s.budget == int(0.9 * g.memory_bytes)
    assert s.kv_cache == s.budget - s.weights - s.activation_peak - s.non_torch
    assert s.weights == 2 * preset("llama-3-8b").num_params()
    assert s.num_blocks == s.kv_cache // s.bytes_per_block
    assert s.max_concurrency(4096) == s.num_blocks // (4096 // 16)
    two = serving_memory("llama-3-8b", gpu="a100-80gb", tp_size=2)
    assert two.weights == 2 * preset("llama-3-8b").stage_params(2) and two.num_blocks > 2 * s.num_blocks
    too_big = serving_memory("llama-3-70b", gpu="l4")
    assert too_big.num_blocks == 0 and too_big.max_concurrency(1) == 0


# --- the composition -----------------------------------------------------------------------------

def test_under_1f1b_stage_0_holds_all_layers_worth_whatever_p():
    shape = preset("llama-2-7b")
    per_layer = sum(llama_layer_bytes(4096, 1, 4096, 32, 32, 11008).values())
    for p in (1, 2, 4, 8):
        est = training_memory(shape, seq_len=4096, micro_batch=1, dims=dims(pp=p), num_microbatches=16)
        # one stage is also the last, with the head; else each micro-batch's output waits for its backward
        extra = head_bytes(4096, 1, 4096, 32000) if p == 1 else p * 4096 * 4096 * 2
        assert est.stage == 0 and est.activations == 32 * per_layer + extra
    gpipe = training_memory(shape, seq_len=4096, micro_batch=1, dims=dims(pp=4), num_microbatches=16,
                            schedule="gpipe")
    # GPipe keeps all m micro-batches on every stage: the last, with the head, is the most loaded;
    # with each its received activation (bf16), beside the fp32 copy its first RMSNorm keeps
    received = 4096 * 4096 * 2
    assert gpipe.stage == 3 and gpipe.activations == 16 * (8 * per_layer + head_bytes(4096, 1, 4096, 32000)
                                                           + received)


def test_model_states_follow_zero_and_the_split():
    shape = preset("llama-2-70b")
    for z in range(4):
        est = training_memory(shape, seq_len=4096, micro_batch=1, dims=dims(dp=8, tp=8, pp=4), zero_stage=z,
                              num_microbatches=8)
        want = zero_model_state_bytes(shape.stage_params(8, 4, est.stage), 8, z, "mixed", "adam")
        assert (est.params, est.grads, est.optimizer) == (want.params, want.grads, want.optimizer)
    off = training_memory(shape, seq_len=4096, micro_batch=1, dims=dims(dp=8, tp=8), zero_stage=2, offload=True)
    assert off.grads == off.optimizer == 0 and off.offloaded > 0


def test_gpt2_block_uses_korthikanti():
    shape = preset("gpt3-175b")
    for t, sp, rc in ((8, False, "none"), (8, True, "selective"), (8, True, "full")):
        est = training_memory(shape, seq_len=2048, micro_batch=1, dims=dims(tp=t, pp=8), sequence_parallel=sp,
                              recompute=rc, num_microbatches=8)
        layer = korthikanti_activation_bytes(2048, 1, 12288, 96, t, sp, rc)
        outputs = 8 * 2048 * 12288 * 2 // (t if sp else 1)  # 8 micro-batches' stage outputs
        embedding = 8 * embedding_bytes(2048, 1, pos="learned", tp_size=t)  # and their position indices, ids
        assert est.stage == 0 and est.activations == round(layer) * 96 + outputs + embedding


@pytest.mark.parametrize("name", ["gpt3-175b", "llama-3.1-405b"])
def test_with_cp_the_core_is_the_ring_whatever_the_attention_knob(name):
    # the ring never stores the scores: "eager" and "flash" are one count with cp > 1 (labkit's and
    # fused kernels), and without cp the scores make "eager" the larger
    from labkit.parallel.config import RunConfig

    for kernels in ("labkit", "fused"):
        est = {(cp, a): training_memory(name, RunConfig(tp_size=8, cp_size=cp, seq_len=2048, attention=a,
                                                        kernels=kernels)).activations
               for cp in (1, 2) for a in ("eager", "flash")}
        assert est[2, "eager"] == est[2, "flash"] and est[1, "eager"] > est[1, "flash"], (kernels, est)


def test_the_precision_names_are_labkit_precisions():
    assert {policy for policy, _ in PRECISIONS.values()} <= set(POLICIES)
    assert set(OPTIMIZERS) == {"adam", "adamw", "sgd_momentum", "sgd"}


# --- the memory meter, one process on the CPU ----------------------------------------------------

def _llama(n_kv_head, n_layer=2):
    return GPTConfig(n_layer=n_layer, d_model=64, n_head=4, n_kv_head=n_kv_head, d_ff=96, vocab_size=128,
                     seq_len=16, norm="rmsnorm", mlp="swiglu", pos="rope", tie_embeddings=False, bias=False)


def _batch(cfg, b):
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(cfg.vocab_size, (b, cfg.seq_len), generator=gen),
            torch.randint(cfg.vocab_size, (b, cfg.seq_len), generator=gen))


@pytest.mark.parametrize("n_kv_head", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_llama_activations_equal_the_meter_to_the_byte(n_kv_head, dtype, b, recompute):
    # Exact on the CPU: every saved tensor's size follows from its shape (b = 1 and b = 2 differ
    # in which keys and values matmul copies). The GPT-2 block is estimated with Korthikanti's
    # GPU formula (1-byte dropout masks, no LayerNorm statistics), which the CPU's meter does not
    # follow; tests/test_memory.py ties labkit's exact GPT-2 count to it.
    cfg = _llama(n_kv_head)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=dtype)
    if recompute != "none":
        apply_checkpointing(model, recompute)  # labkit's policies: the attention core, or every block
    measured = measure_forward_backward(model, _batch(cfg, b)).activations
    est = training_memory(ModelShape.from_config(cfg), seq_len=16, micro_batch=b, recompute=recompute,
                          precision="fp32" if dtype == torch.float32 else "bf16")
    assert est.activations == measured


@pytest.mark.parametrize("precision, policy, dtype", [("fp32", "fp32", torch.float32), ("bf16", "bf16", torch.bfloat16),
                                                      ("bf16-mixed", "mixed", torch.bfloat16)])
@pytest.mark.parametrize("family", ["llama-gqa", "gpt2"])
def test_model_states_equal_the_meter_to_the_byte(precision, policy, dtype, family):
    cfg = _llama(2) if family == "llama-gqa" else GPTConfig(n_layer=2, d_model=64, n_head=4, vocab_size=128, seq_len=16)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=dtype)
    opt = make_optimizer(model.parameters(), policy, "adamw", lr=1e-3)
    got = measure_step(model, opt, _batch(cfg, 2)).max_by_category
    est = training_memory(ModelShape.from_config(cfg), seq_len=16, micro_batch=2, precision=precision)
    step_counters = 4 * len(list(model.parameters()))  # torch's Adam: an fp32 `step` a tensor, on the CPU
    assert (got["parameters"], got["gradients"]) == (est.params, est.grads)
    assert got["optimizer"] == est.optimizer + step_counters  # on a GPU the counters stay on the host


# --- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("call, words", [
    (lambda: training_memory("llama-9b", seq_len=8, micro_batch=1), ["preset='llama-9b'", "llama-2-7b"]),
    (lambda: serving_memory("llama-2-7b", gpu="a200"), ["gpu='a200'", "a100-80gb"]),
    (lambda: training_memory("llama-2-7b", seq_len=8, micro_batch=1, zero_stage=4), ["zero_stage=4", "0, 1, 2, 3"]),
    (lambda: training_memory("llama-2-7b", seq_len=8, micro_batch=1, dims=dims(tp=3)), ["tp_size=3", "n_head=32"]),
    (lambda: training_memory("llama-2-70b", seq_len=8, micro_batch=1, dims=dims(tp=16)), ["tp_size=16", "n_kv_head=8"]),
    (lambda: training_memory("llama-2-7b", seq_len=8, micro_batch=0), ["micro_batch=0"]),
    (lambda: training_memory("llama-2-7b", seq_len=8, micro_batch=1, recompute="some"), ["recompute='some'", "selective"]),
    (lambda: training_memory("llama-2-7b", seq_len=8, micro_batch=1, precision="fp8"), ["precision='fp8'", "bf16-mixed"]),
    (lambda: training_memory("llama-2-7b", seq_len=8, micro_batch=1, dims=dims(dp=0)), ["dims.dp_size=0"]),
    (lambda: training_memory("llama-2-7b", seq_len=8, micro_batch=1, dims=dims(pp=64)), ["pp_size=64", "n_layer=32"]),
    (lambda: training_memory("llama-2-7b", seq_len=8, micro_batch=1, v=2), ["v=2", "interleaved"]),
    (lambda: training_memory("llama-2-7b", seq_len=9, micro_batch=1, dims=dims(cp=2)), ["seq_len=9", "cp_size=2"]),
    (lambda: training_memory({"hidden_size": 4096, "num_attention_heads": 32}, seq_len=8, micro_batch=1),
     ["missing", "num_hidden_layers", "intermediate_size"]),
    (lambda: training_memory("llama-2-7b", seq_len=8, micro_batch=True), ["micro_batch=True"]),
    (lambda: serving_memory("llama-2-7b", gpu="a100", gpu_memory_utilization=1.5), ["gpu_memory_utilization=1.5"]),
    (lambda: serving_memory("llama-2-7b", gpu="a100", tp_size=3), ["tp_size=3", "n_head=32"]),
])
def test_bad_input_is_refused_naming_the_argument_and_what_is_valid(call, words):
    with pytest.raises(ValueError) as err:
        call()
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_an_estimate_is_a_memory_estimate_of_the_most_loaded_stage():
    est = training_memory("llama-3.2-1b", seq_len=2048, micro_batch=1, dims=dims(pp=4), num_microbatches=1)
    assert isinstance(est, MemoryEstimate)
    # with m = 1 every stage keeps one micro-batch: the last stage, with the head, is the most loaded
    assert est.stage == 3
