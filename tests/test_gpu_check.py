"""scripts/gpu_check.py starts on a CPU machine, skips its GPU parts and writes nothing there."""

from __future__ import annotations

import datetime as dt
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gpu_check", gpu_check)  # dataclasses look their module up there
_spec.loader.exec_module(gpu_check)


def _env(**extra) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "scripts"),
                                         os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)


def test_on_a_cpu_machine_it_skips_with_a_message_and_writes_nothing():
    results = ROOT / "GPU_RESULTS.md"
    before = (results.read_bytes(), results.stat().st_mtime_ns, sorted(os.listdir(ROOT)))
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this checks the CPU path on every machine.
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=_env(CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert gpu_check.SKIP_MESSAGE in proc.stdout
    assert (results.read_bytes(), results.stat().st_mtime_ns, sorted(os.listdir(ROOT))) == before


def test_bad_budget_is_refused_naming_the_flag():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--budget-s", "-1"], capture_output=True,
                          text=True, timeout=120, env=_env(CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 2 and "--budget-s=-1" in proc.stderr, proc.stderr


def test_plugin_keeps_only_the_tests_that_need_cuda(tmp_path):
    (tmp_path / "test_mixed.py").write_text(
        "import pytest\n"
        "@pytest.mark.skipif(True, reason='needs a CUDA GPU')\n"
        "def test_on_gpu(): pass\n"
        "@pytest.mark.skipif(False, reason='needs 2 CUDA GPUs: NCCL ranks')\n"
        "def test_on_two_gpus(): pass\n"
        "@pytest.mark.skipif(True, reason='needs the network')\n"
        "def test_elsewhere(): pass\n"
        "def test_plain(): pass\n"
        "def test_nccl_group_starts(): pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p",
                           "gpu_check", "--collect-only", "-q", "-o", "addopts=", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=_env())
    collected = [ln.split("::")[-1] for ln in proc.stdout.splitlines() if "::" in ln]
    assert collected == ["test_on_gpu", "test_on_two_gpus", "test_nccl_group_starts"], proc.stdout + proc.stderr


def test_the_section_is_appended_and_the_old_text_kept(tmp_path):
    results = tmp_path / "GPU_RESULTS.md"
    results.write_text("# Measurements on a GPU\n\nearlier text\n", encoding="utf-8")
    steps = [gpu_check.Step("CUDA tests", ["pytest"], 12.3, 0,
                            "== 9 passed, 2 skipped in 12.0s =="),
             gpu_check.Step("bench_memory", ["x"], 4.0, 1, "peak 1.23 GB\n", record_output=True),
             gpu_check.Step("bench_zero", ["y"])]
    info = {"Device": "NVIDIA Test GPU", "torch": "2.13.0", "CUDA": "12.8"}
    when = dt.datetime(2026, 12, 2, 4, 5, tzinfo=dt.timezone.utc)
    gpu_check.append_section(results, gpu_check.format_section(when, info, steps))
    text = results.read_text(encoding="utf-8")
    assert text.startswith("# Measurements on a GPU\n\nearlier text\n\n## 2026-12-02 04:05 UTC")
    assert "| CUDA tests | passed | 12 | 9 passed, 2 skipped in 12.0s |" in text
    assert "| bench_memory | FAILED (exit status 1) |" in text and "peak 1.23 GB" in text
    assert "| bench_zero | not run (time budget spent) |" in text
    assert "- torch: 2.13.0" in text and list(tmp_path.iterdir()) == [results]


def test_each_benchmark_step_names_a_script_and_flags_it_has():
    """The GPU run cannot be tried here: at least each command's script and flags must exist."""
    for name, command, cap in gpu_check.BENCHMARKS:
        script = ROOT / command[0]
        assert script.is_file() and cap > 0, name
        source = script.read_text(encoding="utf-8")
        for flag in (arg for arg in command[1:] if arg.startswith("--")):
            assert f'"{flag}"' in source, f"{name}: {script.name} has no {flag} option"
    names = [s.name for s in gpu_check.gpu_steps()]
    assert names[:2] == ["CUDA tests", "labs under nbval on CUDA"], names


def test_a_step_is_stopped_at_its_cap_and_a_spent_budget_runs_nothing():
    import time

    slow = gpu_check.Step("slow", [sys.executable, "-c", "import time; time.sleep(60)"], cap=1.5)
    gpu_check.run_step(slow, deadline=time.monotonic() + 60)
    assert slow.outcome == "timed out" and slow.seconds < 30, (slow.outcome, slow.seconds)
    late = gpu_check.Step("late", [sys.executable, "-c", "print('ran')"])
    gpu_check.run_step(late, deadline=time.monotonic() - 1)
    assert late.outcome == "not run (time budget spent)" and late.output == ""


def test_failed_tests_are_named_from_the_summary_or_from_verbose_lines():
    summary = ("FAILED labs/04_accumulation.ipynb::Cell 11@nbval - Notebook cell execution failed\n"
               "ERROR tests/test_x.py::test_b - RuntimeError\n12 failed, 182 passed in 131.36s\n")
    cut_short = ("tests/test_a.py::test_cuda_one PASSED  [  6%]\n"
                 "tests/test_a.py::test_cuda_two FAILED  [ 12%]\n(timed out after 240 s)\n")
    assert gpu_check.failed_tests(summary) == ["labs/04_accumulation.ipynb::Cell 11@nbval",
                                               "tests/test_x.py::test_b"]
    assert gpu_check.failed_tests(cut_short) == ["tests/test_a.py::test_cuda_two"]
    assert gpu_check.failed_tests("3 passed in 1.0s\n") == []
