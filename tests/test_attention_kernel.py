"""The attention kernel is a choice of the run, apart from recomputation (``RunConfig.attention``).

"eager": labkit's model, whose softmax output autograd keeps (the (a, s, s) scores); "flash":
labkit's FlashAttention core in its place. The estimator's flash count is checked against the
memory meter to the byte on the Llama block, for every way the keys and values reach the core
(multi-head, grouped, one KV head), every recomputation policy and both activation dtypes; the
planner and the CLI default to "flash", as every run the book cites does."""

from __future__ import annotations

import pytest
import torch

from labkit.checkpoint import apply_checkpointing
from labkit.estimate import training_memory
from labkit.flash_attention import apply_flash_attention
from labkit.memory.meter import measure_forward_backward
from labkit.model import GPTConfig, build_model
from labkit.parallel.config import RunConfig
from labkit.plan import plan_training
from labkit.plan.cli import main as plan_main
from labkit.shapes import PRESETS, ModelShape

LLAMA = dict(n_layer=2, d_model=32, n_head=4, d_ff=48, vocab_size=64, seq_len=16, norm="rmsnorm", mlp="swiglu",
             pos="rope", tie_embeddings=False, bias=False)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
@pytest.mark.parametrize("batch", [1, 2])
def test_the_flash_count_is_what_the_meter_measures_around_labkits_flash_core(precision, recompute, n_kv_head, batch):
    cfg = GPTConfig(**LLAMA, n_kv_head=n_kv_head)
    torch.manual_seed(0)
    model = apply_flash_attention(build_model(cfg).to(DTYPES[precision]), "pytorch")
    if recompute != "none":
        apply_checkpointing(model, recompute)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))  # (b, s)
    measured = measure_forward_backward(model, (x, x.roll(-1, 1))).activations
    run = RunConfig(micro_batch=batch, seq_len=cfg.seq_len, recompute=recompute, precision=precision)
    assert run.attention == "flash"
    assert training_memory(ModelShape.from_config(cfg), run).activations == measured


def test_the_kernel_is_independent_of_recomputation_and_flash_keeps_no_scores():
    shape, s = PRESETS["llama-2-70b"], 4096
    run = RunConfig(tp_size=8, pp_size=4, dp_size=2, num_microbatches=8, seq_len=s, sequence_parallel=True)
    eager, flash = (training_memory(shape, run.replace(attention=k)) for k in ("eager", "flash"))
    scores = shape.n_head // 8 * s * s * 2  # one layer's (a/t, s, s) bf16 softmax output, per micro-batch
    assert eager.activations - flash.activations >= scores  # at least one layer's scores, times what is kept
    # selective recomputation drops the scores whatever the kernel: the two counts meet up to O and L
    sel = [training_memory(shape, run.replace(attention=k, recompute="selective")) for k in ("eager", "flash")]
    assert abs(sel[0].activations - sel[1].activations) < scores
    with pytest.raises(ValueError, match=r"attention='sdpa' .*'flash'.*'eager'"):
        RunConfig(attention="sdpa")


def test_the_planner_and_the_cli_plan_with_flash_unless_told(capsys):
    kw = dict(gpu="a100-80gb", num_gpus=8, seq_len=4096, global_batch=16, micro_batches=(1,), interleave=(1,))
    flash = plan_training(PRESETS["llama-2-7b"], **kw)
    eager = plan_training(PRESETS["llama-2-7b"], attention="eager", **kw)
    assert {pl.attention for pl in flash.plans} == {"flash"} and {pl.attention for pl in eager.plans} == {"eager"}
    eager_total = {pl.run: pl.memory.total for pl in eager.plans}
    pairs = [(pl.memory.total, eager_total[pl.run.replace(attention="eager")]) for pl in flash.plans
             if pl.recompute == "none" and pl.run.replace(attention="eager") in eager_total]
    assert pairs and all(f < e for f, e in pairs)  # the same run, without the scores
    args = ["train", "--model", "llama-2-7b", "--gpu", "a100-80gb", "--num-gpus", "8", "--seq-len", "4096",
            "--global-batch", "16", "--top", "1"]
    assert plan_main(args) == 0
    assert "attention flash (--attention)" in capsys.readouterr().out
