"""The kernels nbval runs the labs in: no port to lose, and patience on a busy machine.

nbval starts a lab's kernel through jupyter_client, which gives it TCP ports it found free and
released, so another process can bind one first: the race labkit's launches no longer run (#28),
and the likeliest cause of a lab's kernel dying before it answered when two copies of the suite
ran at once. :class:`PatientKernel` is nbval's kernel started over Unix sockets in a folder of its
own, with nbval's startup time times ``LABKIT_TIMEOUT_SCALE``. A kernel that dies or does not
answer in time gets one more start on a busy machine (labkit.busy), since the lab has not run a
cell yet; a failure says what the kernel printed, how busy the machine is and which knob to turn.
The root conftest.py puts it in nbval's place; a cell's wait for its outputs stretches there too.
Its python3 kernel is forked from the worker's kernel server (tests/warm_kernels.py), which
imported ipykernel, torch and labkit once, as the gradings' kernels are: the lab then runs as in a
kernel Jupyter started (its folder, environment, session and streams), without paying for those
imports again, and its ranks' fork server is forked from the worker's torch server (about 1.5 and
2.3 CPU-seconds a lab; the round-off re-run's lab still starts both fresh, as a reader's does).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from jupyter_client import KernelManager
from nbval.kernel import NbvalKernelspecManager, RunningKernel

from labkit.busy import busy_note, timeout_scale

# nbval's wait for a cell's outputs after its reply, in seconds (IPyNbCell.output_timeout)
OUTPUT_SECONDS = 5


class PatientKernel(RunningKernel):
    """nbval's RunningKernel over Unix sockets, given ``startup_timeout`` times
    LABKIT_TIMEOUT_SCALE to start, once more on a busy machine."""

    def __init__(self, kernel_name, cwd=None, startup_timeout=60):
        limit = float(startup_timeout) * timeout_scale()
        for attempt in (1, 2):
            try:
                self._start(kernel_name, cwd, limit)
                return
            except RuntimeError as error:
                said = self._discard()
                busy = busy_note()
                if attempt == 1 and busy:
                    continue
                tried = f"twice, {limit:g} s each: {busy}" if attempt == 2 else \
                    "the machine is not busy"
                printed = f"\nThe kernel printed:\n{said}" if said else ""
                raise RuntimeError(f"the lab's Jupyter kernel {kernel_name!r}, given {limit:g} s to "
                                   f"start, did not ({error}; {tried}){printed}") from None

    def _start(self, kernel_name, cwd, limit):
        # a socket path has at most 107 bytes: a short folder under the system's temp
        self._sockets = tempfile.mkdtemp(prefix="nbk")
        self._stderr = tempfile.TemporaryFile()
        self.km = KernelManager(kernel_name=kernel_name, kernel_spec_manager=_kernelspecs(),
                                transport="ipc", ip=os.path.join(self._sockets, "k"))
        # this environment, LABKIT_FORK_SERVER_PYTHON included: a lab's ranks come from a fork
        # server forked from the worker's torch server, as the tests' do (conftest._warm_fork_servers)
        self.km.start_kernel(stderr=self._stderr, cwd=cwd, env=dict(os.environ))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=limit)
        self._ensure_iopub_up()

    def _discard(self) -> str:
        """Stop a kernel that did not start; return the end of what it wrote to stderr."""
        if hasattr(self, "kc"):
            self.kc.stop_channels()
        if hasattr(self, "km"):
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=True)
            del self.km
        self._stderr.seek(0)
        said = self._stderr.read().decode(errors="replace").strip()
        self._stderr.close()
        shutil.rmtree(self._sockets, ignore_errors=True)
        return "\n".join(said.splitlines()[-20:])

    def stop(self):
        super().stop()
        self._stderr.close()
        shutil.rmtree(self._sockets, ignore_errors=True)


def _kernelspecs() -> NbvalKernelspecManager:
    """nbval's kernelspecs, python3 first from the worker's kernel server's folder (forked kernels;
    other names as Jupyter finds them), or as they are where no server runs (not Linux) and in the
    round-off re-run (tests/test_cross_machine.py): its one lab starts a real kernel, as a reader's
    Jupyter does (a server there would cost what it saves)."""
    from jupyter_core.paths import jupyter_path

    import warm_kernels
    from test_cross_machine import GUARD

    folder = None if os.environ.get(GUARD) == "1" else warm_kernels.server("kernel")
    if folder is None:
        return NbvalKernelspecManager()
    return NbvalKernelspecManager(kernel_dirs=[os.path.join(folder, "kernels"), *jupyter_path("kernels")])


def output_seconds() -> float:
    """How long a cell waits for its outputs after its reply: nbval's 5 s times
    LABKIT_TIMEOUT_SCALE, twice that while the machine is busy."""
    return OUTPUT_SECONDS * timeout_scale() * (2 if busy_note() else 1)
