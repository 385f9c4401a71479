"""Where labkit.dist's fork server starts: this interpreter, or a command that stands for it.

``labkit.dist.launch`` forks its ranks from a server process that imported torch and labkit once
(multiprocessing's fork server). That server starts as ``python -c ...``: a few CPU-seconds of
imports, once per process that launches ranks. A harness that already keeps such a process warm
(the course's test suite: tests/warm_kernels.py) can fork the server from it instead, by naming
an executable that stands for the interpreter:

    LABKIT_FORK_SERVER_PYTHON=<interpreter><os.pathsep><executable>

The executable is run in place of ``<interpreter>`` with the same arguments, file descriptors and
environment, and must behave as that interpreter would (it may run it). The variable applies only
in a process whose ``sys.executable`` is ``<interpreter>``: a process of another interpreter or
virtual environment that inherits it starts its server as usual. Unset, nothing changes.
"""

from __future__ import annotations

import os
import sys

__all__ = ["KNOB", "fork_server_executable", "ensure_fork_server"]

KNOB = "LABKIT_FORK_SERVER_PYTHON"


def fork_server_executable(value: str | None = None) -> str | None:
    """The executable that starts this process's fork server in place of ``sys.executable``
    (None: the interpreter itself), from ``value`` (default: the environment's LABKIT_FORK_SERVER_PYTHON)."""
    value = os.environ.get(KNOB) if value is None else value
    if not value:
        return None
    python, sep, exe = value.partition(os.pathsep)
    if not sep or not python or not exe:
        raise ValueError(f"{KNOB}={value!r} must be <interpreter>{os.pathsep}<executable> (an interpreter's "
                         "path, then the executable that stands for it)")
    if python != sys.executable:
        return None
    if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
        raise ValueError(f"{KNOB} names {exe!r} to stand for {python}, which is not an executable file")
    return exe


def ensure_fork_server(preload: list[str]) -> None:
    """Start multiprocessing's fork server (if it is not running) with ``preload``, by the executable
    :func:`fork_server_executable` names, or leave it to start as usual at the first rank."""
    from multiprocessing import forkserver, spawn

    forkserver.set_forkserver_preload(preload)
    exe = fork_server_executable()
    if exe is None:
        return
    interpreter = spawn.get_executable()
    spawn.set_executable(exe)
    try:
        forkserver.ensure_running()
    finally:
        spawn.set_executable(interpreter)
