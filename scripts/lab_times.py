"""Execute every lab notebook from the top in a fresh kernel and print how long each takes.

    python scripts/lab_times.py            # all labs
    python scripts/lab_times.py labs/01_memory_wall.ipynb

The notebooks are not modified. Exits non-zero if a lab fails, or if one exceeds --limit
seconds (default 60, the course's target for a lab on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def run(path: Path, timeout: int) -> float:
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labs", nargs="*", type=Path, help="notebooks (default: labs/*.ipynb)")
    parser.add_argument("--limit", type=float, default=60.0, help="seconds a lab may take (default 60)")
    args = parser.parse_args(argv)
    labs = args.labs or sorted((ROOT / "labs").glob("*.ipynb"))
    for lab in labs:
        if not lab.is_file():
            parser.error(f"labs: {lab} is not a notebook file")
    status = 0
    print(f"{'lab':<40} {'seconds':>8}")
    for lab in labs:
        try:
            seconds = run(lab, timeout=int(10 * args.limit))
        except Exception as exc:  # report and go on with the other labs
            print(f"{lab.name:<40} {'FAILED':>8}  {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
            status = 1
            continue
        flag = "" if seconds <= args.limit else f"  over the {args.limit:.0f} s target"
        status |= bool(flag)
        print(f"{lab.name:<40} {seconds:8.1f}{flag}")
    return status


if __name__ == "__main__":
    sys.exit(main())
