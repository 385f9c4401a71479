"""Run everything that needs a CUDA GPU and record what it printed in GPU_RESULTS.md.

    python scripts/gpu_check.py                 # on a machine with one CUDA GPU, in under 9 minutes
    python scripts/gpu_check.py --budget-s 300  # a tighter time limit for all steps together

Runs, in this order: every CUDA test (the tests under tests/ that skip without a GPU), every lab
under nbval on CUDA (its checked outputs must not change there) and the GPU benchmarks with short
settings. Then appends a dated section to GPU_RESULTS.md with the device, the versions of
Python, torch, CUDA and Triton, each step's outcome and the benchmarks' printed figures. The file
is written to a temporary file first and then renamed over the old one.

Without a CUDA GPU it prints which parts it skips and why, writes nothing and exits with 0, so a
CPU machine (CI) can check that the script starts. The exit status is 1 if a step failed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "GPU_RESULTS.md"
SKIP_MESSAGE = ("No CUDA GPU found (torch.cuda.is_available() is False): skipping the CUDA tests, "
                "the labs under nbval on CUDA and the GPU benchmarks. Nothing is written to "
                "GPU_RESULTS.md.")
# A test counts as a CUDA test when one of its skipif reasons names the GPU (the tests' convention:
# "needs a CUDA GPU", "needs 2 CUDA GPUs: ...") or its function's name names a GPU path.
REASON_WORDS = ("cuda", "gpu")
NAME_WORDS = ("cuda", "nccl", "triton", "on_the_gpu")
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
# the labs' kernels, two cores each (a lab's ranks and its kernel), at most 8
LAB_WORKERS = max(1, min(8, (os.cpu_count() or 2) // 2))
# (name, command, seconds at most): their printed figures are recorded
BENCHMARKS = [
    ("bench_memory", ["scripts/bench_memory.py", "--device", "cuda"], 60),
    ("bench_checkpoint", ["scripts/bench_checkpoint.py", "--device", "cuda", "--steps", "3"], 60),
    ("bench_zero", ["scripts/bench_zero.py", "--world-sizes", "1", "--steps", "3"], 60),
    ("bench_flash_attention", ["scripts/bench_flash_attention.py", "--device", "cuda",
                               "--lengths", "1024", "4096", "--iters", "5"], 90),
    ("bench_paged_attention", ["scripts/bench_paged_attention.py", "--device", "cuda",
                               "--requests", "32"], 60),
]


@dataclass
class Step:
    name: str
    command: list[str]
    seconds: float = 0.0
    returncode: int | None = None  # None: timed out or not run
    output: str = ""
    record_output: bool = False
    cap: float | None = None  # seconds this step may take at most (besides the overall budget)

    @property
    def outcome(self) -> str:
        if self.returncode is None:
            return "not run (time budget spent)" if not self.output else "timed out"
        return "passed" if self.returncode == 0 else f"FAILED (exit status {self.returncode})"


def pytest_collection_modifyitems(config, items) -> None:
    """pytest plugin (``-p gpu_check``): keep only the tests that need CUDA."""
    def needs_gpu(item) -> bool:
        reasons = " ".join(str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
        name = getattr(item, "originalname", item.name).lower()
        return (any(word in reasons.lower() for word in REASON_WORDS)
                or any(word in name for word in NAME_WORDS))

    kept = [item for item in items if needs_gpu(item)]
    config.hook.pytest_deselected(items=[i for i in items if i not in kept])
    items[:] = kept


def gpu_steps() -> list[Step]:
    """The CUDA tests, the labs under nbval, then the benchmarks."""
    steps = [
        # -v: each test's name as it ends, so a step cut short still says which ran and failed
        Step("CUDA tests", PYTEST + ["-p", "gpu_check", "-rs", "-v", "-o", "addopts=", "tests"],
             cap=240),
        Step("labs under nbval on CUDA",
             PYTEST + ["--nbval", "-q", "-n", str(LAB_WORKERS), "--dist", "loadgroup", "labs"],
             cap=180),
    ]
    steps += [Step(name, [sys.executable, *cmd], record_output=True, cap=cap)
              for name, cmd, cap in BENCHMARKS]
    return steps


def run_step(step: Step, deadline: float) -> None:
    """Run ``step`` until it ends, its cap or the deadline passes; echo and keep its output."""
    left = deadline - time.monotonic()
    limit = left if step.cap is None else min(step.cap, left)
    if limit < 1:
        return
    print(f"\n=== {step.name}: {' '.join(step.command)}", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), str(ROOT / "scripts"), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    try:
        proc = subprocess.run(step.command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=limit)
        step.returncode, step.output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or b""
        out = out.decode() if isinstance(out, bytes) else out
        step.output = out + f"\n(timed out after {limit:.0f} s)"
    step.seconds = time.monotonic() - start
    print(step.output, flush=True)
    print(f"=== {step.name}: {step.outcome} in {step.seconds:.0f} s", flush=True)


def environment() -> dict[str, str]:
    """The device and the versions a run is recorded with."""
    import torch

    info = {"Device": torch.cuda.get_device_name(0), "Python": platform.python_version(),
            "torch": torch.__version__, "CUDA": str(torch.version.cuda)}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        if smi.returncode == 0:
            info["nvidia-smi"] = smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        import triton
        info["Triton"] = triton.__version__
    except ImportError:
        info["Triton"] = "not installed"
    return info


def summary_line(output: str) -> str:
    """pytest's last summary line ("12 passed, 3 skipped in 40.1s"), or ''."""
    lines = [ln.strip("= ") for ln in output.splitlines() if ln.strip()]
    words = ("passed", "failed", "error")
    found = [ln for ln in lines if " in " in ln and any(w in ln for w in words)]
    return found[-1] if found else ""


