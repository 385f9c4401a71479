"""The grading kernels forked from a warm process (tests/warm_kernels.py) behave as kernels
Jupyter starts: they run in the folder and environment they were started with, an interrupt
interrupts, a shutdown ends them, a kill leaves nothing, and a kernel whose Jupyter dies ends.
A kernel asked for with other values of a variable torch reads when imported is a real one.
A script run forked from the grader server runs as ``python SCRIPT ARGS`` would, and one asked
for with other Python variables (PYTHONPATH) is run by a fresh interpreter."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import shutil
import textwrap
import time
from pathlib import Path

import pytest
from jupyter_client import KernelManager

from labkit.busy import timeout_scale

ROOT = Path(__file__).resolve().parents[1]
RUN = 60 * timeout_scale()  # seconds any step below may take on a slow machine


@pytest.fixture
def warm_kernels(warm_kernels):
    if warm_kernels is None:
        pytest.skip("kernels are forked only where os.pidfd_open exists (Linux 5.3 or later)")
    return warm_kernels


def _run(kc, code):
    """Execute ``code``; return (reply status, exception name, printed text)."""
    printed = []
    reply = kc.execute_interactive(code, timeout=RUN, output_hook=lambda m: printed.append(
        m["content"].get("text", "")) if m["msg_type"] == "stream" else None)
    return reply["content"]["status"], reply["content"].get("ename"), "".join(printed)


@contextlib.contextmanager
def _kernel(cwd, **start):
    """A python3 kernel started in ``cwd`` and ready: (manager, client); killed if still there."""
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(cwd), **start)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=RUN)
        yield km, kc
    finally:
        kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)


def _is_from(msg, msg_id) -> bool:
    return msg["parent_header"].get("msg_id") == msg_id


def _pid_of_kernel(kc) -> int:
    return int(_run(kc, "import os; print(os.getpid())")[2])


def _gone(pid) -> bool:
    deadline = time.monotonic() + RUN
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.usefixtures("warm_kernels")
def test_a_forked_kernel_runs_interrupts_and_ends_like_a_started_one(tmp_path, monkeypatch):
    monkeypatch.setenv("WARM_KERNEL_PROBE", "from the client")
    # nbclient (nbconvert, otter) adds an argument to the kernel's command
    with _kernel(tmp_path, extra_arguments=["--HistoryManager.hist_file=:memory:"]) as (km, kc):
        assert km.kernel_spec.display_name == "Python 3 (forked)"
        status, _, printed = _run(kc, "import os, sys\nprint('torch' in sys.modules, os.getcwd(), "
                                      "os.environ['WARM_KERNEL_PROBE'], "
                                      "get_ipython().history_manager.hist_file, sys.path[0], sep='|')")
        # sys.path[0]: the kernel's folder, as `python -m ipykernel_launcher` has it (a notebook
        # imports a module beside it), not the server's (tests/)
        assert (status, printed) == ("ok", f"True|{tmp_path}|from the client|:memory:|{tmp_path}\n"), printed
        pid = _pid_of_kernel(kc)
        assert pid != km.provisioner.pid  # forked by the server, not the process Jupyter started
        # Interrupted once the cell runs: ipykernel, a fresh kernel's too, mishandles a SIGINT
        # that lands while it sets a cell up (no reply at all), and a busy machine can take
        # longer than any sleep to get there. stop_on_error=False: after an error ipykernel
        # aborts the requests that reach it before it stops aborting, which on a busy machine
        # can be the next one sent (status "aborted", nothing printed).
        msg_id = kc.execute("print('looping')\nwhile True:\n    pass", stop_on_error=False)
        while not (_is_from(msg := kc.get_iopub_msg(timeout=RUN), msg_id)
                   and msg["msg_type"] == "stream"):
            pass
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=RUN)
        while not _is_from(reply, msg_id):
            reply = kc.get_shell_msg(timeout=RUN)
        assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
        assert _run(kc, "print(6 * 7)") == ("ok", None, "42\n")  # still there after the interrupt
        km.shutdown_kernel(now=False)
        assert _gone(pid) and not km.is_alive()


@pytest.mark.usefixtures("warm_kernels")
def test_a_killed_client_or_a_dead_jupyter_ends_the_kernel(tmp_path):
    with _kernel(tmp_path) as (km, kc):
        pid = _pid_of_kernel(kc)
        km.shutdown_kernel(now=True)  # SIGKILL to the client Jupyter started
        assert _gone(pid), "the forked kernel outlived its killed client"
    # Jupyter itself dies (a grading stopped hard): its kernel goes too
    script = textwrap.dedent(f"""
        import os, sys
        from jupyter_client import KernelManager
        km = KernelManager(kernel_name="python3")
        km.start_kernel(cwd={str(tmp_path)!r})
        kc = km.client(); kc.start_channels(); kc.wait_for_ready(timeout={RUN})
        reply = kc.execute_interactive("import os; print(os.getpid())", timeout={RUN},
                                       output_hook=lambda m: print(m["content"].get("text", ""), end="", flush=True))
        os.kill(os.getpid(), 9)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=2 * RUN)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert _gone(int(proc.stdout.strip())), "the forked kernel outlived the Jupyter that started it"


