"""Precision policies for training: fp32, mixed, mixed_fp32_grads, mixed_fp32_buffer, bf16.

``mixed`` follows Micikevicius et al. (2018): parameters and gradients in 16 bits, an fp32
master copy of the weights that the optimizer updates, and the 16-bit weights copied back.
``mixed_fp32_grads`` adds what Megatron-LM and DeepSpeed keep in bf16 runs: an fp32 buffer per
parameter into which every 16-bit gradient is added as backward produces it (the 16-bit
``.grad`` is then freed), so accumulation over micro-batches rounds in fp32 (18 bytes/param).
``mixed_fp32_buffer`` is DeepSpeed's BF16 optimizer (BLOOM's): the 16-bit gradients of a whole
backward stay in ``.grad`` and are added into the unsharded fp32 buffer when the backward ends,
then zeroed in place: both are held (20 bytes/param with Adam).
"""

from __future__ import annotations

import torch

from .validate import ArgumentError, check_bool, check_choice, check_float

__all__ = ["PRECISIONS", "OPTIMIZERS", "MasterWeightOptimizer", "model_dtype", "make_optimizer"]

PRECISIONS = ("fp32", "mixed", "mixed_fp32_grads", "mixed_fp32_buffer", "bf16")
OPTIMIZERS = ("adam", "adamw", "sgd_momentum", "sgd")


def _check(precision: str, optimizer: str | None = None) -> None:
    check_choice("precision", precision, PRECISIONS)
    if optimizer is not None:
        check_choice("optimizer", optimizer, OPTIMIZERS)


def model_dtype(precision: str, half: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The dtype of the model's parameters (and so of its activations) under ``precision``."""
    _check(precision)
    if half not in (torch.bfloat16, torch.float16):
        raise ArgumentError(f"half={half!r} must be torch.bfloat16 or torch.float16")
    return torch.float32 if precision == "fp32" else half


class MasterWeightOptimizer:
    """Wrap a ``torch.optim`` optimizer so it updates fp32 copies of 16-bit parameters.

    ``step()`` casts each 16-bit ``.grad`` to fp32, steps the inner optimizer on the master
    weights and copies them back into the 16-bit parameters. With ``fp32_grads=True`` a hook
    adds each 16-bit gradient into a persistent fp32 buffer (``grad_tensors()``) as soon as
    backward has produced it and frees the 16-bit one; ``step()`` then uses the buffers as is.
    With ``after_backward=True`` as well, the 16-bit gradients are added together when the
    backward ends and zeroed in place (DeepSpeed's BF16 optimizer), so the whole 16-bit gradient
    is held beside the buffers.
    """

    def __init__(self, params, optimizer_cls=torch.optim.AdamW, *, fp32_grads: bool = False,
                 after_backward: bool = False, **optimizer_kwargs):
        check_bool("fp32_grads", fp32_grads)
        check_bool("after_backward", after_backward)
        if after_backward and not fp32_grads:
            raise ArgumentError("after_backward=True needs fp32_grads=True: it says when the 16-bit gradients "
                                "are added into the fp32 buffers")
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("params is empty: nothing to optimize")
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.inner = optimizer_cls(self.master, **optimizer_kwargs)
        self.param_groups = self.inner.param_groups
        self.main_grads = [torch.zeros_like(m) for m in self.master] if fp32_grads else None
        self._flush_task = None  # the backward (autograd graph task) whose end will call _flush
        if fp32_grads:
            for p, buf in zip(self.params, self.main_grads):
                p.register_post_accumulate_grad_hook(self._queue_flush if after_backward else self._accumulate_into(buf))

    @staticmethod
    def _accumulate_into(buf):
        def hook(p):
            buf.add_(p.grad)  # rounds once, in fp32
            p.grad = None
        return hook

    def _queue_flush(self, p):
        """The first gradient of each backward asks autograd to call _flush when that backward
        ends (keyed by its graph task, so a backward that raised leaves nothing pending)."""
        task = torch._C._current_graph_task_id()
        if task != self._flush_task:
            self._flush_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)

    @torch.no_grad()
    def _flush(self):
        for p, buf in zip(self.params, self.main_grads):
            if p.grad is not None:
                buf.add_(p.grad)  # rounds once, in fp32
                p.grad.zero_()  # kept at a fixed address, as DeepSpeed keeps it for graph replay

    def grad_tensors(self):
        """The fp32 gradient buffers (``fp32_grads=True``), else an empty list."""
        return list(self.main_grads or [])

    @property
    def state(self):
        return self.inner.state

    @torch.no_grad()
    def step(self):
        for i, (p, m) in enumerate(zip(self.params, self.master)):
            if self.main_grads is not None:
                m.grad = self.main_grads[i]  # already fp32: no copy
            else:
                m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m)
            m.grad = None

    def zero_grad(self, set_to_none: bool = True):
        check_bool("set_to_none", set_to_none)
        for buf in self.main_grads or []:
            buf.zero_()  # a persistent buffer, as in Megatron-LM: zeroed, never freed
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_tensors(self):
        """The fp32 master weights and the inner optimizer's state tensors."""
        from torch.utils._pytree import tree_leaves
        states = [t for t in tree_leaves(list(self.inner.state.values())) if isinstance(t, torch.Tensor)]
        return list(self.master) + states

    def state_dict(self):
        return {"master": [m.detach().clone() for m in self.master], "inner": self.inner.state_dict()}

    def load_state_dict(self, state):
        """Load :meth:`state_dict`'s output; refuse one saved for other parameters (no partial load)."""
        saved = list(state["master"])
        shapes = [tuple(t.shape) for t in saved]
        if shapes != [tuple(m.shape) for m in self.master]:
            raise ArgumentError(f"state['master'] holds {len(saved)} tensors of shapes {shapes[:4]}..., "
                                f"but this optimizer has {len(self.master)} parameters of shapes "
                                f"{[tuple(m.shape) for m in self.master][:4]}...: saved for another model")
        self.inner.load_state_dict(state["inner"])  # checks its own groups before anything changes
        with torch.no_grad():
            for m, t in zip(self.master, saved):
                m.copy_(t)


def make_optimizer(params, precision: str = "fp32", optimizer: str = "adamw", lr: float = 1e-3, **kwargs):
    """The optimizer of a precision policy: plain for fp32/bf16, with master weights for mixed,
    mixed_fp32_grads and mixed_fp32_buffer (which also accumulate gradients in fp32 buffers)."""
    _check(precision, optimizer)
    check_float("lr", lr, 0.0)
    cls, extra = {
        "adam": (torch.optim.Adam, {}),
        "adamw": (torch.optim.AdamW, {}),
        "sgd_momentum": (torch.optim.SGD, {"momentum": 0.9}),
        "sgd": (torch.optim.SGD, {"momentum": 0.0}),
    }[optimizer]
    kwargs = {**extra, "lr": lr, **kwargs}
    if precision in ("mixed", "mixed_fp32_grads", "mixed_fp32_buffer"):
        return MasterWeightOptimizer(params, cls, fp32_grads=precision != "mixed",
                                     after_backward=precision == "mixed_fp32_buffer", **kwargs)
    return cls(params, **kwargs)
