"""Run a function on N real processes, and count what the collectives move.

``launch(fn, world_size, *args)`` starts ``world_size`` processes from a notebook cell or a
test (gloo on CPU, NCCL on CUDA), calls ``fn(rank, world_size, *args)`` in each with the
process group initialised, and returns the ranks' results in rank order. Under ``torchrun``
(``RANK``/``WORLD_SIZE`` set) the same call runs ``fn`` once, in this process. A rank that
raises makes ``launch`` raise in the parent with that rank's traceback; a collective that
hangs hits the process-group timeout; nothing is left running. The parent holds the
rendezvous store, so no other process can take its port. On a busy machine the timeouts
stretch (``LABKIT_TIMEOUT_SCALE``, and once more by the load), and say so when they fire.
"""

from __future__ import annotations

import datetime
import gc
import io
import os
import queue as queue_mod
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .busy import busy_note, timeout_scale
from .comm_counter import CommCounter, CommStats
from .fork_server import ensure_fork_server
from .validate import check_choice, check_int, check_positive

__all__ = ["launch", "rendezvous_store", "RendezvousError", "timeout_scale", "busy_note", "init_from_env",
           "rank_device", "DistributedError", "CommCounter", "CommStats"]


class DistributedError(RuntimeError):
    """A rank failed, hung or died; the message carries the rank and its traceback."""


class RendezvousError(DistributedError):
    """The ranks could not connect to each other (before ``fn`` ran on any of them)."""


def rendezvous_store(timeout_s: float = 30.0) -> dist.TCPStore:
    """A rendezvous store that listens on 127.0.0.1 at a port the OS picks, held open by the caller.

    The ranks connect to ``store.port`` as clients. The port is bound before its number is known
    and stays bound while the store lives, so no other process can take it in between (a port
    picked, released and handed on can be).
    """
    check_positive("timeout_s", timeout_s)
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


# Read by torch (or by the libraries it loads) when it is imported: ranks forked from a server
# that imported torch under other values would not run as the parent asks, so they are spawned.
_IMPORT_TIME_ENV = ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS",
                    "CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")
# What the server imports once for all its ranks: torch, labkit, and what a rank would otherwise
# import on its own at first use, each rank again. torch._dynamo alone, which torch imports when a
# collective or an optimizer is first called, costs a rank about a second of CPU (it brings sympy
# and Triton's front end); DTensor, FSDP2 and checkpointing about half a second each. Every module
# of labkit.runs (what ranks run) is read from the folder, so a new one is preloaded too. A name
# that cannot be imported here is skipped by the server.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.tensor",
            "torch.distributed.fsdp", "torch.distributed.pipelining", "torch.distributed.checkpoint",
            "labkit", "labkit.dist", "labkit.model", "labkit.memory", "labkit.parallel",
            *sorted(f"labkit.runs.{p.stem}" for p in (Path(__file__).parent / "runs").glob("*.py")
                    if p.stem != "__init__")]
_server_env: dict | None = None


def _rank_context():
    """Where ranks start from: a fork server that imported torch and labkit once, so that a rank
    starts in milliseconds instead of seconds; a fresh interpreter (spawn) on systems without one
    (Windows) or when a variable torch reads at import changed since the server started.
    A server keeps the labkit it imported: code edited since then reaches ranks after a restart."""
    global _server_env
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    env = {k: os.environ.get(k) for k in _IMPORT_TIME_ENV}
    _server_env = env if _server_env is None else _server_env
    if env != _server_env:
        return mp.get_context("spawn")
    ensure_fork_server(_PRELOAD)  # started by LABKIT_FORK_SERVER_PYTHON's executable, if it names one
    return mp.get_context("forkserver")