@pytest.mark.usefixtures("warm_kernels")
def test_other_import_time_settings_get_a_real_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", str(int(os.environ.get("OMP_NUM_THREADS") or 1) + 1))
    with _kernel(tmp_path) as (km, kc):
        assert _pid_of_kernel(kc) == km.provisioner.pid  # exec'd in place of the client
        assert _run(kc, "import sys; print('torch' in sys.modules)")[2] == "False\n"


def test_the_server_ends_with_the_process_that_started_it(tmp_path):
    """A pytest worker killed hard, even at once, leaves no server behind."""
    if not hasattr(os, "pidfd_open"):
        pytest.skip("the server runs only where os.pidfd_open exists (Linux 5.3 or later)")
    import warm_kernels

    starter = textwrap.dedent(f"""
        import subprocess, sys, time
        server = subprocess.Popen([sys.executable, {warm_kernels.__file__!r}, "serve",
                                   {str(tmp_path / "server")!r}], stdout=subprocess.PIPE, text=True)
        print(server.pid, server.stdout.readline().strip(), flush=True)
        time.sleep({2 * RUN})
    """)
    proc = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    try:
        pid, said = proc.stdout.readline().split()
        assert said == "ready"
    finally:
        proc.kill()
        proc.wait()
    assert _gone(int(pid)), "the kernel server outlived the process that started it"


PROBE = textwrap.dedent("""
    import os, sys
    print(__name__, sys.argv[1:], os.getcwd(), os.environ["WARM_RUN_PROBE"], sys.path[0],
          "otter.cli" in sys.modules, sep="|")
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
""")


