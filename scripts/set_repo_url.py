"""Keep the course's repository address in one setting and write it everywhere it appears.

    python scripts/set_repo_url.py https://github.com/OWNER/NAME [--branch main]
        set repository.url (and .branch) in _config.yml, then rewrite every place that names the
        course's repository: the labs' install cells (pip install "labkit @ git+https://..."),
        the README's `git clone` line, the Colab links of labs and exercises, and links to the
        repository's own files.
    python scripts/set_repo_url.py --check
        list every place that disagrees with _config.yml (exit status 1 if any).

The setting is `repository.url` and `repository.branch` in _config.yml. The files searched are
every notebook and Markdown file under labs/, chapters/ and exercises/, and intro.md, README.md
and GPU_RESULTS.md, and the translations' catalogues (locales/**/*.po, message by message), so
labs and exercises added later are covered without changing this script.
A GitHub link counts as the course's own when the file it points to exists in this checkout
(links to other projects' files are left alone).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPO_RE = r"[A-Za-z0-9][\w.-]*/[\w.-]+?"
URL_RE = re.compile(rf"^https://github\.com/({REPO_RE})/?$")
# pip install "labkit @ git+https://github.com/OWNER/NAME" (optionally @branch or .git)
PIP_RE = re.compile(rf"git\+https://github\.com/(?P<repo>{REPO_RE})(?:\.git)?(?=[\"'@#\s]|\\)")
COLAB_RE = re.compile(
    rf"https://colab\.research\.google\.com/github/(?P<repo>{REPO_RE})/blob/(?P<branch>[\w.-]+)/"
    r"(?P<path>[^\s)\"'<>\]#?\\]+)")
BLOB_RE = re.compile(
    rf"https://github\.com/(?P<repo>{REPO_RE})/"
    r"(?P<kind>blob|tree)/(?P<branch>[\w.-]+)/(?P<path>[^\s)\"'<>\]#?\\]+)")
# git clone https://github.com/OWNER/NAME[.git] (the README's first step)
CLONE_RE = re.compile(rf"git clone https://github\.com/(?P<repo>{REPO_RE})(?:\.git)?(?=[\s\"'`]|$)",
                      re.M)
# Every kind of place that names the course's repository.
LINK_RES = (PIP_RE, CLONE_RE, COLAB_RE, BLOB_RE)
CONFIG_URL_RE = re.compile(r"(?m)^(repository:\s*\n(?:[ \t]+.*\n)*?[ \t]+url:[ \t]*)(\S+)")
CONFIG_BRANCH_RE = re.compile(r"(?m)^(repository:\s*\n(?:[ \t]+.*\n)*?[ \t]+branch:[ \t]*)(\S+)")


def read_setting(root: Path = ROOT) -> tuple[str, str]:
    """(owner/name, branch) from _config.yml's repository section."""
    text = (root / "_config.yml").read_text(encoding="utf-8")
    url, branch = CONFIG_URL_RE.search(text), CONFIG_BRANCH_RE.search(text)
    if url is None or branch is None or not URL_RE.match(url.group(2)):
        raise ValueError(f"{root / '_config.yml'}: repository.url must be "
                         "https://github.com/OWNER/NAME, with a repository.branch")
    return URL_RE.match(url.group(2)).group(1), branch.group(2)


def files_to_scan(root: Path = ROOT) -> list[Path]:
    """Every file that may name the repository; new labs and exercises are picked up."""
    files = [root / name for name in ("intro.md", "README.md", "GPU_RESULTS.md")]
    for folder in ("labs", "chapters", "exercises"):
        for suffix in ("*.ipynb", "*.md"):
            files += sorted((root / folder).rglob(suffix))
    skip = ("_build", ".ipynb_checkpoints", "dist")
    return [f for f in files if f.is_file() and not set(f.relative_to(root).parts) & set(skip)]


def _own(match, root: Path) -> bool:
    """A Colab or GitHub link to a file of this checkout, or any pip install of labkit."""
    if "path" not in match.groupdict():
        return True
    return (root / match.group("path").rstrip("/.")).exists()


