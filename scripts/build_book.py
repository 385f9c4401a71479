"""Build the book, in English and in Chinese, as HTML with every Sphinx warning treated as an error.

    python scripts/build_book.py                  # -> _build/html/index.html (+ zh/index.html)
    python scripts/build_book.py --path-output D  # -> D/_build/html/index.html (+ zh/index.html)
    python scripts/build_book.py --source S       # build the book whose _config.yml is in S
    python scripts/build_book.py --edition en     # one edition only (en or zh_CN)

Each edition is Jupyter Book's own build (``jupyter-book build . --all -W -n --keep-going``, run
through ``jupyter_book.sphinx.build_sphinx`` with this interpreter); the Chinese one only sets
Sphinx's ``language`` to ``zh_CN``, so the text comes from the gettext catalogues in
``locales/zh_CN/LC_MESSAGES`` (Sphinx compiles them) and the theme speaks Chinese. The two run
side by side, each in its own process. The Chinese edition is built under ``_build/zh`` and then
moved to ``_build/html/zh``, so one folder serves both; every page links to its twin
(_ext/language_switch.py). Math is typeset by a local MathJax 3 (_ext/local_mathjax.py copies it
into the output), so the book needs no network. The exit status is non-zero if a build fails or
produced any warning.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _editions() -> dict[str, str]:
    """{Sphinx language: folder under the English _build/html}, as the language links expect
    (_ext/language_switch.py, loaded by path: it is the one place that lists the editions)."""
    spec = importlib.util.spec_from_file_location("language_switch",
                                                  ROOT / "_ext" / "language_switch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {e["language"]: e["folder"] for e in module.EDITIONS}


EDITIONS = _editions()


def _sphinx(source: Path, build_dir: Path, language: str) -> int:
    """One edition, as ``jupyter-book build SOURCE --all -W -n --keep-going`` would build it,
    with Sphinx's ``language`` set; HTML into build_dir/html. Returns the exit status."""
    from jupyter_book.sphinx import build_sphinx

    overrides = {"external_toc_path": (source / "_toc.yml").as_posix(),
                 "latex_individualpages": False, "nitpicky": True, "language": language}
    result = build_sphinx(source, build_dir / "html", noconfig=True,
                          path_config=str(source / "_config.yml"), confoverrides=overrides,
                          builder="html", warningiserror=True, keep_going=True, freshenv=True)
    if isinstance(result, BaseException):
        print(f"build failed: {result!r}", file=sys.stderr)
        return 1
    return int(result or 0)


def _start(source: Path, build_dir: Path, language: str, log) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), "_edition", str(source), str(build_dir),
           language]
    return subprocess.Popen(cmd, cwd=source, stdout=log, stderr=subprocess.STDOUT)


def build(source: Path = ROOT, path_output: Path | None = None,
          editions: tuple[str, ...] = tuple(EDITIONS)) -> int:
    """Build the editions side by side, print each one's log, and return the worst exit status."""
    build_dir = (path_output or source).resolve() / "_build"
    staging = {lang: build_dir if not EDITIONS[lang] else build_dir / EDITIONS[lang]
               for lang in editions}
    runs = {}
    with tempfile.TemporaryDirectory() as logs:
        for lang in editions:
            print(f"+ jupyter-book build {source} --all -W -n --keep-going  (language={lang})",
                  flush=True)
            log = open(Path(logs) / f"{lang}.log", "w+", encoding="utf-8")
            runs[lang] = (_start(source, staging[lang], lang, log), log, time.monotonic())
        status = 0
        for lang, (proc, log, start) in runs.items():
            rc = proc.wait()
            seconds = time.monotonic() - start
            log.seek(0)
            print(f"\n===== {lang} edition: exit status {rc}, {seconds:.0f} s =====", flush=True)
            print(log.read(), flush=True)
            log.close()
            status = status or rc
    for lang in editions:  # the other editions go into a folder of the English output
        if EDITIONS[lang] and status == 0:
            final = build_dir / "html" / EDITIONS[lang]
            shutil.rmtree(final, ignore_errors=True)
            final.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(staging[lang] / "html"), str(final))
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_edition"]:  # internal: one edition, in its own process
        return _sphinx(Path(argv[1]), Path(argv[2]), argv[3])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=ROOT,
                        help="folder with _config.yml and _toc.yml (default: the repository root)")
    parser.add_argument("--path-output", type=Path, default=None,
                        help="folder that receives _build/ (default: the source folder)")
    parser.add_argument("--edition", choices=sorted(EDITIONS), action="append",
                        help="build only this edition (repeatable; default: all of them)")
    args = parser.parse_args(argv)
    source = args.source.resolve()
    editions = tuple(args.edition or EDITIONS)
    rc = build(source, args.path_output, editions)
    html = (args.path_output.resolve() if args.path_output else source) / "_build" / "html"
    if rc != 0:
        print(f"\nBook build FAILED (exit status {rc}): see the warnings above.", file=sys.stderr)
        return rc
    for lang in editions:
        out = html / EDITIONS[lang]
        if not (out / "_static" / "mathjax" / "tex-mml-chtml.js").is_file():
            print(f"\nBook build FAILED: no local MathJax in {out / '_static'}.", file=sys.stderr)
            return 1
    print(f"\nBook built. Open {html / 'index.html'} in a browser"
          + (f" (Chinese: {html / 'zh' / 'index.html'})." if "zh_CN" in editions else "."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