def _warm_run(grader, script, *args, cwd, env=None):
    return subprocess.run([*shlex.split(grader), str(script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=RUN)


def test_a_forked_script_runs_as_python_runs_it_and_other_python_settings_get_a_fresh_one(
        tmp_path, warm_grader_server):
    if warm_grader_server is None:
        pytest.skip("scripts are forked only where os.pidfd_open exists (Linux 5.3 or later)")
    script = tmp_path / "folder" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    env = dict(os.environ, WARM_RUN_PROBE="from the client")
    proc = _warm_run(warm_grader_server, script, "3", "two words", cwd=tmp_path, env=env)
    assert proc.returncode == 3, proc.stderr
    # forked from the server, which imported otter: the rest is as `python probe.py ...` has it
    expected = f"__main__|['3', 'two words']|{tmp_path}|from the client|{script.parent}|"
    assert proc.stdout == expected + "True\n" and proc.stderr == "to stderr\n", proc
    fresh = subprocess.run([sys.executable, str(script), "3", "two words"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=RUN)
    assert (fresh.returncode, fresh.stdout, fresh.stderr) == (3, expected + "False\n", "to stderr\n")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    other = _warm_run(warm_grader_server, script, "0", "x", cwd=tmp_path, env=env)
    assert other.returncode == 0 and other.stdout.endswith("|False\n"), other  # a fresh interpreter


ENDINGS = textwrap.dedent("""
    import atexit, sys
    atexit.register(print, "exit handler ran")
    how = sys.argv[1]
    if how == "none":
        sys.exit()
    if how == "message":
        sys.exit("a message")
    raise ValueError("uncaught")
""")


@pytest.mark.parametrize("how", ["none", "message", "raise"])
def test_a_forked_script_ends_as_python_ends_it(tmp_path, warm_grader_server, how):
    """sys.exit() is status 0, sys.exit("a message") prints it and is 1, an uncaught error prints
    its traceback and is 1; the script's exit handlers run in each case."""
    if warm_grader_server is None:
        pytest.skip("scripts are forked only where os.pidfd_open exists (Linux 5.3 or later)")
    script = tmp_path / "ending.py"
    script.write_text(ENDINGS)
    forked = _warm_run(warm_grader_server, script, how, cwd=tmp_path)
    fresh = subprocess.run([sys.executable, str(script), how], cwd=tmp_path, capture_output=True,
                           text=True, timeout=RUN)
    assert forked.stdout == fresh.stdout == "exit handler ran\n", (forked, fresh)
    assert forked.returncode == fresh.returncode == (0 if how == "none" else 1), (forked, fresh)
    last = {"none": "", "message": "a message", "raise": "ValueError: uncaught"}[how]
    assert forked.stderr.strip().splitlines()[-1:] == fresh.stderr.strip().splitlines()[-1:] \
        == ([last] if last else []), (forked.stderr, fresh.stderr)


def test_a_killed_client_ends_its_forked_script(tmp_path, warm_grader_server):
    if warm_grader_server is None:
        pytest.skip("scripts are forked only where os.pidfd_open exists (Linux 5.3 or later)")
    script = tmp_path / "sleeper.py"
    script.write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([*shlex.split(warm_grader_server), str(script)], cwd=tmp_path,
                            stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        assert pid != proc.pid  # forked by the server
    finally:
        proc.kill()
        proc.wait()
    assert _gone(pid), "the forked script outlived its killed client"


LAUNCH = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(ROOT / "tests")!r})
    from labkit.dist import launch
    from dist_workers import fork_server_command
    if __name__ == "__main__":
        for rank, command, session in launch(fork_server_command, 2, backend="gloo"):
            print(rank, "forked" if "warm_kernels.py serve" in command else
                  "fresh" if "multiprocessing.forkserver import main" in command else command, session)
""")


def test_a_fork_server_is_forked_from_the_torch_server_and_other_settings_get_a_fresh_one(tmp_path):
    """Under LABKIT_FORK_SERVER_PYTHON (warm_kernels.fork_server_knob), labkit.dist's fork server
    is forked from the torch server and its ranks run, in the session of the process that started
    the server (Linux schedules a session as a group); a launch under another value of a variable
    torch reads when imported, or from a folder holding another labkit, gets a fresh one."""
    import warm_kernels
    from labkit.fork_server import KNOB

    knob = warm_kernels.fork_server_knob()
    if knob is None:
        pytest.skip("fork servers are forked only where os.pidfd_open exists (Linux 5.3 or later)")
    env = dict(os.environ, **{KNOB: knob})

    script = tmp_path / "launch.py"
    script.write_text(LAUNCH)

    def ranks(env):  # the launching script itself forked from the torch server where it can be
        proc = subprocess.run([*warm_kernels.python_command("torch", env), str(script)], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=RUN)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    session = str(os.getsid(0))  # the torch server's, and so its fork servers' and their ranks'
    assert ranks(env) == ["0", "forked", session, "1", "forked", session]
    other = "avx2" if os.environ.get("ATEN_CPU_CAPABILITY") == "default" else "default"
    assert ranks(dict(env, ATEN_CPU_CAPABILITY=other))[1::3] == ["fresh", "fresh"]
    shadow = tmp_path / "labkit"  # what a fresh `python -c` in this folder would import
    shutil.copytree(ROOT / "labkit", shadow, ignore=shutil.ignore_patterns("__pycache__"))
    assert ranks(env)[1::3] == ["fresh", "fresh"]


def test_only_a_fork_server_command_is_forked():
    import warm_kernels

    code = "from multiprocessing.forkserver import main; main(7, 9, ['torch'], **{'sys_path': ['/x']})"
    assert warm_kernels._fork_server_call(["-B", "-c", code]) == (7, 9, ["torch"], {"sys_path": ["/x"]})
    assert warm_kernels._fork_server_call(["-c", code.replace(", **{'sys_path': ['/x']}", "")]) == (
        7, 9, ["torch"], {})
    for args in (["-I", "-c", code], ["-c", "print(1)"], ["script.py"], [],
                 ["-c", code.replace("main(7", "main(x")], ["-c", code.replace("forkserver", "spawn")]):
        assert warm_kernels._fork_server_call(args) is None, args
