"""The Colab route, run offline the way Colab runs it.

A copy of this checkout, published with ``set_repo_url.py`` under a made-up GitHub address, is
served as a bare git repository; git's ``insteadOf`` maps that address onto it, so the lab's
install cell runs exactly as written. The lab runs in a fresh virtual environment that already
has torch, numpy and matplotlib (this interpreter's, as Colab's image has its own) but no labkit.
Then: pip's dry run shows that labkit is the only package it would install (torch is neither
replaced nor downgraded), the install cell installs labkit from that address, and the lab's next
cell, which uses labkit, runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAB = "labs/01_memory_wall.ipynb"
PUBLISHED = "https://github.com/colab-check/course"

# Runs in the lab's environment: the install cell, then the next code cell, as IPython would.
DRIVER = r"""
import json, sys
from IPython.core.interactiveshell import InteractiveShell
cells = [''.join(c['source']) for c in json.load(open(sys.argv[1]))['cells']
         if c['cell_type'] == 'code']
first = next(i for i, src in enumerate(cells) if '%pip install' in src)
shell = InteractiveShell.instance()
for src in cells[first:first + 2]:
    result = shell.run_cell(src)
    if not result.success:
        sys.exit(f'cell failed: {result.error_in_exec or result.error_before_exec}')
import labkit, torch
print('LABKIT', labkit.__file__)
print('TORCH', torch.__version__)
"""


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _published_copy(tmp: Path) -> Path:
    """This checkout's files (tracked and new), published at PUBLISHED, as a bare repository."""
    src = tmp / "src"
    files = _run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT).stdout
    for name in filter(None, files.split("\0")):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    _run([sys.executable, "scripts/set_repo_url.py", PUBLISHED, "--branch", "main"], cwd=src)
    git = ["git", "-c", "user.name=course", "-c", "user.email=course@localhost"]
    _run(["git", "init", "-q", "-b", "main"], cwd=src)
    _run(["git", "add", "-A"], cwd=src)
    _run(git + ["commit", "-q", "-m", "published copy"], cwd=src)
    served = tmp / "github" / PUBLISHED.removeprefix("https://github.com/")
    _run(["git", "clone", "-q", "--bare", str(src), str(served)])
    return src


def _colab_like_env(tmp: Path) -> Path:
    """A virtual environment holding this interpreter's packages (torch included) but no labkit.

    Each package is linked in, not added as a site directory, so the editable labkit of the
    development install (a .pth hook) stays out.
    """
    env_dir = tmp / "colab"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                      "['purelib'])"]).stdout.strip())
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("labkit", "__editable__")) and entry.suffix != ".pth":
            (site / entry.name).symlink_to(entry)
    return python


@pytest.mark.skipif(sys.platform == "win32", reason="the virtual environment layout is POSIX")
def test_a_lab_installs_labkit_from_the_published_address_and_keeps_torch(tmp_path):
    import torch

    src = _published_copy(tmp_path)
    python = _colab_like_env(tmp_path)
    gitconfig = tmp_path / "gitconfig"
    served = f"file://{tmp_path / 'github'}/"
    gitconfig.write_text(f'[url "{served}"]\n\tinsteadOf = https://github.com/\n')
    # Nothing of this interpreter's own environment either: a VIRTUAL_ENV (the README's .venv)
    # makes IPython add that environment's site-packages, editable labkit included, to sys.path.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHONPATH", "PIP_", "VIRTUAL_ENV"))}
    own_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                  if sys.prefix == sys.base_prefix or d != own_bin)
    # Offline: pip finds the dependencies installed and builds labkit with the setuptools there.
    env.update(GIT_CONFIG_GLOBAL=str(gitconfig), GIT_CONFIG_NOSYSTEM="1", PIP_NO_INDEX="1",
               PIP_NO_BUILD_ISOLATION="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    missing = subprocess.run([str(python), "-c", "import labkit"], env=env, cwd=tmp_path,
                             capture_output=True)
    assert missing.returncode != 0, "labkit must be missing before the install cell runs"

    report = tmp_path / "report.json"
    _run([str(python), "-m", "pip", "install", "--dry-run", "--report", str(report), "-q",
          f"labkit @ git+{PUBLISHED}"], env=env)
    planned = [(i["metadata"]["name"], i["metadata"]["version"])
               for i in json.loads(report.read_text())["install"]]
    assert [name for name, _ in planned] == ["labkit"], f"pip would also install: {planned}"

    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    out = _run([str(python), str(driver), str(src / LAB)], env=env, cwd=src / "labs").stdout
    lines = dict(ln.split(" ", 1) for ln in out.splitlines() if ln.startswith(("LABKIT", "TORCH")))
    assert lines["LABKIT"].startswith(str(tmp_path / "colab")), lines  # installed, not the checkout
    assert lines["TORCH"] == torch.__version__, lines  # the environment's torch, kept
