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


@pytest.mark.skipif(os.environ.get(GUARD) == "1", reason="already inside the re-run")
def test_roundoff_checks_pass_under_other_cpu_kernels(tmp_path):
    current = torch.backends.cpu.get_cpu_capability()
    other = other_capability(current, best_capability())
    env = dict(os.environ, OMP_NUM_THREADS="1", **{GUARD: "1"})
    env.pop("ATEN_CPU_CAPABILITY", None)
    if other is not None:
        env["ATEN_CPU_CAPABILITY"] = other
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    junit = tmp_path / "roundoff.xml"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist",
           "-m", "roundoff", "-q", f"--junitxml={junit}", *_targets()]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    setting = f"ATEN_CPU_CAPABILITY={other or '(only one offered)'} OMP_NUM_THREADS=1"
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"roundoff checks fail under {setting} (native {current}):\n{log}"
    counts = _counts(junit)
    ran = counts["tests"] - counts["skipped"]
    assert ran >= 1, f"no roundoff check ran under {setting}: {counts}\n{log}"
    print(f"{ran} roundoff checks passed under {setting} (this process: {current})")
