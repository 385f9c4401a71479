"""Kernels and scripts forked from a process that imported what they import.

A grading starts a fresh Jupyter kernel, which imports ipykernel, torch and labkit before the
notebook's first cell: about 2.7 CPU-seconds of a grading's 6, some thirty gradings a run
(scripts/results/suite_times.md). Here a server imports them once (``serve SOCKET kernel``) and
forks a kernel for each start, which then runs the notebook, otter's cells included, as a fresh
kernel does. :func:`kernelspec_folder` writes a ``python3`` kernelspec whose command is this
file's ``kernel`` client, which jupyter_client starts and manages as the kernel: the client hands
the server the connection file, its folder, environment and standard streams, and stands for the
forked kernel. It passes signals on (SIGINT is an interrupt) and ends with the kernel's exit
status; a kernel whose client is killed ends at once (a watch on the client). A JUPYTER_PATH
naming that folder makes otter's kernels these (tests/test_exercises.py's ``warm_kernels``
fixture, for the gradings that test what a kernel computes; those that test how a kernel is
started or stopped keep real ones), and tests/nbval_kernel.py makes the labs' kernels these.

Scripts the same way (``run SOCKET SCRIPT ARGS``): ``serve SOCKET grader`` imports otter and
nbconvert for scripts/exercises.py's steps (``_otter-run``, ``_otter-assign``: 1.1 of their 1.5
CPU-seconds), which EXERCISES_PYTHON naming the client makes it start; ``serve SOCKET torch``
imports torch and labkit for the suite's scripts that need a process of their own (the engines'
parsers, under .venv-engines' interpreter; one rank under fake tensors; concurrent launchers).
A forked script runs as ``python SCRIPT ARGS`` would: as __main__, in the client's folder,
environment and streams, its exit status the client's.

labkit.dist's fork server too (``forkserver SOCKET [-B] -c CODE``): the torch server also imports
what it preloads (labkit.dist._PRELOAD), and :func:`fork_server_knob` writes an executable that
stands for the interpreter when multiprocessing starts the fork server (LABKIT_FORK_SERVER_PYTHON,
labkit/fork_server.py): it hands the server the fork server's listener and "alive" pipe, and the
server forks a child that runs the fork server's loop with them, as ``python -c CODE`` would, in
the server's session (the torch server's is its parent's). The root conftest.py sets it for the
processes the suite starts, the labs' kernels included. A fork server from a folder holding another copy
of a package the server imported (what ``python -c`` there would import) is fresh.

A request the server cannot serve as a fresh process would be is run by a fresh one: a variable
torch reads when imported (ATEN_CPU_CAPABILITY, ...) or, for a script, a Python variable
(PYTHONPATH, ...) other than the server's, or no server answering.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import signal
import socket
import sys

# What a server imports once, by kind. "kernel": what a kernel imports before its first cell
# (ipykernel) and what every grading imports (torch, labkit). Not otter: it imports doctest, whose
# debugger class then predates IPython's shell, and every check fails ("'_OutputRedirectingPdb'
# object has no attribute 'set_colors'"). Not matplotlib: it reads its backend (ipykernel's, set
# by the kernel) when imported, and matplotlib_inline hooks figures into the shell that exists
# when it is imported. A kernel imports them itself, after its shell is up, as a kernel Jupyter
# starts does. "grader": what scripts/exercises.py's steps import (otter's command line, its
# grading preprocessor and runner, otter assign, nbconvert's executor; no kernel runs in them).
# "torch": what the suite's other scripts import, under the interpreter they run with.
PRELOADS = {"kernel": ["ipykernel.kernelapp", "ipykernel.ipkernel", "ipykernel.zmqshell", "torch", "numpy",
                       "labkit"],
            "grader": ["otter.cli", "otter.assign", "otter.execute.preprocessor",
                       "otter.run.run_autograder.runners.python_runner", "nbconvert.preprocessors",
                       "nbformat"],
            "torch": ["torch", "torch.distributed", "labkit", "labkit.dist"]}
# and, for "torch", what labkit.dist's fork server preloads (labkit.dist._PRELOAD): a fork server
# forked from it (this file's forkserver client) starts with everything imported


def _start_env(env: dict, kind: str) -> dict:
    """What must be equal for a forked process to start as a fresh one would: for a script, the
    interpreter's own variables (PYTHONPATH, ...); where the server imported torch, the variables
    torch (or what it loads) reads at import, as labkit.dist's fork server compares them."""
    same = {k: v for k, v in env.items() if k.startswith("PYTHON")} if kind != "kernel" else {}
    if "torch" in PRELOADS[kind]:
        from labkit.dist import _IMPORT_TIME_ENV

        same.update({k: env.get(k) for k in _IMPORT_TIME_ENV})
    return same


