"""``python -m labkit.plan``: tables, JSON with the named keys, exit codes 0 / 1 / 2, errors that
name the argument, a config.json read offline, and no torch imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.plan import plan_serving, plan_training
from labkit.shapes import PRESETS

ROOT = Path(__file__).resolve().parents[1]
TRAIN_KEYS = {"tp_size", "pp_size", "dp_size", "cp_size", "v", "zero_stage", "recompute", "micro_batch",
              "num_microbatches", "memory", "step_time_s", "mfu"}
SERVE_KEYS = {"tp_size", "num_blocks", "max_tokens", "max_concurrency"}


def _run(*args, check_torch=False):
    code = ("import runpy, sys\nsys.argv = ['labkit.plan', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('labkit.plan', run_name='__main__')\n"
            "finally:\n    print('TORCH' if 'torch' in sys.modules else '', file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert "TORCH" not in out.stderr, "python -m labkit.plan imported torch"
    return out


def test_train_json_carries_the_named_keys_best_first_and_matches_the_library():
    out = _run("train", "--model", "llama-3-70b", "--gpu", "h100-sxm", "--num-gpus", "64", "--seq-len", "8192",
               "--global-batch", "512", "--top", "3", "--json")
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)["plans"]
    assert len(plans) == 3 and all(TRAIN_KEYS <= set(p) for p in plans)
    want = plan_training(PRESETS["llama-3-70b"], gpu="h100-sxm", num_gpus=64, seq_len=8192, global_batch=512)
    assert plans == json.loads(json.dumps([p.to_dict() for p in want.plans[:3]]))
    assert [p["step_time_s"] for p in plans] == sorted(p["step_time_s"] for p in plans)


def test_serve_table_and_json(tmp_path):
    table = _run("serve", "--model", "llama-3-8b", "--gpu", "a100-80gb", "--context-len", "4096")
    assert table.returncode == 0, table.stderr
    want = plan_serving(PRESETS["llama-3-8b"], gpu="a100-80gb", context_len=4096).plans[0]
    assert f" {want.max_concurrency} " in table.stdout and "kv_cache" in table.stdout
    # the same model from its Hugging Face config.json, read offline
    cfg = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192,
           "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = _run("serve", "--config", str(path), "--gpu", "a100-80gb", "--context-len", "4096", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)["plans"][0]
    assert SERVE_KEYS <= set(got) and got["max_concurrency"] == want.max_concurrency


def test_nothing_fits_exits_1_with_the_reason():
    out = _run("train", "--model", "llama-3-70b", "--gpu", "a100-80gb", "--num-gpus", "1", "--seq-len", "8192",
               "--global-batch", "1")
    assert out.returncode == 1 and "nothing fits" in out.stderr and "params: " in out.stderr


@pytest.mark.parametrize("args, named", [
    (["train", "--model", "llama-9", "--gpu", "a100", "--num-gpus", "1", "--global-batch", "1"], "llama-3-8b"),
    (["serve", "--model", "llama-3-8b", "--gpu", "b300", "--context-len", "10"], "h100-sxm"),
    (["serve", "--model", "llama-3-8b", "--gpu", "a100"], "--context-len"),
    (["train", "--model", "gpt2-small", "--gpu", "a100", "--num-gpus", "0", "--seq-len", "1024", "--global-batch",
      "8"], "--num-gpus 0"),
    (["train", "--model", "gpt2-small", "--gpu", "a100", "--num-gpus", "8", "--seq-len", "1024", "--global-batch", "8",
      "--recompute", "some"], "--recompute 'some'"),
    (["serve", "--config", "/nonexistent/config.json", "--gpu", "a100", "--context-len", "10"], "--config"),
    (["train", "--micro-batches", "1,x"], "--micro-batches"),
    (["train", "--model", "llama-3-8b", "--gpu", "a100", "--num-gpus", "8", "--global-batch", "8"],
     "--seq-len (no default: this model reads up to 8192 tokens)"),
    (["train", "--model", "gpt2-small", "--gpu", "t4", "--num-gpus", "1", "--seq-len", "1024", "--global-batch", "8"],
     "--precision 'bf16-mixed' computes in bf16, which t4 has no peak for"),
    (["serve", "--model", "llama-2-7b", "--gpu", "a100", "--context-len", "8192"],
     "--context-len 8192 must be at most the model's seq_len=4096"),
    ([], "train or serve"),
])
def test_bad_usage_exits_2_naming_the_argument(args, named):
    out = _run(*args)
    assert out.returncode == 2 and named in out.stderr, out.stderr


def test_help_and_lists():
    helped = _run("train", "--help")
    assert helped.returncode == 0 and "python -m labkit.plan serve --model llama-3-8b" in helped.stdout
    listed = _run("--list-models", "--list-gpus")
    assert listed.returncode == 0 and all(n in listed.stdout for n in ("llama-3.1-405b", "h200", "a100-80gb"))


def test_every_flag_has_help():
    from labkit.plan.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, p in [("", parser), *commands.items()]:
        missing = [a.option_strings[0] for a in p._actions if a.option_strings and not a.help]
        assert not missing, f"{name or 'python -m labkit.plan'}: flags without help: {missing}"


def test_tables_fit_80_columns():
    from labkit.plan.table import listing, serving_table, training_table

    wide = [plan_training(PRESETS["llama-3-70b"], gpu="h100-sxm", num_gpus=64, seq_len=8192, global_batch=512),
            plan_training(PRESETS["llama-2-7b"], gpu="a100-80gb", num_gpus=1024, seq_len=4096, global_batch=4096,
                          micro_batches=(1,), interleave=(1,), offload=(True,))]
    # ZeRO-Offload runs over data parallelism alone (labkit.zero.OffloadOptimizer): N_d = 1024, four digits
    assert all(p.offload for p in wide[1].plans) and any(p.dp_size >= 1000 for p in wide[1].plans[:200])
    texts = [training_table(wide[0], 10), training_table(wide[1], 200),
             serving_table(plan_serving(PRESETS["llama-3-70b"], gpu="h100-sxm", num_gpus=8, context_len=8192), 10),
             listing(True, True)]
    for text in texts:
        assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "2+cpu" in texts[1]  # ZeRO-Offload, said in the zero column


def test_list_gpus_shows_the_memory_plans_use_and_no_peak_a_gpu_lacks():
    from labkit.hardware import GPUS
    from labkit.plan.table import listing

    rows = {line.split()[0]: line.split() for line in listing(False, True).splitlines()}
    assert rows["t4"][4:6] == ["65", "-"]  # fp16, bf16: the T4's 65 TFLOP/s are fp16; it has no bf16
    assert rows["a100-80gb"][1:4] == ["85.9", "80", "GB"]  # what plans use (81,920 MiB), then the vendor's
    for name, g in GPUS.items():
        assert float(rows[name][1]) == round(g.memory_bytes / 1e9, 1)


def test_deepseek_v3_on_2048_gpus_gets_plans_with_expert_parallelism_that_labkit_runs():
    # DeepSeek-V3's run (DeepSeek-AI 2024): 2048 GPUs, sequences of 4096, batches up to 15360; labkit
    # runs experts with everything but context parallelism (which MLA refuses here anyway), so the
    # plans need no --include-unrunnable, and that flag adds none: every layout is t = cp = 1
    args = ("train", "--model", "deepseek-v3", "--gpu", "h100-sxm", "--num-gpus", "2048", "--seq-len", "4096",
            "--global-batch", "15360", "--top", "1000")
    out = _run(*args, "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    plans = result["plans"]
    assert any(p["ep_size"] > 1 for p in plans) and all(p["tp_size"] == p["cp_size"] == 1 for p in plans)
    assert all(p["unrunnable"] == "" and p["pp_size"] > 1 for p in plans)
    assert any(a.startswith("t = 1 only (experts and MLA") for a in result["assumed"])
    every = json.loads(_run(*args, "--include-unrunnable", "--json").stdout)["plans"]
    assert [(p["pp_size"], p["ep_size"], p["step_time_s"]) for p in every] == [
        (p["pp_size"], p["ep_size"], p["step_time_s"]) for p in plans]
    assert [p["step_time_s"] for p in plans] == sorted(p["step_time_s"] for p in plans)
