"""README.md gives one command to build the book and one to run every test; CI runs the latter."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _command(section: str) -> str:
    """The single command in the first ```bash block under ``## {section}`` of README.md."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    body = readme.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", body, re.S)
    assert block, f"README section {section!r} has no bash block"
    lines = [ln for ln in block.group(1).splitlines() if ln.strip()]
    assert len(lines) == 1, f"README section {section!r} must hold exactly one command: {lines}"
    return lines[0].strip()


def test_build_command_runs_the_build_script():
    cmd = _command("Build the book")
    assert cmd.startswith("pip install -r requirements.txt && pip install -e . && ")
    assert cmd.endswith("python scripts/build_book.py")


def test_ci_runs_exactly_the_readme_test_command():
    cmd = _command("Run every test")
    assert "pytest" in cmd
    ci = ROOT / ".ci" / "run"
    assert os.access(ci, os.X_OK), ".ci/run must be executable"
    lines = [ln.strip() for ln in ci.read_text(encoding="utf-8").splitlines()]
    assert "set -euo pipefail" in lines
    assert cmd in lines, f".ci/run does not run the README's test command {cmd!r}"


def test_readme_says_how_to_publish_with_the_one_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    body = readme.split("## How to publish\n", 1)[1].split("\n## ", 1)[0]
    assert "python scripts/set_repo_url.py https://github.com/OWNER/NAME" in body
    assert "--check" in body and "repository.url" in body
    assert (ROOT / "scripts" / "set_repo_url.py").is_file()
