"""One setting for the repository's address (_config.yml), written everywhere by one command."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "set_repo_url.py"
_spec = importlib.util.spec_from_file_location("set_repo_url", SCRIPT)
sru = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sru)

_nspec = importlib.util.spec_from_file_location("placeholder_notice",
                                                ROOT / "_ext" / "placeholder_notice.py")
notice = importlib.util.module_from_spec(_nspec)
_nspec.loader.exec_module(notice)

EXTERNAL = "https://github.com/pytorch/pytorch/blob/main/c10/cuda/CUDACachingAllocator.cpp"


def _places(root: Path) -> list[str]:
    """Every link to the course's repository found under root (pip installs, Colab, files)."""
    found = []
    for path in sru.files_to_scan(root):
        text = path.read_text(encoding="utf-8")
        for regex in sru.LINK_RES:
            found += [m.group(0) for m in regex.finditer(text) if sru._own(m, root)]
    return found


def test_every_place_agrees_with_the_setting():
    repo, branch = sru.read_setting()
    places = _places(ROOT)
    # the labs' install cells, the README's clone line, the exercises' Colab links
    assert sum("git+https://github.com/" in p for p in places) >= 4, places
    assert sum(p.startswith("git clone https://github.com/") for p in places) >= 1, places
    assert sum("colab.research.google.com" in p for p in places) >= 4, places
    assert sru.disagreements() == [], sru.disagreements()
    assert all(repo in p for p in places) and all(
        f"/{branch}/" in p for p in places if not p.startswith(("git+", "git clone")))


@pytest.fixture
def copy_of_course(tmp_path):
    """The files the command edits, plus a lab added later with another address and a link to
    another project's file, which must be left alone."""
    root = tmp_path / "course"
    root.mkdir()
    for name in ("_config.yml", "intro.md", "README.md", "GPU_RESULTS.md"):
        shutil.copy2(ROOT / name, root / name)
    for folder in ("labs", "exercises", "chapters"):
        shutil.copytree(ROOT / folder, root / folder,
                        ignore=shutil.ignore_patterns("dist", ".ipynb_checkpoints", "*.png"))
    new_lab = {"cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "source": [
        "%pip install -q \"labkit @ git+https://github.com/someone-else/old-name\"\n",
        f"# see {EXTERNAL}\n",
        "# https://colab.research.google.com/github/someone-else/old-name/blob/dev/labs/99_new.ipynb"]}],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (root / "labs" / "99_new.ipynb").write_text(json.dumps(new_lab, indent=1))
    return root


def test_check_finds_a_place_that_disagrees(copy_of_course):
    problems = sru.disagreements(copy_of_course)
    assert len(problems) == 2 and all("labs/99_new.ipynb" in p for p in problems), problems
    assert not any("pytorch/pytorch" in p for p in problems)


def test_the_command_writes_the_address_everywhere(copy_of_course):
    old_repo, _ = sru.read_setting(copy_of_course)
    before = len(_places(copy_of_course))
    command = [sys.executable, str(SCRIPT), "--root", str(copy_of_course)]
    proc = subprocess.run(command + ["https://github.com/new-owner/gpu-course", "--branch",
                                     "published"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "updated labs/99_new.ipynb" in proc.stdout, proc.stderr
    assert sru.read_setting(copy_of_course) == ("new-owner/gpu-course", "published")
    # the "not yet published" banner is shown while the setting is the placeholder, not after
    assert notice.notice_for(f"https://github.com/{old_repo}") is not None
    assert notice.notice_for("https://github.com/new-owner/gpu-course") is None
    assert sru.disagreements(copy_of_course) == []
    assert len(_places(copy_of_course)) == before  # every place rewritten, none lost
    for path in sru.files_to_scan(copy_of_course):
        text = path.read_text(encoding="utf-8")
        assert f"github.com/{old_repo}" not in text and "someone-else" not in text, path
        if path.suffix == ".ipynb":
            json.loads(text)  # still a notebook
    assert EXTERNAL in (copy_of_course / "labs" / "99_new.ipynb").read_text()
    check = subprocess.run(command + ["--check"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "0 place(s) disagree" in check.stdout, check.stdout


@pytest.mark.parametrize("url, branch, named", [
    ("gitlab.com/a/b", "main", "url='gitlab.com/a/b'"),
    ("https://github.com/only-owner", "main", "url="),
    ("https://github.com/a/b", "no spaces", "branch='no spaces'"),
])
def test_bad_arguments_name_the_argument(copy_of_course, url, branch, named):
    with pytest.raises(ValueError, match=named):
        sru.set_repo_url(url, branch, copy_of_course)
