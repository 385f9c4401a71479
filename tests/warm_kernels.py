"""Grading kernels forked from a process that imported what every grading imports.

A grading starts a fresh Jupyter kernel, which imports ipykernel, torch, otter and labkit before
the notebook's first cell: about 2.7 CPU-seconds of a grading's 6, some thirty gradings a run
(scripts/results/suite_times.md). Here a server imports ipykernel, torch and labkit once
(``serve``) and forks a kernel for each start; the kernel then runs the notebook, otter's cells
included, as a fresh kernel does.

Jupyter starts the kernel a kernelspec names. :func:`kernelspec_folder` writes a ``python3``
kernelspec whose command is this file's ``kernel`` client, which jupyter_client starts and manages
as the kernel: the client hands the server the connection file, its working folder, environment
and standard streams, and stands for the forked kernel. It passes signals on (SIGINT is an
interrupt), ends with the kernel's exit status, and a kernel whose client is killed ends at once
(a watch on the client). A JUPYTER_PATH naming that folder makes otter's kernels these
(tests/test_exercises.py's ``warm_kernels`` fixture, for the gradings that test what a kernel
computes; those that test how a kernel is started or stopped keep real ones). A variable torch
reads when imported (ATEN_CPU_CAPABILITY, ...) that differs from the server's, or no server
answering, makes the client start a real kernel instead.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

# What a kernel imports before its first cell (ipykernel) and what every grading imports (torch,
# labkit). Not otter: it imports doctest, whose debugger class then predates IPython's shell, and
# every check fails ("'_OutputRedirectingPdb' object has no attribute 'set_colors'"); a kernel
# imports otter itself, after its shell is up, as in a kernel Jupyter starts.
PRELOAD = ["ipykernel.kernelapp", "ipykernel.ipkernel", "ipykernel.zmqshell", "matplotlib_inline",
           "torch", "numpy", "labkit"]
def _import_env(env: dict) -> dict:
    """The variables torch (or what it loads) reads at import, as labkit.dist's fork server
    compares them: a kernel asking for other values is a real one. (Server side: it imports labkit.)"""
    from labkit.dist import _IMPORT_TIME_ENV

    return {k: env.get(k) for k in _IMPORT_TIME_ENV}


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

def serve(path: str) -> None:
    """Import PRELOAD, listen on the Unix socket ``path``, fork a kernel per request. One thread
    (a fork copies only the calling thread); a child's exit status goes back to its client."""
    import gc
    import importlib

    # the pytest worker that started this server: when it is gone, so is the server (opened
    # first: a parent that dies while the imports run would leave getppid() naming init)
    parent = os.pidfd_open(os.getppid())
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # a kernel imports it itself
            pass
    gc.collect()
    gc.freeze()  # a child's collections do not walk (and so copy) the server's objects
    imported_env = _import_env(os.environ)
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
                pid = _fork_kernel(conn, listener, parent, waiting, imported_env)
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


def _fork_kernel(conn, listener, parent, waiting, imported_env):
    """Read a request from ``conn``; fork and run the kernel in the child. Returns the child's pid
    (0 if the request was refused: the client then starts a real kernel)."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while chunk := conn.recv(1 << 16):  # the rest of the request, up to the client's end of it
        data += chunk
    request = json.loads(data.decode())
    if len(fds) != 3 or _import_env(request["env"]) != imported_env:
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
    try:  # the kernel
        listener.close()
        conn.close()
        os.close(parent)
        for fd in waiting:
            os.close(fd)
        for other, client in waiting.values():
            client.close()
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _end_with(request["client"])
        sys.argv = ["ipykernel_launcher", "-f", request["connection_file"], *request["extra"]]
        from ipykernel.kernelapp import IPKernelApp

        # read from the environment when ipykernel was imported, in the server: the client's here
        jupyter = int(os.environ.get("JPY_PARENT_PID") or 0)
        IPKernelApp.launch_instance(argv=[*sys.argv[1:], f"--IPKernelApp.parent_handle={jupyter}"])
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
    request = {"connection_file": connection_file, "extra": list(extra), "cwd": os.getcwd(),
               "env": dict(os.environ), "client": os.getpid()}
    said = b""
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
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
        os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", "-f", connection_file,
                                  *extra])
    pid = int(reply)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, lambda sig, frame: os.kill(pid, sig))
    # The server sends the kernel's exit status when it ends. If this client's parent (jupyter)
    # dies first, the kernel goes with it, as ipykernel's parent poller ends a kernel jupyter started.
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
    if sys.argv[1:2] == ["serve"] and len(sys.argv) == 3:
        serve(sys.argv[2])
    elif sys.argv[1:2] == ["kernel"] and len(sys.argv) >= 4:
        kernel(*sys.argv[2:])
    else:
        sys.exit("usage: warm_kernels.py serve SOCKET | kernel SOCKET CONNECTION_FILE [ARG ...]")
