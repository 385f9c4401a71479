"""labkit installed as a wheel (as the labs' first cell does on Colab) carries all of itself."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_every_subpackage_and_the_corpus(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("labkit-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "labkit").rglob("*.py")}
    assert sources <= names, f"missing from the wheel: {sorted(sources - names)}"
    assert "labkit/corpus/shakespeare.txt" in names
