"""The measured side of the memory meter: every storage a training step allocates, by category.

A ``TorchDispatchMode`` sees each operator's outputs; a new storage is an allocation, and a
weak reference tells when it is freed. Categories are decided by what a storage *became*:
model parameters, buffers, ``.grad`` tensors, optimizer states (including fp32 master
weights), activations (allocated in the forward phase and still alive when it ends: what
autograd keeps for backward) and temporaries (everything else). Works the same on CPU, CUDA
and fake tensors; on CUDA the caching allocator's own peak is reported beside it. Collectives
run on copies it does not track (:mod:`.collective_copies`): a group's late hold is not counted.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..validate import check_bool
from .collective_copies import collective_on_copies
from .tensors import optimizer_tensors, strided_tensors

__all__ = ["CATEGORIES", "MemoryMeter", "MemoryReport", "measure_forward_backward", "measure_step",
           "optimizer_tensors", "train_step"]

CATEGORIES = ("parameters", "buffers", "gradients", "optimizer", "activations", "temporaries")


class _Storage:
    __slots__ = ("nbytes", "phase", "category", "ref", "__weakref__")

    def __init__(self, nbytes, phase):
        self.nbytes, self.phase, self.category, self.ref = nbytes, phase, None, None


@dataclass
class MemoryReport:
    """What one measured region allocated. Bytes are storage bytes (``nbytes``)."""

    peak_bytes: int
    peak_index: int
    peak_op: str
    peak_phase: str
    at_peak: dict
    max_by_category: dict
    ops: list = field(repr=False)
    phases: list = field(repr=False)
    timeline: dict = field(repr=False)  # category -> list of bytes after each op
    allocator_peak_bytes: int | None = None
    allocator_start_bytes: int | None = None

    @property
    def activations(self) -> int:
        """Activation bytes kept for backward (their maximum, reached at the end of forward)."""
        return self.max_by_category["activations"]

    def table(self) -> str:
        """A small text table: bytes by category at the peak and each category's own maximum, in
        the language labkit prints in (:func:`labkit.memory.text.report_table`)."""
        from .text import report_table

        return report_table(self, CATEGORIES)

    def peak_of(self, *categories: str) -> int:
        """The highest sum of ``categories`` over the timeline (e.g. activations + temporaries)."""
        unknown = set(categories) - set(CATEGORIES)
        if unknown or not categories:
            raise ValueError(f"categories={categories!r} must be names from {list(CATEGORIES)}")
        return max(map(sum, zip(*(self.timeline[c] for c in categories))))

    def phase_bounds(self) -> dict:
        """phase name -> (first op index, last op index) on the timeline."""
        bounds = {}
        for i, ph in enumerate(self.phases):
            lo, _ = bounds.get(ph, (i, i))
            bounds[ph] = (lo, i)
        return bounds


class MemoryMeter(TorchDispatchMode):
    """Count the bytes of every storage allocated while the meter is active.

    Use phases so that activations can be told from temporaries::

        with MemoryMeter(model, optimizer) as meter:
            with meter.phase("forward"):
                loss = model(x, y)
            with meter.phase("backward"):
                loss.backward()
            with meter.phase("optimizer"):
                optimizer.step(); optimizer.zero_grad()
        print(meter.report().table())
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer=None):
        super().__init__()
        self.model, self.optimizer = model, optimizer
        self._by_storage: dict[int, _Storage] = {}  # id(storage) -> record, while alive
        self._events: list[tuple[int, _Storage, int]] = []  # (op index, record, +/- bytes)
        self._ops: list[str] = ["(start)"]
        self._phases: list[str] = ["(start)"]
        self._phase = "(start)"
        self._forward_records: list[_Storage] = []
        self._cuda_dev = None
        self._cuda_start = self._cuda_peak = None  # the caching allocator's counters, on CUDA only

    # -- tracking ---------------------------------------------------------------------------
    def _track(self, t: torch.Tensor, category: str | None = None) -> _Storage | None:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return None
        if self._cuda_dev is not None and t.device != self._cuda_dev:
            return None  # on a GPU, count device memory only (Adam's `step` lives on the host)
        st = t.untyped_storage()
        key = id(st)
        rec = self._by_storage.get(key)
        if rec is not None and rec.ref() is st:
            if st.nbytes() != rec.nbytes:  # resized in place
                self._events.append((len(self._ops) - 1, rec, st.nbytes() - rec.nbytes))
                rec.nbytes = st.nbytes()
        else:
            rec = _Storage(st.nbytes(), self._phase)
            rec.ref = weakref.ref(st, self._freed_callback(rec, key))
            self._by_storage[key] = rec
            self._events.append((len(self._ops) - 1, rec, rec.nbytes))
            if self._phase == "forward":
                self._forward_records.append(rec)
        if category is not None:
            rec.category = category
        return rec

    def _freed_callback(self, rec, key):
        def freed(_ref):
            # Freed after op i (or inside op i+1): the state after op i still holds it, as the
            # allocator's did; it is gone from the state after op i+1.
            self._events.append((len(self._ops), rec, -rec.nbytes))
            if self._by_storage.get(key) is rec:
                del self._by_storage[key]
        return freed

    def _label_states(self):
        if self.model is not None:
            for p in self.model.parameters():
                self._track(p, "parameters")
                if p.grad is not None:
                    self._track(p.grad, "gradients")
            for b in self.model.buffers():
                self._track(b, "buffers")
        for t in optimizer_tensors(self.optimizer):
            self._track(t, "optimizer")
        for t in getattr(self.optimizer, "grad_tensors", list)():  # e.g. fp32 gradient buffers
            self._track(t, "gradients")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            out = collective_on_copies(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if func.namespace == "profiler":  # record_function markers allocate nothing
            return out
        self._ops.append(str(func.overloadpacket.__name__))
        self._phases.append(self._phase)
        # An output that aliases an input (a view, an in-place op) allocated nothing, even
        # when the input's storage predates the meter and was never seen.
        inputs = {id(t.untyped_storage()) for t in strided_tensors((args, kwargs))}
        for t in strided_tensors(out):
            if id(t.untyped_storage()) in inputs and id(t.untyped_storage()) not in self._by_storage:
                continue
            self._track(t)
        return out

    # -- phases ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str):
        """Mark a phase. At the end of ``"forward"``, live forward allocations become activations."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r} must be a non-empty string (a phase: 'forward', ...)")
        previous, self._phase = self._phase, name
        try:
            yield self
        finally:
            # the phase's end is a point of the timeline: its last op's outputs count there
            self._ops.append(f"(end of {name})")
            self._phases.append(name)
            self._phase = previous
            if name == "forward":
                for rec in self._forward_records:
                    if rec.ref() is not None and rec.category is None:
                        rec.category = "activations"
                self._forward_records = []
            self._label_states()

    def __enter__(self):
        dev = next((p.device for p in self.model.parameters()), None) if self.model is not None else None
        if dev is not None and dev.type == "cuda":
            self._cuda_dev = dev
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            self._cuda_start = torch.cuda.memory_allocated(dev)
        super().__enter__()
        self._label_states()
        return self

    def __exit__(self, *exc):
        self._label_states()
        super().__exit__(*exc)
        if self._cuda_dev is not None:
            torch.cuda.synchronize(self._cuda_dev)
            self._cuda_peak = torch.cuda.max_memory_allocated(self._cuda_dev)

    # -- results -----------------------------------------------------------------------------
    def report(self) -> MemoryReport:
        """Replay the allocation events into a per-op timeline of bytes by category."""
        n = len(self._ops)
        delta = {c: [0] * n for c in CATEGORIES}
        for idx, rec, nbytes in self._events:  # frees after the last op land on it
            delta[rec.category or "temporaries"][min(idx, n - 1)] += nbytes
        timeline = {c: list(itertools.accumulate(delta[c])) for c in CATEGORIES}
        totals = [sum(timeline[c][i] for c in CATEGORIES) for i in range(n)]
        peak_i = max(range(n), key=totals.__getitem__)
        return MemoryReport(
            peak_bytes=totals[peak_i], peak_index=peak_i, peak_op=self._ops[peak_i],
            peak_phase=self._phases[peak_i],
            at_peak={c: timeline[c][peak_i] for c in CATEGORIES},
            max_by_category={c: max(timeline[c]) for c in CATEGORIES},
            ops=list(self._ops), phases=list(self._phases), timeline=timeline,
            allocator_peak_bytes=self._cuda_peak,
            allocator_start_bytes=self._cuda_start,
        )


def train_step(model: torch.nn.Module, optimizer, batch, *, loss_fn=None, meter: MemoryMeter | None = None,
               zero_grad: bool = True, keep_loss: bool = False):
    """One forward, backward and (unless ``optimizer`` is None) optimizer step, in the meter's phases.

    ``batch`` is ``(x, y)``; the loss is ``model(x, y)`` unless ``loss_fn(model, batch)`` is given.
    The loss is freed in backward, as a training loop frees it, unless ``keep_loss``: then it is
    returned (else None).
    """
    check_bool("zero_grad", zero_grad)
    check_bool("keep_loss", keep_loss)
    if not isinstance(batch, (tuple, list)):  # a bare tensor would be unpacked along its rows
        raise ValueError(f"batch={type(batch).__name__} must be a tuple such as (x, y)")

    def phase(name):
        return meter.phase(name) if meter is not None else contextlib.nullcontext()

    with phase("forward"):
        loss = model(*batch) if loss_fn is None else loss_fn(model, batch)
    with phase("backward"):
        loss.backward()
        if not keep_loss:
            del loss
            loss = None
    if optimizer is not None:
        with phase("optimizer"):
            optimizer.step()
            if zero_grad:
                optimizer.zero_grad(set_to_none=True)
    return loss


def measure_forward_backward(model: torch.nn.Module, batch, loss_fn=None) -> MemoryReport:
    """Measure one forward and backward (no optimizer step); the gradients are then set to None.

    ``batch`` is ``(x, y)``; the loss is ``model(x, y)`` unless ``loss_fn(model, batch)`` is given.
    """
    with MemoryMeter(model) as meter:
        train_step(model, None, batch, loss_fn=loss_fn, meter=meter)
    model.zero_grad(set_to_none=True)
    return meter.report()


def measure_step(model: torch.nn.Module, optimizer, batch, loss_fn=None, zero_grad: bool = True) -> MemoryReport:
    """Measure one training step: forward, backward, ``optimizer.step()`` (and ``zero_grad``).

    ``batch`` is ``(x, y)``; the loss is ``model(x, y)`` unless ``loss_fn(model, batch)`` is given.
    Returns the :class:`MemoryReport` of the step.
    """
    if optimizer is None:
        raise ValueError("optimizer=None: measure_step needs an optimizer to take a step")
    with MemoryMeter(model, optimizer) as meter:
        train_step(model, optimizer, batch, loss_fn=loss_fn, meter=meter, zero_grad=zero_grad)
    return meter.report()