def failed_tests(output: str) -> list[str]:
    """The node ids pytest reported as failed or in error: from its short summary, or from -v's
    per-test lines when the step was cut short before the summary."""
    found: dict[str, None] = {}  # ordered, no repeats
    for line in output.splitlines():
        match = (re.match(r"(?:FAILED|ERROR) (\S.*?::.+?)(?: - .*)?$", line)
                 or re.match(r"(\S.*?::.+?) (?:FAILED|ERROR)(?: |$)", line))
        if match:
            found.setdefault(match.group(1), None)
    return list(found)


def format_section(when: dt.datetime, info: dict[str, str], steps: list[Step]) -> str:
    """The Markdown section appended to GPU_RESULTS.md for one run."""
    lines = [f"## {when:%Y-%m-%d %H:%M} UTC: {info.get('Device', 'unknown device')}", ""]
    lines += [f"- {key}: {value}" for key, value in info.items()]
    lines += ["", "| Step | Outcome | Seconds | pytest summary |", "|---|---|---|---|"]
    lines += [f"| {s.name} | {s.outcome} | {s.seconds:.0f} | {summary_line(s.output)} |"
              for s in steps]
    for s in steps:
        if not s.record_output and failed_tests(s.output):
            lines += ["", f"{s.name}, failed:", ""]
            lines += [f"- `{node}`" for node in failed_tests(s.output)]
    for s in steps:
        if s.record_output and s.output:
            lines += ["", f"### {s.name}", "", "```text", s.output.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def append_section(path: Path, section: str) -> None:
    """Append ``section`` to ``path`` via a temporary file and a rename (nothing half-written)."""
    old = path.read_text(encoding="utf-8") if path.is_file() else "# Measurements on a GPU\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(old.rstrip("\n") + "\n\n" + section)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=530.0,
                        help="seconds for all steps together (default 530, under 9 minutes)")
    parser.add_argument("--results", type=Path, default=RESULTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s={args.budget_s} must be a positive number of seconds")
    import torch

    if not torch.cuda.is_available():
        print(SKIP_MESSAGE)
        return 0
    deadline = time.monotonic() + args.budget_s
    when = dt.datetime.now(dt.timezone.utc)
    info = environment()
    print("\n".join(f"{k}: {v}" for k, v in info.items()), flush=True)
    steps = gpu_steps()
    for step in steps:
        run_step(step, deadline)
    append_section(args.results, format_section(when, info, steps))
    print(f"\nAppended a section to {args.results}")
    return 0 if all(s.returncode == 0 for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
