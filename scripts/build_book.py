"""Build the book as HTML with every Sphinx warning treated as an error.

    python scripts/build_book.py                  # -> _build/html/index.html
    python scripts/build_book.py --path-output D  # -> D/_build/html/index.html
    python scripts/build_book.py --source S       # build the book whose _config.yml is in S

Runs ``jupyter-book build . --all -W -n --keep-going`` with this interpreter. Math is typeset
by a local MathJax 3 (_ext/local_mathjax.py copies it into the output), so the book needs no
network. The exit status is non-zero if the build fails or produced any warning.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build(source: Path = ROOT, path_output: Path | None = None) -> int:
    """Run jupyter-book with warnings as errors and return its exit status."""
    # --all rebuilds every page, so warnings of unchanged pages are reported again.
    args = ["build", str(source), "--all", "-W", "-n", "--keep-going"]
    if path_output is not None:
        args += ["--path-output", str(path_output)]
    print("+ jupyter-book", " ".join(args), flush=True)
    cmd = [sys.executable, "-c", "from jupyter_book.cli.main import main; main()", *args]
    return subprocess.run(cmd, cwd=source).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=ROOT,
                        help="folder with _config.yml and _toc.yml (default: the repository root)")
    parser.add_argument("--path-output", type=Path, default=None,
                        help="folder that receives _build/ (default: the source folder)")
    args = parser.parse_args(argv)
    source = args.source.resolve()
    rc = build(source, args.path_output)
    html = (args.path_output.resolve() if args.path_output else source) / "_build" / "html"
    if rc != 0:
        print(f"\nBook build FAILED (exit status {rc}): see the warnings above.", file=sys.stderr)
        return rc
    if not (html / "_static" / "mathjax" / "tex-mml-chtml.js").is_file():
        print(f"\nBook build FAILED: no local MathJax in {html / '_static'}.", file=sys.stderr)
        return 1
    print(f"\nBook built. Open {html / 'index.html'} in a browser.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
