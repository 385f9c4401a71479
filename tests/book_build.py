"""Build the book exactly as README.md tells a newcomer, into OUT; write OUT/result.json.

    python tests/book_build.py OUT

A clone (the files git tracks or would track, as they are in the working tree), a virtual
environment made inside it (``python3 -m venv .venv``), then the README's build command in that
environment: ``pip install -r requirements-book.txt && python scripts/build_book.py`` (-W). The
environment holds the book's set only, so the build cannot lean on torch, Triton, labkit or a test
tool, and the book must not read ``.venv``. conftest.py's ``built_book`` starts this in the
background and reads result.json (written, then renamed: a reader never sees half of it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def clone(dest: Path) -> None:
    """What ``git clone`` of this checkout gives, with the working tree's uncommitted changes."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():  # a deleted, not yet committed file is listed but gone
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run(cmd: list[str], cwd: Path, env: dict, log: list[str], timeout: float) -> int:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    log.append(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return proc.returncode


def build(out: Path) -> dict:
    course = out / "course"
    clone(course)
    python = course / ".venv" / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(VIRTUAL_ENV=str(python.parent.parent),  # what `. .venv/bin/activate` sets
               PATH=os.pathsep.join([str(python.parent), env.get("PATH", "")]))
    log: list[str] = []
    code, skip = run([sys.executable, "-m", "venv", ".venv"], course, env, log, 300), None
    if code == 0:
        code = run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                    "-r", "requirements-book.txt"], course, env, log, 1200)
        if code != 0:
            skip = ("pip could not install requirements-book.txt into a new virtual environment "
                    f"(offline?): the book is built as the README says or not at all\n{log[-1][-2000:]}")
    if code == 0:
        code = run([str(python), "scripts/build_book.py"], course, env, log, 1200)
    return {"returncode": code, "log": "\n".join(log), "html": str(course / "_build" / "html"),
            "skip": skip}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    try:
        result = build(out)
    except Exception as err:  # reported to the tests, not lost in a background process
        result = {"returncode": 1, "log": f"{type(err).__name__}: {err}", "html": "", "skip": None}
    tmp = out / "result.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.replace(out / "result.json")
