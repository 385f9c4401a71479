"""Checkpointing policies as plans, and ``apply_checkpointing`` that puts a plan on a GPT.

A :class:`Plan` splits ``model.blocks`` into consecutive segments, each with a mode: ``"none"``
(keep every activation), ``"selective"`` (recompute the attention core only, Korthikanti et al.
2022) or ``"full"`` (keep the segment's input, recompute the segment in backward, Chen et al.
2016). A full segment of several blocks runs them all from its first block, whose ``forward``
is replaced; the other blocks of the segment then pass their input through. Parameter names
and ``state_dict`` are unchanged; :func:`remove_checkpointing` restores the plain forwards.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .function import checkpoint_scratch, checkpoint_torch

__all__ = ["MODES", "POLICIES", "IMPLS", "Plan", "make_plan", "apply_checkpointing", "remove_checkpointing"]

MODES = ("none", "selective", "full")
POLICIES = ("none", "full", "every_k", "sqrt", "selective", "budget")
IMPLS = ("scratch", "torch")
_MARK = "_labkit_checkpointed"


@dataclass(frozen=True)
class Plan:
    """Consecutive segments ``(mode, n_blocks)`` covering the blocks in order."""

    segments: tuple

    def __post_init__(self):
        for mode, n in self.segments:
            if mode not in MODES or not isinstance(n, int) or n < 1:
                raise ValueError(f"segment ({mode!r}, {n!r}): mode must be one of {list(MODES)}, n_blocks an int >= 1")
            if mode != "full" and n != 1:
                raise ValueError(f"segment ({mode!r}, {n}): only 'full' segments may span several blocks")

    @property
    def n_layer(self) -> int:
        return sum(n for _, n in self.segments)

    @property
    def modes(self) -> list[str]:
        """The mode of each block."""
        return [mode for mode, n in self.segments for _ in range(n)]

    def bounds(self):
        """(start, stop, mode) of each segment."""
        start = 0
        for mode, n in self.segments:
            yield start, start + n, mode
            start += n

    def __str__(self):
        """One letter a block, N(one), S(elective), F(ull); a full segment in brackets: ``N [FF] S``."""
        return " ".join("[" + "F" * n + "]" if m == "full" else m[0].upper() for m, n in self.segments)


def make_plan(policy: str, n_layer: int, k: int | None = None) -> Plan:
    """The plan of a named policy for ``n_layer`` blocks (``"budget"`` needs the planner).

    ``every_k`` recomputes blocks k, 2k, ... (1-based); ``sqrt`` cuts the blocks into segments of
    ceil(sqrt(n_layer)) blocks, keeping only each segment's input (Chen et al. 2016, Sec. 4.1).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is unknown; valid choices: {list(POLICIES)}")
    if not isinstance(n_layer, int) or n_layer < 1:
        raise ValueError(f"n_layer={n_layer!r} must be an int >= 1")
    if policy == "every_k":
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"k={k!r} must be an int >= 1 for policy='every_k'")
        return Plan(tuple(("full" if (i + 1) % k == 0 else "none", 1) for i in range(n_layer)))
    if k is not None:
        raise ValueError(f"k={k!r} is only used by policy='every_k', not policy={policy!r}")
    if policy == "budget":
        raise ValueError("policy='budget' is planned from a budget: use apply_checkpointing(..., budget=...)")
    if policy == "sqrt":
        size = math.isqrt(n_layer - 1) + 1  # ceil(sqrt(n_layer))
        return Plan(tuple(("full", min(size, n_layer - s)) for s in range(0, n_layer, size)))
    return Plan(tuple((policy, 1) for _ in range(n_layer)))


def _passthrough(x, *args, **kwargs):
    return x


def remove_checkpointing(model) -> None:
    """Undo :func:`apply_checkpointing`: every module gets its class's ``forward`` back."""
    for module in model.modules():
        if getattr(module, _MARK, False):
            del module.forward
            delattr(module, _MARK)


def _override(module, forward) -> None:
    module.forward = forward  # an instance attribute shadows the class's forward
    setattr(module, _MARK, True)


def apply_checkpointing(model, policy="full", *, k: int | None = None, budget: int | None = None,
                        batch_size: int | None = None, seq_len: int | None = None, impl: str = "scratch") -> Plan:
    """Checkpoint ``model.blocks`` in place by ``policy`` (a name or a :class:`Plan`); return the plan.

    Policies: ``none``, ``full``, ``every_k`` (with ``k``), ``sqrt``, ``selective``, ``budget``
    (``budget`` bytes for ``batch_size``, ``seq_len``, planned for the model's dtype, device and
    current train/eval mode by :func:`labkit.checkpoint.plan_for_budget`). ``impl``: ``"scratch"``
    (:class:`CheckpointFunction`, whose peaks the planner predicts) or ``"torch"``
    (``torch.utils.checkpoint``, non-reentrant). Reapplying replaces the old plan.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is unknown; valid choices: {list(IMPLS)}")
    blocks = list(model.blocks)
    if isinstance(policy, Plan):
        plan = policy
    elif policy == "budget":
        from .planner import plan_for_budget

        if budget is None or batch_size is None:
            raise ValueError(f"policy='budget' needs budget= and batch_size=, got budget={budget!r}, "
                             f"batch_size={batch_size!r}")
        param = next(model.parameters())
        plan = plan_for_budget(model.cfg, budget, batch_size, seq_len, dtype_bytes=param.element_size(),
                               device_type=param.device.type, training=model.training)
    else:
        if budget is not None:
            raise ValueError(f"budget={budget!r} is only used by policy='budget', not policy={policy!r}")
        plan = make_plan(policy, len(blocks), k)
    if plan.n_layer != len(blocks):
        raise ValueError(f"plan covers {plan.n_layer} blocks but the model has n_layer={len(blocks)}")
    remove_checkpointing(model)
    for start, stop, mode in plan.bounds():
        if mode == "selective":  # the attention core: scores, softmax, dropout, weighted sum
            core = blocks[start].attn.core
            _override(core, _checkpointed(impl, functools.partial(type(core).forward, core), []))
        elif mode == "full":  # the segment's input is kept, everything inside is recomputed
            segment = blocks[start:stop]
            params = [p for block in segment for p in block.parameters()]
            _override(segment[0], _checkpointed(impl, functools.partial(_run_segment, segment), params))
            for block in segment[1:]:
                _override(block, _passthrough)
    return plan


def _run_segment(segment, x, *args, **kwargs):
    """The class forwards of consecutive blocks: x -> block_n(... block_1(x, *args, **kwargs))."""
    x = type(segment[0]).forward(segment[0], x, *args, **kwargs)
    for block in segment[1:]:
        x = type(block).forward(block, x)
    return x


def _checkpointed(impl, fn, params):
    """A forward that calls ``fn`` through the checkpoint of ``impl``.

    A ``functools.partial``, not a closure: ``copy.deepcopy`` of the model then copies the modules
    and parameters it refers to, and the copy runs its own blocks, not the original's.
    """
    if impl == "scratch":
        return functools.partial(checkpoint_scratch, fn, params=params)
    return functools.partial(checkpoint_torch, fn)
