"""The labs' kernels under nbval (tests/nbval_kernel.py): Unix sockets, one more start on a busy
machine, and a failure that says why."""

from __future__ import annotations

import json
import os
import sys
from queue import Empty

import nbval.plugin
import pytest

import nbval_kernel
import warm_kernels
from labkit.busy import timeout_scale
from labkit.fork_server import KNOB
from nbval_kernel import PatientKernel

BUSY = "this machine is busy (load 9.0 on 2 cores), ... LABKIT_TIMEOUT_SCALE=4"


def test_nbval_starts_the_labs_kernels_this_way():
    assert nbval.plugin.RunningKernel is PatientKernel


def test_a_lab_kernel_runs_over_unix_sockets_and_leaves_nothing(tmp_path):
    kernel = PatientKernel("python3", cwd=str(tmp_path))
    try:
        # forked from this worker's kernel server where one runs (tests/warm_kernels.py)
        forked = warm_kernels.server("kernel") is not None
        assert (kernel.km.kernel_spec.display_name == "Python 3 (forked)") == forked
        info = kernel.km.get_connection_info()
        assert info["transport"] == "ipc", info
        sockets = kernel._sockets
        assert info["ip"].startswith(sockets)
        assert sorted(os.listdir(sockets)), "no socket files in the kernel's own folder"
        # its environment is this one, LABKIT_FORK_SERVER_PYTHON included (its ranks' fork server
        # forked from this worker's torch server)
        code = f"import os; print(6 * 7, os.getcwd(), os.environ.get({KNOB!r}) == {os.environ.get(KNOB)!r})"
        msg_id = kernel.execute_cell_input(code, allow_stdin=False)
        kernel.await_reply(msg_id, timeout=60 * timeout_scale())
        printed = ""
        while True:
            try:
                msg = kernel.get_message(stream="iopub", timeout=10 * timeout_scale())
            except Empty:
                break
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                printed += msg["content"]["text"]
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        assert printed == f"42 {tmp_path} True\n", printed
    finally:
        kernel.stop()
    assert not os.path.exists(sockets), "the kernel's socket folder was left behind"


def _kernel_spec(tmp_path, monkeypatch, code):
    """A kernel named 'broken' whose process runs ``code`` instead of a kernel."""
    spec = tmp_path / "jupyter" / "kernels" / "broken"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-c", code, "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "broken",
                                                  "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))


DIES = ("import sys; open({log!r}, 'a').write('started\\n'); "
        "sys.stderr.write('no kernel here\\n'); sys.exit(3)")


@pytest.mark.parametrize("busy", ["", BUSY], ids=["idle", "busy"])
def test_a_kernel_that_dies_is_started_again_only_on_a_busy_machine(tmp_path, monkeypatch, busy):
    log = tmp_path / "starts.log"
    _kernel_spec(tmp_path, monkeypatch, DIES.format(log=str(log)))
    monkeypatch.setattr(nbval_kernel, "busy_note", lambda: busy)
    with pytest.raises(RuntimeError) as raised:
        PatientKernel("broken", cwd=str(tmp_path), startup_timeout=60)
    message = str(raised.value)
    assert f"the lab's Jupyter kernel 'broken', given {60 * timeout_scale():g} s to start, did not" \
        in message, message
    assert "died" in message and "no kernel here" in message, message
    starts = log.read_text().count("started")
    if busy:
        assert starts == 2 and "twice" in message and BUSY in message, (starts, message)
    else:
        assert starts == 1 and "the machine is not busy" in message, (starts, message)


def test_a_kernel_that_does_not_answer_says_how_long_it_was_given(tmp_path, monkeypatch):
    _kernel_spec(tmp_path, monkeypatch, "import time; time.sleep(120)")
    monkeypatch.setattr(nbval_kernel, "busy_note", lambda: "")
    with pytest.raises(RuntimeError) as raised:
        PatientKernel("broken", cwd=str(tmp_path), startup_timeout=0.5)
    message = str(raised.value)
    assert f"given {0.5 * timeout_scale():g} s to start, did not" in message, message
    assert "didn't respond" in message, message
    assert "the machine is not busy" in message, message


def test_a_cells_wait_for_its_outputs_doubles_on_a_busy_machine(monkeypatch):
    monkeypatch.setattr(nbval_kernel, "busy_note", lambda: "")
    assert nbval_kernel.output_seconds() == 5 * timeout_scale()
    monkeypatch.setattr(nbval_kernel, "busy_note", lambda: BUSY)
    assert nbval_kernel.output_seconds() == 10 * timeout_scale()
