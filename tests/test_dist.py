"""The launcher and the communication counter, on real gloo processes."""

import os
import sys
import time
import types

import multiprocessing

import pytest
import torch

import dist_workers
from warm_kernels import python_command
from labkit.dist import CommCounter, DistributedError, launch, rendezvous_store
from labkit import dist as dist_mod


def _alive(pids):
    """The pids that still run (a zombie or a missing /proc entry counts as gone)."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def test_collectives_are_correct_and_counted():
    world = 3
    results = launch(dist_workers.collectives, world)
    for rank, res in enumerate(results):
        assert res["sum"] == [6.0] * 6  # 1 + 2 + 3
        assert res["gathered"] == [float(r) for r in range(world) for _ in range(6)]
        assert res["shard"] == [3.0] * 3
        assert res["bcast"] == [0.0] * 4
        s = res["stats"]
        assert s["all_reduce"] == {"calls": 1, "bytes": 24, "numel": 6}
        assert s["all_gather"] == {"calls": 1, "bytes": 4 * 6 * world, "numel": 6 * world}  # the gathered size
        assert s["reduce_scatter"] == {"calls": 1, "bytes": 4 * 3 * world, "numel": 3 * world}  # the input size
        assert s["broadcast"] == {"calls": 1, "bytes": 16, "numel": 4}
        expected_p2p = {0: "send", 1: "recv"}.get(rank)
        for kind in ("send", "recv"):
            assert (kind in s) == (kind == expected_p2p)
        if expected_p2p:
            assert s[expected_p2p] == {"calls": 1, "bytes": 20, "numel": 5}
    assert not _alive([r["pid"] for r in results])


def test_counter_sees_the_all_reduce_ddp_issues_from_cpp():
    stats = launch(dist_workers.ddp_step, 2)
    for s in stats:
        # one bucket holds weight (32) and bias (4): one all-reduce of 36 fp32 elements
        assert s == {"all_reduce": {"calls": 1, "bytes": 36 * 4, "numel": 36}}


def test_a_failing_rank_raises_in_the_parent_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"(?s)rank 1 of 2 raised.*ValueError: rank one was given a bad shard"):
        launch(dist_workers.fails_on_rank_one, 2, timeout_s=20)
    assert time.monotonic() - start < 30


def test_a_hung_collective_times_out_with_a_clear_error_and_leaves_no_process():
    before = {p.pid for p in multiprocessing.active_children()}
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"(?s)rank 0 of 2 raised.*[Tt]imed out"):
        launch(dist_workers.hangs_on_rank_one, 2, timeout_s=3)
    assert time.monotonic() - start < 30
    time.sleep(0.5)
    after = {p.pid for p in multiprocessing.active_children()} - before
    assert not _alive(after)


def test_results_come_back_in_rank_order_with_arguments():
    out = launch(dist_workers.rank_and_pid, 2, 10)
    assert [r for r, _ in out] == [10, 11]
    assert len({pid for _, pid in out}) == 2 and os.getpid() not in {pid for _, pid in out}


def test_world_size_one_and_bad_world_size():
    assert launch(dist_workers.rank_and_pid, 1)[0][0] == 0
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="world_size"):
            launch(dist_workers.rank_and_pid, bad)
    with pytest.raises(ValueError, match="backend='mpi'"):
        launch(dist_workers.rank_and_pid, 2, backend="mpi")


def test_under_torchrun_environment_runs_in_process(monkeypatch):
    store = rendezvous_store()  # as torchrun's agent holds it: rank 0 joins it as a client
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    try:
        assert launch(dist_workers.rank_and_pid, 1) == [(0, os.getpid())]
        with pytest.raises(ValueError, match="WORLD_SIZE=1"):
            launch(dist_workers.rank_and_pid, 2)
    finally:
        torch.distributed.destroy_process_group()


def test_counter_agrees_with_torchs_comm_debug_mode():
    # torch's CommDebugMode (torch.distributed.tensor.debug) counts the same dispatcher ops with
    # code of its own; its op names are mapped to our kinds here, not through labkit's table
    kind_of = {"allreduce": "all_reduce", "allgather": "all_gather", "reduce_scatter": "reduce_scatter",
               "broadcast": "broadcast"}
    for r in launch(dist_workers.counted_by_both, 2):
        theirs = {}
        for op, n in r["theirs"].items():
            kind = next(k for key, k in kind_of.items() if key in op)
            theirs[kind] = theirs.get(kind, 0) + n
        assert r["ours"] == theirs and sum(theirs.values()) == r["theirs_total"]
        # all-reduce: 1 + DDP's one bucket; all-gather: 1 + 2 units in forward + 1 in backward (the
        # first layer's weight is not saved: its input needs no gradient); reduce-scatter: 1 + 2 units
        assert r["ours"] == {"all_reduce": 2, "all_gather": 4, "reduce_scatter": 3, "broadcast": 1}, r["ours"]


def test_launch_refuses_what_spawned_ranks_cannot_import():
    def nested(rank, world_size):
        return rank

    for fn, pattern in ((lambda rank, world_size: rank, "lambda or a nested function"),
                        (nested, "lambda or a nested function")):
        with pytest.raises(ValueError, match=pattern):
            launch(fn, 2)
    main_fn = types.FunctionType(dist_workers.rank_and_pid.__code__, {}, "in_a_notebook")
    main_fn.__module__ = "__main__"  # what a function defined in a notebook cell looks like
    with pytest.raises(ValueError, match=r"fn=in_a_notebook is defined in __main__ \(a notebook cell"):
        launch(main_fn, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_nccl_without_cuda_says_so():
    with pytest.raises(ValueError, match=r"backend='nccl' needs CUDA GPUs and none is available"):
        launch(dist_workers.rank_and_pid, 2, backend="nccl")


def test_nccl_with_fewer_gpus_than_ranks_is_refused_and_the_default_is_gloo(monkeypatch):
    """NCCL refuses two ranks on one GPU (on a 1-GPU Colab, say), so launch() does not try."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"world_size=2 needs 2 CUDA GPUs and 1 are visible"):
        launch(dist_workers.rank_and_pid, 2, backend="nccl")
    assert dist_mod._default_backend(2) == "gloo" and dist_mod._default_backend(1) == "nccl"


