"""labkit.parallel.ParallelDims: the degrees, the rank grid and its agreement with torch's DeviceMesh."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.parallel import AXES, ParallelDims

ROOT = Path(__file__).resolve().parents[1]


def test_importing_parallel_dims_leaves_torch_out():
    code = ("import sys\nfrom labkit.parallel import ParallelDims\nParallelDims(2, 2, 2).coords(5)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_world_size_and_the_grid_puts_tensor_innermost_and_data_outermost():
    dims = ParallelDims(dp_size=2, tp_size=2, pp_size=2)
    assert dims.world_size == 8 and dims.sizes == (2, 2, 1, 2) and AXES == ("dp", "pp", "cp", "tp")
    coords = [tuple(dims.coords(r)) for r in range(8)]
    assert coords[:4] == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (0, 1, 0, 1)]  # a stage's tp ranks adjacent
    assert coords[4] == (1, 0, 0, 0)  # the second replica starts after t p ranks
    assert sorted(coords) == coords and len(set(coords)) == 8
    assert dims.coords(6).pp == 1 and dims.coords(6).dp == 1 and dims.coords(6).tp == 0
    assert all(dims.rank_of(**dims.coords(r)._asdict()) == r for r in range(8))
    assert ParallelDims(cp_size=3, tp_size=2).coords(5) == (0, 0, 2, 1)


def test_the_grid_matches_torchs_device_mesh():
    # the same row-major layout as init_device_mesh's, without starting processes: DeviceMesh
    # lays ranks out as torch.arange(world).view(sizes)
    import torch

    dims = ParallelDims(dp_size=2, tp_size=3, pp_size=2, cp_size=2)
    grid = torch.arange(dims.world_size).view(dims.sizes)
    for r in range(dims.world_size):
        assert grid[tuple(dims.coords(r))].item() == r


@pytest.mark.parametrize("kwargs, match", [
    ({"dp_size": 0}, "dp_size=0"),
    ({"tp_size": -2}, "tp_size=-2"),
    ({"pp_size": True}, "pp_size=True"),
    ({"cp_size": 1.0}, "cp_size=1.0"),
    ({"tp_size": "2"}, "tp_size='2'"),
])
def test_bad_degrees_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs)


def test_bad_ranks_and_world_sizes_name_the_argument():
    dims = ParallelDims(dp_size=2, tp_size=2)
    with pytest.raises(ValueError, match="rank=4"):
        dims.coords(4)
    with pytest.raises(ValueError, match="rank=True"):
        dims.coords(True)
    with pytest.raises(ValueError, match=r"world_size=8: the degrees' product"):
        dims.check_world_size(8)
    with pytest.raises(ValueError, match="unknown mesh axes"):
        dims.rank_of(ep=1)
    with pytest.raises(ValueError, match="cp_size=2"):
        ParallelDims(cp_size=2).require_no_cp("the pipeline")
    with pytest.raises(AttributeError):
        dims.dp_size = 4  # frozen: a run's degrees do not change under it