_servers = {}  # (kind, interpreter) -> what server() returned: this process's servers
_fork_servers = {}  # interpreter -> the executable that forks a fork server from its torch server


def server(kind: str, python: str = sys.executable, env: dict | None = None) -> str | None:
    """This process's server of ``kind`` run by ``python`` in ``env`` (default: this process's), started
    at first use and ended with this process: for "kernel" the folder to put in JUPYTER_PATH, else
    the command that runs a script forked from it (EXERCISES_PYTHON's value for "grader"); None
    where a process cannot watch another's end (no os.pidfd_open: not Linux). A script asked for
    in another environment than ``env`` (see _start_env) runs in a fresh interpreter."""
    import atexit
    import subprocess
    import tempfile

    if not hasattr(os, "pidfd_open"):
        return None
    if (kind, python) not in _servers:
        folder = tempfile.mkdtemp(prefix="wk")  # short: a socket's path has at most 107 bytes
        sock = os.path.join(folder, "server")
        # a session of its own, but for the torch server: the fork servers it forks stay in this
        # process's session, as a fork server started here would, and their ranks with them (Linux
        # schedules a session's processes as one group: the ranks compete as this process's do)
        proc = subprocess.Popen([python, os.path.abspath(__file__), "serve", sock, kind], env=env,
                                stdout=subprocess.PIPE, text=True, start_new_session=kind != "torch")
        said = proc.stdout.readline().strip()  # "ready" once it has imported; "" if it died
        atexit.register(_end, proc, folder)
        if said != "ready":
            raise RuntimeError(f"the {kind} server did not start (exit {proc.wait()}): {said!r}")
        _servers[kind, python] = (kernelspec_folder(os.path.join(folder, "spec"), sock) if kind == "kernel"
                                  else shlex.join([python, "-S", os.path.abspath(__file__), "run", sock]))
        if kind == "torch":  # the executable that stands for `python` when a fork server starts
            wrapper = os.path.join(folder, "forkserver")
            with open(wrapper, "w") as f:
                f.write(f'#!/bin/sh\nexec {shlex.join([python, "-S", os.path.abspath(__file__), "forkserver", sock])} "$@"\n')
            os.chmod(wrapper, 0o755)
            _fork_servers[python] = wrapper
    return _servers[kind, python]


def fork_server_knob(python: str = sys.executable) -> str | None:
    """A value of LABKIT_FORK_SERVER_PYTHON (labkit/fork_server.py) under which a process of
    ``python`` that launches ranks forks its fork server from this process's torch server; None
    without one."""
    if server("torch", python) is None:
        return None
    return f"{python}{os.pathsep}{_fork_servers[python]}"


def python_command(kind: str, env: dict, python: str = sys.executable) -> list[str]:
    """What runs a script as ``[python, script, ...]`` would in ``env``: forked from this process's
    server of ``kind`` where one can run, else ``python`` itself."""
    started = server(kind, python, env)
    return shlex.split(started) if started else [python]


def _end(proc, folder):
    import shutil

    proc.kill()
    proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


def kernelspec_folder(folder, server_socket) -> str:
    """Write ``folder/kernels/python3/kernel.json`` (this file's client, for ``server_socket``);
    return the folder to put in JUPYTER_PATH."""
    spec = os.path.join(folder, "kernels", "python3")
    os.makedirs(spec, exist_ok=True)
    argv = [sys.executable, "-S", os.path.abspath(__file__), "kernel", str(server_socket),
            "{connection_file}"]
    with open(os.path.join(spec, "kernel.json"), "w") as f:
        json.dump({"argv": argv, "display_name": "Python 3 (forked)", "language": "python",
                   "interrupt_mode": "signal"}, f)
    return str(folder)


# ---- the server ---------------------------------------------------------------------------------