def disagreements(root: Path = ROOT) -> list[str]:
    """'file: found <url>' for every place whose repository or branch differs from the setting."""
    repo, branch = read_setting(root)
    found = []
    texts = [(path, path.read_text(encoding="utf-8")) for path in files_to_scan(root)]
    texts += [(po, text) for po, msgs in _i18n().catalogue_texts(root / "locales").items()
              for text in msgs]  # the translations' catalogues, message by message
    for path, text in texts:
        for regex in LINK_RES:
            for m in regex.finditer(text):
                wrong = m.group("repo") != repo or m.groupdict().get("branch", branch) != branch
                if wrong and _own(m, root):
                    found.append(f"{path.relative_to(root)}: {m.group(0)} "
                                 f"(the setting is {repo}, branch {branch})")
    return found


def rewrite(text: str, repo: str, branch: str, root: Path = ROOT) -> str:
    """``text`` with every link to the course's repository pointing at ``repo`` and ``branch``."""
    def pip(m):
        start, end = m.start("repo") - m.start(), m.end("repo") - m.start()
        return m.group(0)[:start] + repo + m.group(0)[end:]

    def linked(m):
        if not _own(m, root):
            return m.group(0)
        s, o = m.group(0), m.start()
        (rs, r_end), (bs, b_end) = [(a - o, b - o) for a, b in (m.span("repo"), m.span("branch"))]
        return s[:rs] + repo + s[r_end:bs] + branch + s[b_end:]

    text = PIP_RE.sub(pip, text)
    text = CLONE_RE.sub(pip, text)
    text = COLAB_RE.sub(linked, text)
    return BLOB_RE.sub(linked, text)


def set_repo_url(url: str, branch: str = "main", root: Path = ROOT) -> list[Path]:
    """Write ``url`` and ``branch`` into _config.yml and every file; return the files changed."""
    m = URL_RE.match(url or "")
    if m is None:
        raise ValueError(f"url={url!r} must be a GitHub repository address, "
                         "https://github.com/OWNER/NAME")
    if not re.fullmatch(r"[\w.-]+", branch or ""):
        raise ValueError(f"branch={branch!r} must be a branch name (letters, digits, '.', '_', '-')")
    repo = m.group(1)
    config = root / "_config.yml"
    text = config.read_text(encoding="utf-8")
    read_setting(root)  # the section must exist before it is rewritten
    new = CONFIG_URL_RE.sub(lambda c: c.group(1) + f"https://github.com/{repo}", text, count=1)
    new = CONFIG_BRANCH_RE.sub(lambda c: c.group(1) + branch, new, count=1)
    changed = []
    if new != text:
        config.write_text(new, encoding="utf-8")
        changed.append(config)
    for path in files_to_scan(root):
        old = path.read_text(encoding="utf-8")
        updated = rewrite(old, repo, branch, root)
        if updated != old:
            path.write_text(updated, encoding="utf-8")
            changed.append(path)
    for po in sorted((root / "locales").rglob("*.po")):  # English and translation alike
        if _i18n().rewrite_catalogue(po, lambda text: rewrite(text, repo, branch, root)):
            changed.append(po)
    return changed


def _i18n():
    """scripts/i18n.py (the translations' catalogues), loaded by path."""
    import importlib.util

    if "i18n_script" not in sys.modules:
        spec = importlib.util.spec_from_file_location("i18n_script",
                                                      Path(__file__).with_name("i18n.py"))
        sys.modules["i18n_script"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["i18n_script"])
    return sys.modules["i18n_script"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", nargs="?", help="https://github.com/OWNER/NAME")
    parser.add_argument("--branch", default="main", help="the published branch (default main)")
    parser.add_argument("--check", action="store_true", help="only list disagreements")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.check or args.url is None:
            problems = disagreements(args.root)
            for line in problems:
                print(line)
            repo, branch = read_setting(args.root)
            print(f"{len(problems)} place(s) disagree with https://github.com/{repo} ({branch})")
            return 1 if problems else 0
        for path in set_repo_url(args.url, args.branch, args.root):
            print(f"updated {path.relative_to(args.root)}")
        return 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