def test_counter_counts_nothing_without_collectives():
    with CommCounter() as comm:
        torch.ones(3).sum()
    assert comm.stats.as_dict() == {} and comm.log == []


def test_ranks_can_return_tensors():
    out = launch(dist_workers.returns_tensors, 2)
    assert [r["t"].tolist() for r in out] == [[0.0] * 3, [1.0] * 3]
    assert out[1]["nested"][0].tolist() == [0, 1]


def test_concurrent_launches_never_lose_their_port(tmp_path):
    """Four processes make two two-rank launches each, all at once, while a fifth binds and
    releases ports in a loop: every launch succeeds. The launcher's store holds its port
    from before the number is known until the ranks are gone, so nothing can take it."""
    import subprocess
    import sys
    from pathlib import Path
    tests = Path(__file__).resolve().parent
    churn = ("import socket, time\nend = time.monotonic() + 120\n"  # bounded, if never killed
             "while time.monotonic() < end:\n"
             "    s = socket.socket(); s.bind(('127.0.0.1', 0)); s.close(); time.sleep(0.001)\n")
    launcher = tmp_path / "launcher.py"
    launcher.write_text(f"import sys\nsys.path.insert(0, {str(tests)!r})\nimport dist_workers\n"
                        "if __name__ == '__main__':\n    print(dist_workers.launches_in_a_row(2))\n")
    # each launcher forked from a process that imported torch and labkit (tests/warm_kernels.py),
    # and each launcher's ranks' server forked from it too (LABKIT_FORK_SERVER_PYTHON, conftest.py);
    # every launch still holds its own store, whose port is the point here
    env = dict(os.environ)  # the worker's own, as its torch server's: another PYTHONPATH runs fresh
    python = python_command("torch", env)
    churner = subprocess.Popen([sys.executable, "-c", churn])
    try:
        procs = [subprocess.Popen([*python, str(launcher)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for _ in range(4)]
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        churner.kill()
        churner.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.strip() == "[1, 1]", err[-3000:]


def test_no_code_picks_a_port_and_releases_it():
    """A port found free, closed and handed on can be taken before it is bound again: nothing in
    the course does that (labkit, tests, labs, scripts, exercises)."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    offenders = []
    for folder in ("labkit", "tests", "labs", "scripts", "exercises"):
        for path in (root / folder).rglob("*"):
            if path.suffix in (".py", ".ipynb") and path.resolve() != Path(__file__).resolve():
                text = path.read_text(encoding="utf-8", errors="replace")
                if "getsockname" in text or "free_port(" in text:
                    offenders.append(str(path.relative_to(root)))
    assert not offenders, f"a port picked and released before use in: {offenders}"


def test_a_busy_machine_is_named_with_the_knob_and_the_scale_is_checked(monkeypatch):
    from labkit.busy import busy_note, timeout_scale
    note = busy_note(load=5.0, cores=2)
    assert "load 5.0 on 2 cores" in note and "LABKIT_TIMEOUT_SCALE" in note
    assert busy_note(load=1.5, cores=2) == ""  # not busy: nothing to say
    for bad in ("0", "-1", "abc", "inf", "nan"):
        monkeypatch.setenv("LABKIT_TIMEOUT_SCALE", bad)
        with pytest.raises(ValueError, match="LABKIT_TIMEOUT_SCALE"):
            timeout_scale()
    monkeypatch.setenv("LABKIT_TIMEOUT_SCALE", "2.5")
    assert timeout_scale() == 2.5


def test_ranks_that_cannot_connect_are_started_again_then_reported(monkeypatch):
    """A failure to connect (here every time: gloo is told to use a network interface that does
    not exist) happens before any rank runs ``fn``, so the launch starts again, up to 3 times,
    then says so; a rank's own error is never retried (test above: reported at once)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-interface0")
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"(?s)could not connect to each other in 3 tries.*no-such-interface0"):
        launch(dist_workers.rank_and_pid, 2, timeout_s=20)
    assert time.monotonic() - start < 60


def test_the_fork_server_knob_is_read_as_documented(tmp_path):
    """LABKIT_FORK_SERVER_PYTHON=<interpreter><os.pathsep><executable> (labkit/fork_server.py):
    empty is unset, another interpreter's is not this process's, and a malformed value or one
    naming no executable is refused by name."""
    from labkit.fork_server import fork_server_executable

    exe = tmp_path / "stands-for-python"
    exe.write_text("#!/bin/sh\nexec python3 \"$@\"\n")
    exe.chmod(0o755)
    assert fork_server_executable("") is None
    assert fork_server_executable(f"{sys.executable}{os.pathsep}{exe}") == str(exe)
    assert fork_server_executable(f"{tmp_path / 'other' / 'python'}{os.pathsep}{exe}") is None
    for bad, what in [(str(exe), "must be <interpreter>"), (f"{sys.executable}{os.pathsep}", "must be"),
                      (f"{sys.executable}{os.pathsep}{tmp_path / 'missing'}", "not an executable"),
                      (f"{sys.executable}{os.pathsep}{tmp_path}", "not an executable")]:
        with pytest.raises(ValueError, match="LABKIT_FORK_SERVER_PYTHON") as err:
            fork_server_executable(bad)
        assert what in str(err.value), bad