def _default_backend(local_ranks: int = 1) -> str:
    """NCCL when this machine has a CUDA GPU for each of its ``local_ranks`` ranks, else gloo."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks else "gloo"


def rank_device() -> torch.device:
    """This rank's device: its GPU when the process group is NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_from_env(backend: str | None = None, timeout_s: float = 30.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment; return (rank, world_size)."""
    backend = check_choice("backend", backend or _default_backend(), ("gloo", "nccl"))
    check_positive("timeout_s", timeout_s)
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _worker(rank, world_size, port, backend, timeout_s, fn, args, kwargs, results, env):
    # What the fork server imported (torch, labkit: some 300,000 objects) lives as long as the rank.
    # Out of the collector's sight, a full collection no longer visits each of them and, by writing
    # to them, copies the server's memory into this rank page by page: a tenth of the CPU time of
    # a distributed test, measured (scripts/results/suite_times.md).
    gc.freeze()
    os.environ.clear()  # the parent's environment now, not the fork server's when it started
    os.environ.update(env)
    # MASTER_* name the parent's store for code that reads them; nothing here binds that port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if backend == "gloo":  # every rank is on this machine: connect over loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # launch() checked that there is a GPU for each rank
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)  # the parent's
        try:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        except Exception:  # no rank has run fn: the parent may start the launch again
            results.put((rank, None, traceback.format_exc()))
            return
        try:
            out = fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
        # torch.save, not the queue's tensor sharing: shared-memory tensors would vanish
        # with this process, which may exit before the parent reads them
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, including KeyboardInterrupt in a rank
        results.put((rank, False, traceback.format_exc()))


def _failure_message(world_size, failures, results, grace_s=3.0):
    """Collect the other ranks' failures for a moment and put the root cause first: a rank
    whose error did not come out of a collective (the others usually fail *because* of it)."""
    deadline = time.monotonic() + grace_s
    while len(failures) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue_mod.Empty:
            continue
        if not ok:
            failures[rank] = value
    order = sorted(failures, key=lambda r: ("distributed_c10d.py" in failures[r], r))
    first, rest = order[0], order[1:]
    msg = f"rank {first} of {world_size} raised:\n{failures[first]}"
    for r in rest:
        last = failures[r].strip().splitlines()[-1]
        msg += f"\n(rank {r} also failed, probably as a consequence: {last})"
    if "timed out" in msg.lower() and busy_note():
        msg += f"\nA collective timed out, and {busy_note()}."
    return msg


