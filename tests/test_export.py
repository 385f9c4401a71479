"""``labkit.plan.export``: each engine's configuration of a plan, read back by the engine itself.

DeepSpeed's ``DeepSpeedConfig`` (with the plan's data-parallel degree as its world), megatron-core's
``TransformerConfig``/``parallel_state``/batch calculator, torchtitan's ``ConfigManager`` and
``ParallelDims``, and accelerate's config loader and plugins read every emitted configuration of
Chapter 9's worked cases and of a small grid (tests/engine_checks.py, one process an engine, in
``.venv-engines`` when it exists: requirements-engines.txt). FSDP2's script body runs on 2 gloo
ranks (and 4, dp x tp; and its pipeline on 2 stages) against the same model unsharded, and its
model states per rank, counted from its tensors and by torch's FSDPMemTracker, equal
``training_memory``'s to the byte. DeepSpeed trains each emitted ds_config.json (ZeRO-1, 2, 3; fp32 and
bf16; both offloads) on 2 gloo ranks, its own tensors holding what
``labkit.zero.analytic.deepspeed_model_state_bytes`` counts. vLLM's parser and blocks are checked
by scripts/check_engines.py, not here (its CPU build is 3.5 GB): scripts/results/engines.md.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from labkit.messages import CATALOGUES, render, using
from labkit.parallel.config import RunConfig
from labkit.plan import plan_serving, plan_training
from labkit.plan.export import (ENGINES, MAPPINGS, ExportNote, export, export_best, to_accelerate, to_deepspeed,
                                to_fsdp2, to_megatron, to_torchtitan, to_vllm)
from labkit.estimate import training_memory
from labkit.shapes import PRESETS, ModelShape
from warm_kernels import python_command

ROOT = Path(__file__).resolve().parents[1]
# tests/export_fsdp2_workers.py's TinyLlama, as the estimator reads it
TINY_LLAMA = ModelShape(n_layer=2, d_model=32, n_head=4, vocab_size=64, seq_len=16, d_ff=64, norm="rmsnorm",
                        mlp="swiglu", pos="rope", tie_embeddings=False, bias=False)
pytestmark = pytest.mark.filterwarnings("ignore::labkit.plan.export.ExportNote")  # export() collects them
ENGINE_MODULES = {"deepspeed": "deepspeed", "megatron": "megatron.core", "torchtitan": "torchtitan",
                  "accelerate": "accelerate",  # and the checks of tests/test_in_practice.py:
                  "megatron_flags": "megatron.core", "imports": "deepspeed"}

# Chapter 9's worked cases: the planner's 70B run, and the published BLOOM-176B and Llama 3 405B layouts.
@functools.cache
def plans_70b() -> list:
    """The planner's 70B run: a sweep of about 3800 layouts, made by the worker whose tests read it
    (not at import, in every worker that collects this file)."""
    return plan_training("llama-3-70b", gpu="h100-sxm", num_gpus=64, seq_len=8192, global_batch=512).plans


BLOOM = RunConfig(dp_size=8, tp_size=4, pp_size=12, micro_batch=2, num_microbatches=128, seq_len=2048,
                  zero_stage=1, recompute="full")
LLAMA_405B = RunConfig(dp_size=64, tp_size=8, pp_size=16, micro_batch=1, num_microbatches=32, seq_len=8192,
                       zero_stage=1, recompute="full", sequence_parallel=True)


def worked() -> dict:
    return {"llama-3-70b": plans_70b(), "bloom-176b": [BLOOM], "llama-3.1-405b": [LLAMA_405B]}


SHAPES = {"llama-3-70b": PRESETS["llama-3-70b"], "bloom-176b": None, "llama-3.1-405b": PRESETS["llama-3.1-405b"]}
# A grid beside them: each ZeRO stage, offload, the pipeline (interleaved too), context parallelism.
GRID = [RunConfig(dp_size=8, micro_batch=2, num_microbatches=4, seq_len=2048, zero_stage=z)
        for z in (0, 1, 2, 3)] + [
    RunConfig(dp_size=8, micro_batch=2, num_microbatches=4, seq_len=2048, zero_stage=2, offload=True),
    RunConfig(dp_size=8, micro_batch=1, num_microbatches=4, seq_len=2048, zero_stage=3, offload=True,
              offload_params=True, precision="fp16-mixed"),
    RunConfig(dp_size=2, tp_size=2, pp_size=2, micro_batch=1, num_microbatches=4, v=2, seq_len=2048, zero_stage=3,
              recompute="full", sequence_parallel=True, precision="bf16-mixed-fp32-grads"),
    RunConfig(dp_size=4, cp_size=2, micro_batch=1, num_microbatches=2, seq_len=4096, zero_stage=1, precision="fp32"),
    RunConfig(dp_size=4, tp_size=2, micro_batch=1, num_microbatches=2, seq_len=2048, zero_stage=3, optimizer="adam"),
    RunConfig(dp_size=8, micro_batch=2, num_microbatches=4, seq_len=2048, zero_stage=1,
              precision="bf16-mixed-fp32-buffer")]  # DeepSpeed's BF16 optimizer, as BLOOM ran


def _engine_python(engine: str) -> str:
    """The interpreter that has ``engine``: .venv-engines' if it exists, else this one. Absent:
    skip with the reason, or fail under CI=true (.ci/run installs requirements-engines.txt)."""
    venv = ROOT / ".venv-engines" / "bin" / "python"
    python = str(venv) if venv.exists() else sys.executable
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({ENGINE_MODULES[engine].split('.')[0]!r}) is None)"
    if subprocess.run([python, "-c", probe]).returncode:
        why = f"{engine} is not installed (requirements-engines.txt, into .venv-engines: see README)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return python


# The tests that ask an engine's own parser (``_ask``, here and in tests/test_in_practice.py) run on
# one xdist worker: one torch server in .venv-engines (tests/warm_kernels.py) forks every engine
# process, where each worker that ran one started a server of its own (about 2.6 CPU-s each).
ENGINES_WORKER = pytest.mark.xdist_group("engines")


def _ask(engine: str, cases: list) -> list:
    """What ``engine``'s own parser read from each case (tests/engine_checks.py)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": "/nonexistent"}
    # a fresh process an engine, forked from one that imported torch (tests/warm_kernels.py)
    python = python_command("torch", env, _engine_python(engine))
    out = subprocess.run([*python, str(ROOT / "tests" / "engine_checks.py"), engine],
                         input=json.dumps(cases), capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _expressed(engine: str, **options) -> list:
    """(name, RunConfig, config) for each worked case's best plan the engine expresses, and the grid's."""
    out = []
    for name, plans in worked().items():
        try:
            i, x, _ = export_best(plans, engine, **({"shape": SHAPES[name]} if engine in ("megatron", "torchtitan")
                                                    else options))
            out.append((name, plans[i].run if hasattr(plans[i], "run") else plans[i], x.config))  # the plan exported
        except ValueError as e:
            assert str(e).lower().find(engine[:4]) >= 0, e  # the refusal names the engine
    for i, run in enumerate(GRID):
        try:
            out.append((f"grid{i}", run, export(run, engine, **options).config))
        except ValueError as e:
            assert " cannot express " in str(e), e
    return out


@ENGINES_WORKER
def test_deepspeed_reads_back_every_emitted_ds_config():
    cases = _expressed("deepspeed")
    runs = [(name, c, _run_of(name, c, "deepspeed")) for name, _, c in cases]
    got = _ask("deepspeed", [{"config": c, "world": {"dp_size": r.dp_size}} for _, c, r in runs] +
               [{"config": {**runs[0][1], "zero_optimization": {"stagee": 1}}, "world": {"dp_size": runs[0][2].dp_size}}])
    assert len(runs) >= 7, [n for n, _, _ in runs]
    for (name, cfg, run), back in zip(runs, got):
        assert "error" not in back, (name, back)
        assert (back["train_batch_size"], back["micro_batch"], back["gradient_accumulation_steps"]) == (
            run.global_batch, run.micro_batch, run.num_microbatches), name
        assert back["zero_stage"] == run.zero_stage and back["bf16"] == run.precision.startswith("bf16"), name
        assert back["offload_optimizer"] == ("cpu" if run.offload else "none"), name
        assert back["offload_param"] == ("cpu" if run.offload_params else "none"), name
        assert back["pipeline_stages"] == "auto", name  # the stages are PipelineModule's num_stages
        assert back["autotp_size"] == (run.tp_size if run.tp_size > 1 else 0), name
    assert "stagee" in got[-1]["error"]  # a misspelt key fails DeepSpeed's own validation


def _run_of(name, config, engine) -> RunConfig:
    """The RunConfig a case was emitted from (worked cases: the plan export_best chose)."""
    if name.startswith("grid"):
        return GRID[int(name[4:])]
    plans = worked()[name]
    i, _, _ = export_best(plans, engine, **({"shape": SHAPES[name]} if engine in ("megatron", "torchtitan") else {}))
    return getattr(plans[i], "run", plans[i])


def _model_flags(run) -> list:
    """A small model's flags for a case emitted without a shape (as its user would add them)."""
    heads = 2 * run.tp_size
    return ["--num-layers", str(2 * run.pp_size * run.v), "--hidden-size", str(32 * heads),
            "--num-attention-heads", str(heads), "--ffn-hidden-size", str(128 * heads)]


@ENGINES_WORKER
def test_megatron_core_reads_back_the_degrees_batch_and_zero():
    cases = [(n, _run_of(n, c, "megatron"), c) for n, _, c in _expressed("megatron", shape=PRESETS["llama-3-8b"])]
    cases = [(n, r, c if "--num-layers" in c else _model_flags(r) + c) for n, r, c in cases]
    got = _ask("megatron", [{"config": c, "world": {"world_size": r.world_size}} for _, r, c in cases] +
               [{"config": cases[0][2] + ["--tensor-model-paralel-size", "2"], "world": {"world_size": 64}}])
    assert {n for n, _, _ in cases} >= {"llama-3-70b", "bloom-176b"}
    with pytest.raises(ValueError, match="126.*--pipeline-model-parallel-layout"):  # 126 layers on 16 stages
        to_megatron(LLAMA_405B, shape=PRESETS["llama-3.1-405b"])
    for (name, run, _), back in zip(cases, got):
        assert "error" not in back, (name, back)
        assert (back["tp_size"], back["pp_size"], back["cp_size"], back["dp_size"]) == (
            run.tp_size, run.pp_size, run.cp_size, run.dp_size), name
        assert back["num_microbatches"] == run.num_microbatches and (back["v"] or 1) == run.v, name
        assert back["sequence_parallel"] == run.sequence_parallel, name
        assert back["recompute"] == (None if run.recompute == "none" else run.recompute), name
        assert back["distributed_optimizer"] == (run.zero_stage == 1 or run.offload), name
        fsdp = {2: "optim_grads", 3: "optim_grads_params"}.get(run.zero_stage, "no_shard")
        assert back["sharding"] == ("no_shard" if run.offload else fsdp), name
    assert "tensor-model-paralel-size" in got[-1]["error"]


@ENGINES_WORKER
def test_torchtitan_parses_the_overrides_and_builds_the_same_mesh():
    cases = [(n, _run_of(n, c, "torchtitan"), c) for n, _, c in _expressed("torchtitan", shape=PRESETS["llama-3-8b"])]
    got = _ask("torchtitan", [{"config": c, "world": {"world_size": r.world_size}} for _, r, c in cases] +
               [{"config": cases[0][2] + ["--parallelism.tensor-parallel-degre", "2"], "world": {"world_size": 8}}])
    assert len(cases) >= 4, [n for n, _, _ in cases]
    for (name, run, _), back in zip(cases, got):
        assert "error" not in back, (name, back)
        shard = run.dp_size if run.zero_stage == 3 else 1
        assert (back["dp_shard"], back["dp_replicate"]) == (shard, run.dp_size // shard), name
        assert (back["tp_size"], back["pp_size"], back["cp_size"]) == (run.tp_size, run.pp_size, run.cp_size), name
        assert back["global_batch_size"] == run.global_batch and back["seq_len"] == run.seq_len, name
        assert back["sequence_parallel"] == (run.sequence_parallel or run.tp_size == 1), name
        assert back["reshard"] == ("always" if run.reshard_after_forward else "never"), name
        assert back["ac"].split(".")[0] == {"none": "NoAC", "full": "FullAC", "selective": "SelectiveAC"
                                            }.get(run.recompute, back["ac"]).split(".")[0] or run.recompute == "none"
    assert "tensor-parallel-degre" in got[-1]["error"]


@ENGINES_WORKER
def test_accelerate_loads_the_yaml_and_its_plugins_accept_it():
    cases = [(n, _run_of(n, None, "accelerate"), export(_run_of(n, None, "accelerate"), "accelerate").text)
             for n, _, _ in _expressed("accelerate")]
    got = _ask("accelerate", [{"config": text, "world": {}} for _, _, text in cases] +
               [{"config": cases[0][2] + "\nnum_procesess: 2\n", "world": {}}])
    assert len(cases) >= 4
    for (name, run, _), back in zip(cases, got):
        assert "error" not in back, (name, back)
        want = {3: "FSDP", 2: "DEEPSPEED", 1: "DEEPSPEED"}.get(run.zero_stage, "MULTI_GPU")
        assert back["distributed_type"] == want and back["num_processes"] == run.world_size, name
        if want == "FSDP":
            assert back["fsdp_version"] == 2 and back["reshard"] == run.reshard_after_forward, name
        if want == "DEEPSPEED":
            assert back["zero_stage"] == run.zero_stage, name
            assert back["gradient_accumulation_steps"] == run.num_microbatches, name
    assert "num_procesess" in got[-1]["error"]


@pytest.mark.xdist_group("dist:export_fsdp2")
@pytest.mark.parametrize("run, exact", [
    (RunConfig(dp_size=2, seq_len=16, zero_stage=3, recompute="full", precision="fp32"), True),
    (RunConfig(tp_size=2, seq_len=16, sequence_parallel=True, precision="fp32"), True),
    (RunConfig(dp_size=2, seq_len=16, zero_stage=3), False),
    (RunConfig(dp_size=2, tp_size=2, seq_len=16, zero_stage=3, recompute="full", sequence_parallel=True,
               precision="fp32"), True)], ids=["zero3-recompute", "tp-sp", "zero3-bf16", "2d-zero3-tp-sp"])
def test_fsdp2_script_trains_like_the_unsharded_model(run, exact):
    from labkit.dist import launch

    sys.path.insert(0, str(ROOT / "tests"))
    from export_fsdp2_workers import run_emitted

    est = training_memory(TINY_LLAMA, run)
    for r in launch(run_emitted, run.world_size, to_fsdp2(run), backend="gloo", timeout_s=60):
        assert r["mesh"] == [run.pp_size, run.dp_size, run.tp_size]
        assert r["local_params"] < r["params"] == TINY_LLAMA.num_params()  # sharded: each rank holds a part
        # model states per rank, to the byte: fully_shard keeps fp32 shards of the parameters and their
        # gradients under a bf16 policy (4 + 4 + 8 bytes a parameter where the plan counts 2 + 2 + 12):
        # the same total, arranged differently; in fp32 every term equals the estimate's
        # ... but for one measured difference: under TP alone, torch's vocab-split embedding keeps its
        # whole gradient on each rank, (t - 1)/t of V h fp32 elements more than its shard
        whole = TINY_LLAMA.vocab_size * TINY_LLAMA.d_model * 4
        assert r["whole_embedding_grad"] == (whole - whole // run.tp_size if run.dp_size == 1 else 0), r
        got = (r["param_bytes"], r["grad_bytes"] - r["whole_embedding_grad"], r["moment_bytes"])
        assert sum(got) == est.params + est.grads + est.optimizer, (got, est)
        if run.precision == "fp32":
            assert got == (est.params, est.grads, est.optimizer), (got, est)
        assert r["step_bytes"] == 4 * len(r["names"])  # torch's Adam: a 4-byte step a tensor, not estimated
        if run.dp_size > 1:  # fully_shard ran: torch's own tracker sees the same bytes
            assert r["tracker"] == {"Sharded Param": got[0], "Sharded Grad": got[1],
                                    "OptState": got[2] + r["step_bytes"]}, r
        if exact:  # fp32: only the reduction order differs from the unsharded step, so the loss is
            # within 4 x the unsharded fp32 loss's own error against float64 and the step within
            # 4 x the unsharded step's distance from itself summed in another order (both measured here)
            err, floor = r["loss_roundoff"]
            assert err <= 4 * floor, r
            assert r["step"]["ok"] and r["step"]["names_match"], r["step"]
        else:  # bf16 compute: the loss within bf16's rounding of the fp32 one
            assert abs(r["loss"] - r["ref_loss"]) < 1e-2 * r["ref_loss"], r


# DeepSpeed trains each emitted ds_config.json on 2 gloo ranks (ZeRO-1, 2 and 3, fp32 and bf16, and both
# offloads): the bytes its own tensors hold on each rank, against the estimator's DeepSpeed flavour.
DS_RUNS = [RunConfig(dp_size=2, seq_len=16, zero_stage=z, precision=p)
           for z in (1, 2, 3) for p in ("fp32", "bf16-mixed")] + [RunConfig(dp_size=2, seq_len=16, zero_stage=2, offload=True, precision="fp32"),
                RunConfig(dp_size=2, seq_len=16, zero_stage=3, offload=True, offload_params=True)]


@pytest.mark.xdist_group("dist:export_fsdp2")
def test_deepspeed_trains_the_emitted_configs_holding_the_estimated_model_states(tmp_path):
    from labkit.zero.analytic import deepspeed_model_state_bytes, zero_model_state_bytes

    out = subprocess.run([_engine_python("deepspeed"), str(ROOT / "tests" / "deepspeed_workers.py")],
                         input=json.dumps([to_deepspeed(run) for run in DS_RUNS]), capture_output=True, text=True,
                         timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = json.loads(out.stdout.strip().splitlines()[-1])
    assert not list(tmp_path.iterdir()), "DeepSpeed compiled an op: the run no longer avoids its JIT builds"
    n = TINY_LLAMA.num_params()
    for run, got, other in zip(DS_RUNS, *ranks):
        policy = {"fp32": "fp32", "bf16-mixed": "mixed"}[run.precision]
        want = deepspeed_model_state_bytes(n, run.replicas, run.zero_stage, policy, run.optimizer)
        assert got == other and got["stage"] == run.zero_stage, (run, got, other)  # both ranks hold the same
        assert got["param_dtype"] == ("float32" if run.precision == "fp32" else "bfloat16")
        assert got["params"] == want.params, (run, got, want)
        assert got["master"] + got["moments"] == want.optimizer, (run, got, want)
        assert got["whole_grads_left"] == 0, (run, got)  # no whole gradient outlives the backward
        if run.offload:  # the gradient partition goes to the offloaded optimizer's buffer
            assert got["grads"] == 0, (run, got)
            continue
        assert got["grads"] == want.grads, (run, got, want)
        paper = zero_model_state_bytes(n, run.replicas, run.zero_stage, policy, run.optimizer)
        # where DeepSpeed departs from the paper's count, and only there (the two named differences)
        assert (got["grads"] != paper.grads) == (run.zero_stage == 1), (run, got, paper)
        assert (got["master"] + got["moments"] != paper.optimizer) == (run.precision == "fp32"), (run, got, paper)


def test_refusals_name_the_engine_and_the_setting():
    with pytest.raises(ValueError, match=r"DeepSpeed cannot express zero_stage=3 with pp_size=2"):
        to_deepspeed(RunConfig(dp_size=2, pp_size=2, num_microbatches=2, seq_len=64, zero_stage=3))
    with pytest.raises(ValueError, match=r"torchtitan cannot express zero_stage=1"):
        to_torchtitan(RunConfig(dp_size=2, seq_len=64, zero_stage=1))
    with pytest.raises(ValueError, match=r"torchtitan cannot express attention='eager'"):
        to_torchtitan(RunConfig(dp_size=2, seq_len=64, zero_stage=3, attention="eager"))
    with pytest.raises(ValueError, match=r"Megatron-LM cannot express offload_params=True"):
        to_megatron(RunConfig(dp_size=2, seq_len=64, zero_stage=3, offload=True, offload_params=True))
    buffer = RunConfig(dp_size=2, seq_len=64, zero_stage=1, precision="bf16-mixed-fp32-buffer")
    with pytest.raises(ValueError, match=r"Megatron-LM cannot express precision='bf16-mixed-fp32-buffer' is "
                                         r"DeepSpeed's BF16 optimizer"):
        to_megatron(buffer)
    assert to_deepspeed(buffer)["data_types"] == {"grad_accum_dtype": "fp32"}
    with pytest.raises(ValueError, match=r"DeepSpeed cannot express precision='bf16-mixed-fp32-buffer' with "
                                         r"zero_stage=0: it accumulates bf16 gradients in fp32 only under ZeRO"):
        to_deepspeed(buffer.replace(zero_stage=0))
    with pytest.warns(ExportNote, match="its BF16 optimizer, which also holds the bf16 gradients"):
        to_deepspeed(buffer.replace(precision="bf16-mixed-fp32-grads"))
    with pytest.raises(ValueError, match=r"zero_stage=2 must be 0 or 1"):
        buffer.replace(zero_stage=2).check(PRESETS["llama-3-8b"])
    with pytest.raises(ValueError, match=r"engine='nope' is unknown; valid choices: \['deepspeed'"):
        export(BLOOM, "nope")
    with pytest.raises(TypeError, match=r"plan=.* must be a labkit.plan.TrainingPlan"):
        to_deepspeed({"dp_size": 2})


def test_notes_are_warnings_and_export_collects_them():
    with pytest.warns(ExportNote, match="torchtitan: its default under a pipeline keeps FSDP's parameters"):
        to_torchtitan(RunConfig(dp_size=2, pp_size=2, num_microbatches=2, seq_len=64, zero_stage=3))
    x = export(RunConfig(dp_size=2, seq_len=64, attention="eager"), "megatron")
    assert "--attention-backend" in x.config and x.config[x.config.index("--attention-backend") + 1] == "unfused"
    assert set(MAPPINGS) == set(ENGINES)


EXPORTERS = {"accelerate": to_accelerate, "deepspeed": to_deepspeed, "fsdp2": to_fsdp2, "megatron": to_megatron,
             "torchtitan": to_torchtitan, "vllm": to_vllm}
# Plans that between them make every engine say each of its notes.
NOTED = [
    ("accelerate", RunConfig(dp_size=16, seq_len=2048, zero_stage=3), {}),
    ("accelerate", RunConfig(dp_size=2, seq_len=64, zero_stage=1, micro_batch=2, num_microbatches=3,
                             optimizer="sgd_momentum"), {"gradient_clipping": 0.5}),
    ("deepspeed", RunConfig(dp_size=2, pp_size=2, num_microbatches=2, seq_len=64, zero_stage=1, recompute="full",
                            attention="eager"), {}),
    ("deepspeed", RunConfig(dp_size=2, seq_len=64, zero_stage=1, precision="bf16-mixed-fp32-grads",
                            recompute="selective", ep_size=2), {}),
    ("fsdp2", RunConfig(tp_size=2, pp_size=2, num_microbatches=2, seq_len=64, zero_stage=3), {}),
    ("fsdp2", RunConfig(dp_size=2, seq_len=64, zero_stage=3, attention="eager", precision="fp32"), {}),
    ("megatron", RunConfig(dp_size=2, seq_len=64, zero_stage=2, offload=True), {"shape": PRESETS["deepseek-v3"]}),
    ("torchtitan", RunConfig(dp_size=2, pp_size=2, num_microbatches=2, seq_len=64, zero_stage=3,
                             recompute="selective", optimizer="adam", overlap_grad_reduce=False), {}),
    ("vllm", plan_serving("gpt-oss-20b", gpu="l4", context_len=4096).plans[0], {}),
    ("vllm", plan_serving("mixtral-8x7b", gpu="a100-80gb", num_gpus=2, context_len=4096, weight_format="fp8",
                          expert_parallel=(False,)).plans[0], {}),
    ("vllm", plan_serving("llama-3-8b", gpu="a100-80gb", context_len=4096, weight_format="int4-awq").plans[0], {})]
EXPORT_KINDS = {kind for kind in CATALOGUES["en"] if kind.startswith("export.") and kind != "export.note"}
FIELD = re.compile(r"\{(\w*)(?:![rs])?(?::[^{}]*)?\}")  # a template's field names (labkit.messages)
CJK = re.compile(r"[\u4e00-\u9fff]")


def _notes(engine: str, plan, options: dict, lang: str) -> list:
    """The ExportNote warnings exporting ``plan`` to ``engine`` raises in ``lang``."""
    with using(lang), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportNote)
        EXPORTERS[engine](plan, **options)
    return [w.message for w in caught if issubclass(w.category, ExportNote)]


def test_every_note_is_said_in_the_language_labkit_prints_in():
    """Exported under ``using("zh_CN")``, each note is the English one's kind and fields said in
    Chinese, after the engine's name; export() collects them as said; the plans say every kind."""
    said = set()
    for engine, plan, options in NOTED:
        en, zh = (_notes(engine, plan, options, lang) for lang in ("en", "zh_CN"))
        assert [(n.engine, n.kind, n.fields) for n in zh] == [(n.engine, n.kind, n.fields) for n in en], engine
        for e, z in zip(en, zh):
            assert str(e) == f"{e.engine}: {render(e.kind, 'en', **e.fields)}"
            assert str(z) == f"{z.engine}：{render(z.kind, 'zh_CN', **z.fields)}" and CJK.search(str(z)), z
        with using("zh_CN"):
            assert export(plan, engine, **options).notes == [str(n) for n in zh]
        said |= {n.kind for n in en}
    assert said == EXPORT_KINDS, sorted(EXPORT_KINDS - said)


def test_every_note_call_names_a_kind_of_the_catalogue_with_its_fields():
    """Each ``note(engine, kind, **fields)`` of the exporters, read from their source: ``kind`` is a
    catalogue kind given as written, ``fields`` its template's; and no export kind goes unsaid."""
    called = set()
    for path in (ROOT / "labkit" / "plan" / "export").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "note":
                kind = node.args[1]
                assert isinstance(kind, ast.Constant) and kind.value in EXPORT_KINDS, (path.name, ast.unparse(node))
                assert {k.arg for k in node.keywords} == set(FIELD.findall(CATALOGUES["en"][kind.value])), \
                    (path.name, ast.unparse(node))
                called.add(kind.value)
    assert called == EXPORT_KINDS, sorted(EXPORT_KINDS ^ called)


def test_vllm_arguments_follow_the_serving_plan():
    plan = plan_serving("llama-3-8b", gpu="a100-80gb", num_gpus=2, context_len=4096, kv_bytes=1).plans[0]
    args = to_vllm(plan, model="meta-llama/Meta-Llama-3-8B")
    flags = dict(zip(args[1::2], args[2::2]))
    assert args[0] == "meta-llama/Meta-Llama-3-8B" and flags["--tensor-parallel-size"] == str(plan.tp_size)
    assert flags["--max-model-len"] == "4096" and flags["--kv-cache-dtype"] == "fp8"
    assert flags["--block-size"] == "16" and flags["--gpu-memory-utilization"] == "0.9"
    with pytest.raises(ValueError, match=r"vLLM cannot express weight_bytes=1"):
        to_vllm(plan, weight_bytes=1)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "labkit.plan", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)


def test_cli_emits_the_best_plan_the_engine_expresses(tmp_path):
    base = ["train", "--model", "llama-3-70b", "--gpu", "h100-sxm", "--num-gpus", "64", "--seq-len", "8192",
            "--global-batch", "512"]
    out = _cli(*base, "--emit", "deepspeed")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == to_deepspeed(plans_70b()[export_best(plans_70b(), "deepspeed")[0]])
    assert "# plan " in out.stderr and "DeepSpeed cannot express" in out.stderr
    out = _cli(*base, "--emit", "megatron", "--json")
    emitted = json.loads(out.stdout)["emit"]
    assert emitted["engine"] == "megatron" and emitted["plan_index"] == 0 and "--tensor-model-parallel-size" in emitted["config"]
    target = tmp_path / "serve.args"
    out = _cli("serve", "--model", "llama-3-8b", "--gpu", "a100-80gb", "--context-len", "4096", "--emit", "vllm",
               "--out", str(target))
    assert out.returncode == 0 and target.read_text().startswith("vllm serve")
    bad = _cli(*base, "--emit", "vllm")
    assert bad.returncode == 2 and "--emit: invalid choice: 'vllm'" in bad.stderr


def test_chapter_9_shows_what_the_exporters_emit():
    """Each configuration block of Chapter 9's "From a plan to your engine" is the exporter's output
    (or, for FSDP2's script, a part of it), so the chapter cannot drift from the code."""
    import re

    text = (ROOT / "chapters" / "09_planning.md").read_text(encoding="utf-8")
    section = text.split("## From a plan to your engine")[1].split("\n## ")[0]
    blocks = re.findall(r"```(?:text|json|python|yaml)\n(.*?)\n```", section, re.S)
    offload = plan_training("llama-2-7b", gpu="a100-80gb", num_gpus=1, seq_len=4096, global_batch=16,
                            offload=(True,)).plans[0]
    served = plan_serving("llama-3-8b", gpu="a100-80gb", context_len=4096).plans[0]
    emitted = [export_best(plans_70b(), e, **({"shape": PRESETS["llama-3-70b"]} if e == "torchtitan" else {}))[1].text
               for e in ("megatron", "deepspeed", "torchtitan", "fsdp2")] + [
        export(offload, "accelerate").text, export(served, "vllm", model="meta-llama/Meta-Llama-3-8B").text]
    assert len(blocks) == len(emitted) == 6
    for block, want in zip(blocks, emitted):
        assert block in want, f"the chapter's block is not what the exporter writes now:\n{block}\n---\n{want}"


@pytest.mark.xdist_group("dist:export_fsdp2")
@pytest.mark.parametrize("m", [2, 1], ids=["1f1b", "gpipe"])
def test_fsdp2_script_pipeline_matches_the_whole_model(m):
    """The script's (pp, dp, tp) mesh and pipeline() on 2 stages: the micro-batches' loss and every
    stage's gradients equal the whole model's (fp32; only the sums' order differs)."""
    from labkit.dist import launch

    sys.path.insert(0, str(ROOT / "tests"))
    from export_fsdp2_workers import run_emitted_pipeline

    run = RunConfig(pp_size=2, num_microbatches=m, micro_batch=2 // m, seq_len=16, precision="fp32")
    assert run.schedule == {2: "1f1b", 1: "gpipe"}[m]
    first, last = launch(run_emitted_pipeline, 2, to_fsdp2(run), backend="gloo", timeout_s=60)
    assert first["mesh"] == last["mesh"] == [2, 1, 1] and first["stages"] + last["stages"] == 21
    # judged against the run's round-off: the unsharded fp32 model's own error against float64
    err, floor = last["loss_roundoff"]
    assert err <= 4 * floor, last
    for r in (first, last):
        err, floor = r["grads"]
        assert err <= 4 * floor, r
