"""The round-off-sensitive checks also hold under another machine's CPU kernels.

PyTorch's ``ATEN_CPU_CAPABILITY`` picks the CPU kernels (``default``, ``avx2``, ``avx512``) and
``OMP_NUM_THREADS=1`` changes how reductions split: together they change the bits of sums and
matmuls as another CPU would. Every test marked ``roundoff`` (and every cell of the labs in
conftest.ROUNDOFF_LABS) runs again here, in a subprocess, under a kernel setting other than this
process's one and with one thread. A check tuned to one CPU's bits fails here.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from labkit.dist import busy_note, timeout_scale

ROOT = Path(__file__).resolve().parents[1]
# Set in the subprocess: the re-run never starts another re-run of itself.
GUARD = "LABKIT_CROSS_MACHINE_RUN"


def best_capability() -> str:
    """The CPU's best kernel setting, as PyTorch picks it with ATEN_CPU_CAPABILITY unset."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1]


def other_capability(current: str, best: str) -> str | None:
    """A kernel setting other than ``current``: generic kernels if it is vectorised, else the
    CPU's best; None when the CPU offers only one (the one-thread reductions still differ)."""
    if current.upper() != "DEFAULT":
        return "default"
    if best.upper() != "DEFAULT":
        return best.lower()
    return None


@pytest.mark.parametrize("current, best, expected", [
    ("AVX512", "AVX512", "default"), ("AVX2", "AVX512", "default"),
    ("DEFAULT", "AVX512", "avx512"), ("DEFAULT", "AVX2", "avx2"), ("DEFAULT", "DEFAULT", None),
])
def test_other_capability_differs_from_the_current_one(current, best, expected):
    assert other_capability(current, best) == expected


def _targets() -> list[str]:
    """The test files that mark a test ``roundoff`` and the labs of conftest.ROUNDOFF_LABS
    (collecting only these keeps the re-run short)."""
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    root_conftest = sys.modules.setdefault("root_conftest", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(root_conftest)  # registered first: its dataclass looks itself up
    files = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "tests").glob("test_*.py"))
             if p.name != Path(__file__).name and "mark.roundoff" in p.read_text(encoding="utf-8")]
    return files + list(root_conftest.ROUNDOFF_LABS)


def _counts(junit: Path) -> dict[str, int]:
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


# The re-run is cut into shards that the xdist workers share (each shard is one pytest
# subprocess, whose start, collection and servers under the other setting cost about 7 CPU-s: two
# shards, not more). A target's cost balances them: its CPU-seconds in the re-run on two idle
# cores, less that start (measured; scripts/results/suite_times.md), 1 if not listed.
SHARDS = 2
COST = {"tests/test_parallelize.py": 33, "labs/04_accumulation.ipynb": 22, "tests/test_llama_techniques.py": 13,
        "tests/test_pipeline_dist.py": 11, "tests/test_tensor_parallel.py": 8, "tests/test_context_parallel.py": 6,
        "tests/test_accumulate_ddp.py": 3, "tests/test_accumulate.py": 3, "tests/test_llama.py": 3}


def shards(targets: list[str], n: int = SHARDS) -> list[list[str]]:
    """``targets`` in ``n`` lists of about equal cost (the costliest first, each to the lightest)."""
    out, load = [[] for _ in range(n)], [0] * n
    for t in sorted(targets, key=lambda t: -COST.get(t, 1)):
        i = load.index(min(load))
        out[i].append(t)
        load[i] += COST.get(t, 1)
    return out


def test_the_shards_cover_every_target_once():
    targets = _targets()
    assert sorted(t for shard in shards(targets) for t in shard) == sorted(targets)
    assert all(shards(targets))  # no empty shard: each subprocess runs something


@pytest.mark.skipif(os.environ.get(GUARD) == "1", reason="already inside the re-run")
@pytest.mark.parametrize("shard", range(SHARDS))
def test_roundoff_checks_pass_under_other_cpu_kernels(tmp_path, shard):
    current = torch.backends.cpu.get_cpu_capability()
    other = other_capability(current, best_capability())
    env = dict(os.environ, OMP_NUM_THREADS="1", **{GUARD: "1"})
    env.pop("ATEN_CPU_CAPABILITY", None)
    if other is not None:
        env["ATEN_CPU_CAPABILITY"] = other
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    junit = tmp_path / "roundoff.xml"
    targets = shards(_targets())[shard]
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist",
           "-m", "roundoff", "-q", f"--junitxml={junit}", *targets]
    setting = f"ATEN_CPU_CAPABILITY={other or '(only one offered)'} OMP_NUM_THREADS=1"
    limit = 900 * timeout_scale()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as err:
        log = ((err.stdout or b"").decode(errors="replace") + (err.stderr or b"").decode(errors="replace"))
        pytest.fail(f"the re-run of {targets} under {setting} did not finish within {limit:g} s; "
                    f"{busy_note() or 'the machine was not busy: a hang?'}\n{log[-4000:]}")
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"roundoff checks fail under {setting} (native {current}):\n{log}"
    counts = _counts(junit)
    ran = counts["tests"] - counts["skipped"]
    assert ran >= 1, f"no roundoff check ran under {setting}: {counts}\n{log}"
    print(f"{ran} roundoff checks of {targets} passed under {setting} (this process: {current})")