def _check_importable(fn) -> None:
    """A spawned rank finds ``fn`` by importing its module: refuse what it could not import."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    name = getattr(fn, "__name__", repr(fn))
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be a function defined at the top level of a module")
    if name == "<lambda>" or "<locals>" in qualname:
        raise ValueError(f"fn={qualname or name} is a lambda or a nested function, which spawned ranks "
                         "cannot import: define it at the top level of a module (a .py file)")
    if module in (None, "__main__", "__mp_main__"):
        raise ValueError(f"fn={name} is defined in {module or 'no module'} (a notebook cell or the script "
                         "being run), which spawned ranks cannot import: move it into a module (a .py "
                         "file, e.g. in labkit.runs) and import it from there")


def launch(fn, world_size: int, *args, backend: str | None = None, timeout_s: float = 30.0,
           join_timeout_s: float | None = None, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; return results.

    ``fn`` must be importable (defined in a module, not in a notebook cell) and return
    something picklable; tensors in it come back on the CPU. ``timeout_s`` bounds every
    collective; ``join_timeout_s`` (default ``timeout_s + 60``) bounds the whole run, once more on
    a busy machine; both are multiplied by :func:`timeout_scale`. ``backend=None`` takes NCCL
    when there is a CUDA GPU for each rank, else gloo. Under torchrun, runs ``fn`` here and
    returns ``[result]`` of this rank.
    """
    check_int("world_size", world_size, 1)
    check_positive("timeout_s", timeout_s)  # a negative timedelta would crash inside c10d
    if join_timeout_s is not None:
        check_positive("join_timeout_s", join_timeout_s)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # then torchrun placed the ranks
    backend = check_choice("backend", backend or _default_backend(1 if torchrun else world_size),
                           ("gloo", "nccl"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    instead = "use backend='gloo' (CPU processes) or None (NCCL when there is a GPU for each rank, else gloo)"
    if backend == "nccl" and gpus == 0:
        raise ValueError(f"backend='nccl' needs CUDA GPUs and none is available; {instead}")
    if backend == "nccl" and not torchrun and gpus < world_size:  # NCCL refuses two ranks on one GPU
        raise ValueError(f"backend='nccl' puts each rank on a GPU of its own: world_size={world_size} "
                         f"needs {world_size} CUDA GPUs and {gpus} are visible; {instead}")
    if torchrun:
        rank, ws = init_from_env(backend, timeout_s)
        if ws != world_size:
            raise ValueError(f"world_size={world_size} but torchrun started WORLD_SIZE={ws}")
        return [fn(rank, ws, *args, **kwargs)]
    _check_importable(fn)
    join_timeout_s = timeout_s + 60 if join_timeout_s is None else join_timeout_s
    scale = timeout_scale()
    for attempt in range(_TRIES):
        try:
            return _launch_once(fn, world_size, args, kwargs, backend, timeout_s * scale, join_timeout_s * scale)
        except RendezvousError as err:  # safe to retry: no rank ran fn
            last = err
    raise DistributedError(f"the ranks could not connect to each other in {_TRIES} tries "
                           f"({busy_note() or 'the machine is not busy'}); the last failure:\n{last}")


# gloo's connection of the ranks to each other now and then fails on a loaded machine
# ("Connection closed by peer" in connectFullMesh): the launch starts again, twice at most.
_TRIES = 3


def _launch_once(fn, world_size, args, kwargs, backend, timeout_s, join_timeout_s) -> list:
    """One start of the ranks, with a fresh store; their results, or the error of the first failure."""
    ctx = _rank_context()
    results = ctx.Queue()
    store = rendezvous_store(timeout_s)  # held until the ranks are gone: its port cannot be taken
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, store.port, backend, timeout_s, fn, args, kwargs, results, env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outputs = {}
    try:
        _collect(procs, results, world_size, join_timeout_s, outputs)
    finally:
        finished = len(outputs) == world_size  # then the ranks are exiting; else kill them now
        for p in procs:
            p.join(timeout=5 if finished else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        del store
    return [outputs[r] for r in range(world_size)]


def _collect(procs, results, world_size, join_timeout_s, outputs) -> None:
    """Fill ``outputs`` (rank -> result) from the ranks' queue; raise on a failure, death or timeout."""
    deadline, stretched = time.monotonic() + join_timeout_s, False
    while len(outputs) < world_size:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if r not in outputs and p.exitcode not in (None, 0)]
            if dead:
                # a rank died without reporting (killed, segfault): give its queue a moment
                try:
                    rank, ok, value = results.get(timeout=1.0)
                except queue_mod.Empty:
                    raise DistributedError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                           "without reporting a result") from None
            elif time.monotonic() > deadline and busy_note() and not stretched:
                deadline, stretched = time.monotonic() + join_timeout_s, True  # slow, maybe not hung
            elif time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(outputs))
                waited = f"{join_timeout_s:g}s" + (f" and {join_timeout_s:g}s more" if stretched else "")
                why = (busy_note() + " or larger timeout_s / join_timeout_s") if busy_note() else (
                    "the machine is not busy: a hung collective, an endless loop, or a run longer than "
                    "join_timeout_s")
                raise DistributedError(f"ranks {missing} did not finish within join_timeout_s={waited}: {why}")
            else:
                continue
        if ok is None:
            raise RendezvousError(_failure_message(world_size, {rank: value}, results))
        if not ok:
            raise DistributedError(_failure_message(world_size, {rank: value}, results))
        outputs[rank] = torch.load(io.BytesIO(value), map_location="cpu", weights_only=False)