def serve(path: str, kind: str = "kernel") -> None:
    """Import PRELOADS[kind], listen on the Unix socket ``path``, fork a kernel ("kernel") or a
    script's run (the others) per request. One thread (a fork copies only the calling thread); a
    child's exit status goes back to its client."""
    import gc
    import importlib

    # the pytest worker that started this server: when it is gone, so is the server (opened
    # first: a parent that dies while the imports run would leave getppid() naming init)
    parent = os.pidfd_open(os.getppid())
    if kind == "torch":  # in its parent's session: a Ctrl-C there ends the parent, and so this
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in PRELOADS[kind]:
        try:
            importlib.import_module(name)
        except Exception:  # a kernel imports it itself
            pass
    for name in sys.modules["labkit.dist"]._PRELOAD if kind == "torch" else []:
        try:
            importlib.import_module(name)
        except Exception:  # the fork server imports it itself
            pass
    gc.collect()
    gc.freeze()  # a child's collections do not walk (and so copy) the server's objects
    imported_env = _start_env(os.environ, kind)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    waiting = {}  # pidfd -> (pid, client connection)
    while True:
        ready, _, _ = select.select([listener, parent, *waiting], [], [])
        for fd in ready:
            if fd == parent:
                os._exit(0)
            if fd is listener:
                conn, _ = listener.accept()
                pid = _fork(conn, listener, parent, waiting, kind, imported_env)
                if pid:
                    waiting[os.pidfd_open(pid)] = (pid, conn)
            else:
                pid, conn = waiting.pop(fd)
                os.close(fd)
                status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                try:
                    conn.sendall(f"{status}\n".encode())
                except OSError:
                    pass
                conn.close()


