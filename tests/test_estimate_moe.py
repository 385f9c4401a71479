"""The training estimate and the planner for mixtures of experts, in one process.

The meter's side (model states and activations to the byte, in one process and over 4 gloo ranks
with ep = 2 and 4) is tests/test_estimate_grid.py's. Here: the step's FLOPs counted by torch's
FlopCounterMode, the parameters a rank keeps, the planner's ep axis and all-to-all, and the
refusals, each naming what it refuses.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labkit.estimate import training_memory
from labkit.estimate.experts import moe_layer_bytes, rank_params
from labkit.model import GPTConfig, build_model, training_flops
from labkit.moe.analytic import training_step_flops
from labkit.parallel.compose import runnable_reason
from labkit.parallel.config import RunConfig
from labkit.plan import plan_training
from labkit.plan.cli import main
from labkit.plan.export import export_best
from labkit.plan.steptime import step_time
from labkit.shapes import ModelShape, preset

LLAMA = dict(n_layer=3, d_model=32, n_head=4, n_kv_head=2, d_ff=48, vocab_size=64, seq_len=16, norm="rmsnorm",
             mlp="swiglu", pos="rope", tie_embeddings=False, bias=False)
MIXTRAL = dict(LLAMA, n_experts=4, experts_per_token=2, d_expert=24)
MLA = dict(LLAMA, n_kv_head=None, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=10)
DEEPSEEK = dict(LLAMA, n_experts=4, experts_per_token=2, d_expert=16, n_shared_experts=1, first_dense_layers=1,
                router_score="sigmoid", router_bias=True)


@pytest.mark.parametrize("kw", [MIXTRAL, DEEPSEEK], ids=["mixtral", "deepseek"])
def test_moe_training_flops_equal_the_counted_flops_of_a_step(kw):
    cfg = GPTConfig(**kw)
    torch.manual_seed(0)
    model, x = build_model(cfg), torch.randint(0, 64, (2, 16))
    with FlopCounterMode(display=False) as counter:
        model(x, x).backward()
    # dropless: every token runs its k experts, so the count is the formula's exactly
    assert counter.get_total_flops() == training_flops(cfg, 2) == training_step_flops(ModelShape.from_config(cfg), 2)


def test_moe_flops_follow_the_active_parameters():
    # 2 FLOPs a matmul weight a token forward, 6 a step: the active parameters less the embedding
    # and the norms, plus the attention scores (4 B s^2 h a layer forward); counted apart from them
    m, B = preset("mixtral-8x7b"), 2
    s, h, L, V = m.seq_len, m.d_model, m.n_layer, m.vocab_size
    weights = m.active_params() - V * h - (2 * L + 1) * h
    assert training_step_flops(m, B) == 3 * (2 * B * s * weights + 4 * B * s * s * h * L)


def test_a_rank_keeps_its_share_of_the_experts_and_all_the_rest():
    m = preset("mixtral-8x7b")
    dense1, experts1 = rank_params(m, 1, 1, 0, 1, 1)
    dense8, experts8 = rank_params(m, 1, 1, 0, 1, 8)
    assert dense8 == dense1 and experts8 * 8 == experts1 and dense1 + experts1 == m.num_params()
    est = training_memory(m, seq_len=1024, micro_batch=1, dims=RunConfig(dp_size=16, ep_size=8).dims,
                          zero_stage=1, precision="bf16-mixed")
    # bf16 weights and gradients whole; fp32 master, m, v: the rest over 16 replicas, experts over 2
    assert est.params == 2 * (dense8 + experts8) and est.grads == 2 * (dense8 + experts8)
    assert est.optimizer == 12 * (-(-dense8 // 16)) + 12 * (-(-experts8 // 2))


def test_a_capacity_bounds_the_rows_and_the_bytes():
    shape = ModelShape.from_config(GPTConfig(**MIXTRAL))
    dropless = moe_layer_bytes(shape, 16, 2, dtype_bytes=4)
    capped = moe_layer_bytes(shape, 16, 2, dtype_bytes=4, capacity_factor=0.5)  # C = ceil(0.5 * 32 * 2 / 4) = 8
    assert capped["rows at this rank's experts (M' h e)"] == 4 * 8 * 32 * 4
    assert dropless["rows at this rank's experts (M' h e)"] == 64 * 32 * 4
    with pytest.raises(ValueError, match="sent_rows=33"):
        moe_layer_bytes(shape, 16, 2, dtype_bytes=4, capacity_factor=0.5, sent_rows=33)


@pytest.mark.parametrize("call, words", [
    (lambda: training_memory(GPTConfig(**MIXTRAL), seq_len=16, micro_batch=1, dims=RunConfig(tp_size=2).dims),
     ["tp_size=2", "experts under tensor parallelism", "tp_size=1"]),
    (lambda: training_memory(GPTConfig(**MIXTRAL), run=RunConfig(seq_len=16, kernels="fused")), ["kernels='fused'"]),
    (lambda: training_memory("qwen1.5-moe-a2.7b", seq_len=64, micro_batch=1), ["shared-expert gate"]),
    (lambda: training_memory("gpt-oss-20b", seq_len=64, micro_batch=1), ["expert biases", "attention sinks"]),
    (lambda: training_memory(GPTConfig(**MLA), seq_len=16, micro_batch=1, dims=RunConfig(tp_size=2).dims),
     ["kv_lora_rank=12", "tp_size=2", "tp_size=1"]),
    (lambda: plan_training("deepseek-v3", gpu="h100-sxm", num_gpus=2048, seq_len=4096, global_batch=15360,
                           context_parallel=(1, 2)), ["context_parallel=(1, 2)", "MLA", "(1,)"]),
    (lambda: training_memory(GPTConfig(**LLAMA), seq_len=16, micro_batch=1, capacity_factor=1.0),
     ["capacity_factor=1.0", "none"]),
    (lambda: training_memory(GPTConfig(**MIXTRAL), seq_len=16, micro_batch=1, capacity_factor=0),
     ["capacity_factor=0"]),
    (lambda: training_memory(GPTConfig(**MIXTRAL), run=RunConfig(seq_len=16, dp_size=3, ep_size=3)),
     ["ep_size=3", "n_experts=4"]),
    (lambda: RunConfig(dp_size=2, ep_size=4).dims, ["ep_size=4", "dp_size=2"]),
    (lambda: plan_training("mixtral-8x7b", gpu="h100-sxm", num_gpus=16, seq_len=1024, global_batch=16,
                           expert_parallel=(3,)), ["ep_size=3", "n_experts=8"]),
    (lambda: plan_training("llama-2-7b", gpu="h100-sxm", num_gpus=16, seq_len=1024, global_batch=16,
                           expert_parallel=(1, 2)), ["expert_parallel=(1, 2)", "none"]),
    (lambda: plan_training("mixtral-8x7b", gpu="h100-sxm", num_gpus=16, seq_len=1024, global_batch=16,
                           expert_parallel=(True,)), ["expert_parallel=True"]),
])
def test_what_the_moe_estimate_does_not_model_is_refused_by_name(call, words):
    with pytest.raises(ValueError) as err:
        call()
    assert all(w in str(err.value) for w in words), str(err.value)


MIXTRAL_16 = dict(gpu="h100-sxm", num_gpus=16, seq_len=2048, global_batch=64, micro_batches=(1,),
                  interleave=(1,), context_parallel=(1, 2))  # cp = 2: what experts do not compose with


def test_the_planner_sweeps_ep_and_marks_runnable_only_what_labkit_composes():
    every = plan_training("mixtral-8x7b", include_unrunnable=True, **MIXTRAL_16)
    assert {pl.ep_size for pl in every.plans} >= {1, 2, 4, 8} and every.plans
    for pl in every.plans:
        assert pl.dp_size % pl.ep_size == 0 and 8 % pl.ep_size == 0 and pl.tp_size == 1
        assert pl.unrunnable == runnable_reason(pl.run, experts=True)
    assert any(pl.unrunnable for pl in every.plans)
    runnable = plan_training("mixtral-8x7b", **MIXTRAL_16)
    assert all(not pl.unrunnable and pl.cp_size == 1 for pl in runnable.plans)
    assert {pl.zero_stage for pl in runnable.plans} > {0, 1} and any(pl.pp_size > 1 for pl in runnable.plans)
    assert runnable.refused.get("ep_composed")
    # a model with experts is refused cp whatever its ep; every other technique composes with it
    run = RunConfig(dp_size=8, cp_size=2)
    assert runnable_reason(run) == "" and runnable_reason(run, experts=True)


def test_the_all_to_all_is_charged_on_the_link_its_ep_group_spans():
    m = preset("mixtral-8x7b").replace(seq_len=2048)
    kw = dict(num_gpus=64, peak=1e15, efficiency=0.5, nvlink_gbps=450.0, network_gbps=50.0)
    one = step_time(RunConfig(dp_size=16, pp_size=4, ep_size=1, seq_len=2048), m, gpus_per_node=8, **kw)
    assert one.expert_s == 0 and one.comm_bytes["expert"] == 0
    inside = step_time(RunConfig(dp_size=16, pp_size=4, ep_size=2, seq_len=2048), m, gpus_per_node=8, **kw)
    across = step_time(RunConfig(dp_size=16, pp_size=4, ep_size=4, seq_len=2048), m, gpus_per_node=8, **kw)
    # ep p = 8 ranks fit in a node, 16 do not; a rank sends (ep - 1) / ep of 4 passes of its N k rows
    assert inside.expert_s * 450.0 * 1e9 == pytest.approx(inside.comm_bytes["expert"])
    assert across.expert_s * 50.0 * 1e9 == pytest.approx(across.comm_bytes["expert"])
    rows_bytes = 8 * 2048 * 2 * 4096 * 2  # 8 layers a stage, N = 2048 tokens, k = 2, h, bf16
    assert inside.comm_bytes["expert"] == pytest.approx(4 * rows_bytes / 2, rel=1e-4)  # + the counts
    assert across.comm_bytes["expert"] == pytest.approx(4 * rows_bytes * 3 / 4, rel=1e-4)


def test_the_cli_takes_ep_and_the_json_carries_it(capsys):
    args = ["train", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--num-gpus", "16", "--seq-len", "2048",
            "--global-batch", "64", "--micro-batches", "1", "--ep", "2,4", "--include-unrunnable"]
    assert main(args + ["--top", "3"]) == 0
    table = capsys.readouterr().out
    assert " ep " in table.splitlines()[1]
    assert main(args + ["--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and {p["ep_size"] for p in plans} <= {2, 4} and all("unrunnable" in p for p in plans)
    with pytest.raises(SystemExit) as err:
        main(args[:-3] + ["--ep", "3"])
    assert err.value.code == 2 and "ep_size=3 must divide n_experts=8" in capsys.readouterr().err


@pytest.mark.parametrize("engine, flag", [("megatron", "--expert-model-parallel-size"),
                                          ("torchtitan", "--parallelism.expert-parallel-degree")])
def test_the_plans_ep_reaches_the_exporters(engine, flag):
    found = plan_training("mixtral-8x7b", include_unrunnable=True, expert_parallel=(4,), **MIXTRAL_16)
    shape = preset("mixtral-8x7b").replace(seq_len=2048)
    _, out, _ = export_best(found.plans, engine, shape=shape)
    words = out.text.split()
    assert words[words.index(flag) + 1] == "4", out.text