def _fork(conn, listener, parent, waiting, kind, imported_env):
    """Read a request from ``conn``; fork and run the kernel (the script) in the child. Returns the
    child's pid (0 if the request was refused: the client then starts a fresh process)."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 5)
    while chunk := conn.recv(1 << 16):  # the rest of the request, up to the client's end of it
        data += chunk
    request = json.loads(data.decode())
    asked = {"kernel": ["kernel"], "torch": ["run", "forkserver"]}.get(kind, ["run"])
    forkserver = request["kind"] == "forkserver"
    if (len(fds) != 3 + 2 * forkserver or request["kind"] not in asked
            or _start_env(request["env"], kind) != imported_env
            or forkserver and _shadowed(request["cwd"], request["preload"])):
        for fd in fds:
            os.close(fd)
        conn.sendall(b"refused\n")
        conn.close()
        return 0
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        return pid
    try:  # the kernel, or the script
        listener.close()
        conn.close()
        os.close(parent)
        for fd in waiting:
            os.close(fd)
        for other, client in waiting.values():
            client.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has it
        if not forkserver:  # a fork server stays in the server's session (see server())
            os.setsid()
        for target, fd in enumerate(fds[:3]):  # the standard streams; a fork server's two more stay
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if not forkserver:  # a fork server ends when the processes that use it are gone
            _end_with(request["client"])
        if forkserver:
            code = _run_fork_server(*fds[3:], request)
        elif kind != "kernel":
            code = _run_script(request["argv"])
        else:
            _run_kernel(request["connection_file"], request["extra"])
            code = 0
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_kernel(connection_file, extra):
    sys.argv = ["ipykernel_launcher", "-f", connection_file, *extra]
    sys.path[0] = os.getcwd()  # as `python -m ipykernel_launcher` has it (the server's: tests/)
    from ipykernel.kernelapp import IPKernelApp

    # read from the environment when ipykernel was imported, in the server: the client's here
    jupyter = int(os.environ.get("JPY_PARENT_PID") or 0)
    IPKernelApp.launch_instance(argv=[*sys.argv[1:], f"--IPKernelApp.parent_handle={jupyter}"])


def _run_script(argv) -> int:
    """Run ``argv[0]`` as ``python SCRIPT ARGS`` would: as __main__, its folder first on sys.path,
    its exit handlers run at its end; return its exit status (``sys.exit(None)`` is 0, a message is
    printed and is 1, an uncaught exception's traceback is printed and is 1)."""
    import atexit
    import runpy
    import traceback

    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    try:
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = exit.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    return code or 0


def _shadowed(cwd: str, preload: list) -> bool:
    """Whether a package the server imported is another one in ``cwd``, where a fresh fork server
    (``python -c``: the folder first on sys.path) would import it from."""
    for name in {m.split(".")[0] for m in preload} & set(sys.modules):
        here = getattr(sys.modules[name], "__file__", None) or ""
        for there in (os.path.join(cwd, name, "__init__.py"), os.path.join(cwd, name + ".py")):
            if os.path.exists(there) and os.path.realpath(there) != os.path.realpath(here):
                return True
    return False


def _run_fork_server(listener: int, alive: int, request: dict) -> int:
    """multiprocessing's fork server, as ``python -c "...main(listener, alive, preload, **data)"``
    runs it (the client read those from the command): until the processes that use it are gone."""
    from multiprocessing.forkserver import main

    sys.argv, sys.path[0], sys.dont_write_bytecode = ["-c"], "", request["dont_write_bytecode"]
    try:
        main(listener, alive, request["preload"], **request["data"])
    except SystemExit as exit:  # what it raises when the last user is gone
        return exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    return 0


def _end_with(client_pid: int) -> None:
    """End this process when the client does (jupyter_client kills the client, not the kernel)."""
    import threading

    pidfd = os.pidfd_open(client_pid)

    def watch():
        select.select([pidfd], [], [])
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


# ---- the client ---------------------------------------------------------------------------------

def kernel(path: str, connection_file: str, *extra: str) -> None:
    """Stand for a kernel forked by the server at ``path``; a real kernel if it refuses. ``extra``
    are the arguments Jupyter adds to a kernel's command (nbclient: an in-memory history)."""
    _stand_for(path, {"kind": "kernel", "connection_file": connection_file, "extra": list(extra)},
               ["-m", "ipykernel_launcher", "-f", connection_file, *extra])


def run(path: str, script: str, *args: str) -> None:
    """``python SCRIPT ARGS``, forked by the grader server at ``path``; a fresh one if it refuses."""
    _stand_for(path, {"kind": "run", "argv": [script, *args]}, [script, *args])


def fork_server(path: str, *args: str) -> None:
    """Stand for multiprocessing's fork server, started as ``python ARGS`` (``[-B] -c CODE``) with
    its listener and "alive" pipe open: forked from the torch server at ``path``, which imported
    what it preloads; ``python ARGS`` itself for a command of another form or a refusal."""
    call = _fork_server_call(args)
    if call is None:
        os.execv(sys.executable, [sys.executable, *args])
    listener, alive, preload, data = call
    _stand_for(path, {"kind": "forkserver", "preload": preload, "data": data,
                      "dont_write_bytecode": args[0] == "-B"}, list(args), [listener, alive])


def _fork_server_call(args):
    """(listener, alive, preload, data) from ``[-B] -c "from multiprocessing.forkserver import main;
    main(listener, alive, preload, **data)"``, or None for anything else."""
    import ast

    if len(args) < 2 or args[-2] != "-c" or list(args[:-2]) not in ([], ["-B"]):
        return None
    code = args[-1]
    try:
        first, second = ast.parse(code).body
        call = second.value
        assert isinstance(first, ast.ImportFrom) and first.module == "multiprocessing.forkserver"
        assert [a.name for a in first.names] == ["main"] and call.func.id == "main"
        listener, alive, preload = (ast.literal_eval(a) for a in call.args)
        (data,) = [ast.literal_eval(k.value) for k in call.keywords if k.arg is None] or [{}]
        assert len(call.keywords) <= 1 and isinstance(listener, int) and isinstance(alive, int)
        return listener, alive, list(preload), dict(data)
    except (AssertionError, AttributeError, SyntaxError, TypeError, ValueError):
        return None


def _stand_for(path: str, request: dict, fresh: list, fds: tuple = ()) -> None:
    """Send ``request`` (with this process's folder, environment and standard streams, and ``fds``)
    and stand for the process the server forks; ``python *fresh`` in this process if it refuses."""
    request = dict(request, cwd=os.getcwd(), env=dict(os.environ), client=os.getpid())
    said = b""
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2, *fds])
        conn.shutdown(socket.SHUT_WR)  # the request ends here; replies still come
        while b"\n" not in said:
            chunk = conn.recv(64)
            if not chunk:
                break
            said += chunk
    except OSError:
        said = b""
    reply, _, said = said.partition(b"\n")
    if not reply.isdigit():  # refused, or no server
        os.execv(sys.executable, [sys.executable, *fresh])
    pid = int(reply)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, lambda sig, frame: os.kill(pid, sig))
    # The server sends the child's exit status when it ends. If this client's parent (jupyter)
    # dies first, the child goes with it, as ipykernel's parent poller ends a kernel jupyter started.
    parent = os.pidfd_open(os.getppid())
    while b"\n" not in said:
        if conn not in select.select([conn, parent], [], [])[0]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            parent = os.pidfd_open(os.getpid())  # never readable: now wait for the status
            continue
        chunk = conn.recv(64)
        if not chunk:
            break
        said += chunk
    status = said.partition(b"\n")[0]
    code = int(status) if status.lstrip(b"-").isdigit() else 1
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"] and len(sys.argv) in (3, 4) and set(sys.argv[3:]) <= set(PRELOADS):
        serve(*sys.argv[2:])
    elif sys.argv[1:2] in (["kernel"], ["run"], ["forkserver"]) and len(sys.argv) >= 4:
        {"kernel": kernel, "run": run, "forkserver": fork_server}[sys.argv[1]](*sys.argv[2:])
    else:
        sys.exit("usage: warm_kernels.py serve SOCKET [kernel|grader|torch] | kernel SOCKET CONNECTION_FILE [ARG ...]"
                 " | run SOCKET SCRIPT [ARG ...] | forkserver SOCKET [-B] -c CODE")
