"""``apply_checkpointing`` puts a :class:`~labkit.checkpoint.plan.Plan` on a GPT.

The plan splits ``model.blocks`` into segments whose mode is ``"none"``, ``"selective"`` or
``"full"`` (see :mod:`labkit.checkpoint.plan`). A full segment of several blocks runs them all from its first block, whose ``forward``
is replaced; the other blocks of the segment then pass their input through. Parameter names
and ``state_dict`` are unchanged; :func:`remove_checkpointing` restores the plain forwards.
"""

from __future__ import annotations

import functools

import torch.nn as nn

from ..moe.layer import moe_layers
from ..validate import check_choice, check_int
from .function import checkpoint_scratch, checkpoint_torch
from .plan import Plan, make_plan
from .planner import plan_for_budget

__all__ = ["IMPLS", "apply_checkpointing", "remove_checkpointing"]

IMPLS = ("scratch", "torch")
_MARK = "_labkit_checkpointed"


def _blocks(model) -> list:
    """``model.blocks`` as a list of modules, or a TypeError saying what a model must have."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or not all(isinstance(b, nn.Module) for b in blocks):
        raise TypeError(f"apply_checkpointing needs a model whose .blocks is an nn.ModuleList of blocks "
                        f"(as labkit.model.GPT has); got a {type(model).__name__} with "
                        f".blocks={type(blocks).__name__ if blocks is not None else 'missing'}")
    return list(blocks)


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
                        batch_size: int | None = None, seq_len: int | None = None, impl: str = "scratch",
                        sharded=None) -> Plan:
    """Checkpoint ``model.blocks`` in place by ``policy`` (a name or a :class:`Plan`); return the plan.

    Policies: ``none``, ``full``, ``every_k`` (with ``k``), ``sqrt``, ``selective``, ``budget``
    (``budget`` bytes for ``batch_size``, ``seq_len``, planned for the model's dtype, device and
    current train/eval mode by :func:`labkit.checkpoint.plan_for_budget`). ``impl``: ``"scratch"``
    (:class:`CheckpointFunction`, whose peaks the planner predicts) or ``"torch"``
    (``torch.utils.checkpoint``, non-reentrant). Reapplying replaces the old plan. Both families:
    a full segment recomputes every part of its blocks (LayerNorm or RMSNorm, GELU MLP or SwiGLU's
    gate, up and down, rotary positions); ``selective`` the attention core, whose inputs are q and k
    already rotated and the key-value heads already repeated for grouped-query attention.
    ``budget`` plans from GPT-2's block's byte formulas and refuses another block. ``sharded``:
    blocks whose parameters are gathered around each call (ZeRO-3's ``FullyShardedModule``, or
    any object with its ``gathered(block)`` and ``unit_parameters(block)``); a full segment then
    runs each block inside ``gathered``, forward and recomputation alike.
    """
    check_choice("impl", impl, IMPLS)
    blocks = _blocks(model)
    if isinstance(policy, Plan):
        plan = policy
    elif policy == "budget":
        if budget is None or batch_size is None:
            raise ValueError(f"policy='budget' needs budget= and batch_size=, got budget={budget!r}, "
                             f"batch_size={batch_size!r}")
        check_int("batch_size", batch_size, 1)
        param = next(model.parameters())
        plan = plan_for_budget(model.cfg, budget, batch_size, seq_len, dtype_bytes=param.element_size(),
                               device_type=param.device.type, training=model.training)
    else:
        if budget is not None:
            raise ValueError(f"budget={budget!r} is only used by policy='budget', not policy={policy!r}")
        plan = make_plan(policy, len(blocks), k)
    if plan.n_layer != len(blocks):
        raise ValueError(f"plan covers {plan.n_layer} blocks but the model has n_layer={len(blocks)}")
    if impl == "torch" and any(mode == "full" for *_, mode in plan.bounds()) and moe_layers(model):
        raise ValueError("impl='torch' recomputes a full segment with gradients on, and a MoE layer counts its "
                         "experts' load in each forward that builds a graph (it would count twice); use "
                         "impl='scratch', whose first pass builds none")
    remove_checkpointing(model)
    for start, stop, mode in plan.bounds():
        if mode == "selective":  # the attention core: scores, softmax, dropout, weighted sum
            core = getattr(getattr(blocks[start], "attn", None), "core", None)
            if not isinstance(core, nn.Module):
                raise TypeError(f"selective checkpointing recomputes block.attn.core, which block {start} "
                                f"({type(blocks[start]).__name__}) does not have")
            _override(core, _checkpointed(impl, functools.partial(type(core).forward, core), []))
        elif mode == "full":  # the segment's input is kept, everything inside is recomputed
            segment = blocks[start:stop]
            if sharded is None:
                params, run = [p for block in segment for p in block.parameters()], _run_segment
            else:  # the recomputation gathers each block's parameters again, as its forward did
                params = [p for block in segment for p in sharded.unit_parameters(block)]
                run = functools.partial(_run_segment_gathered, sharded)
            _override(segment[0], _checkpointed(impl, functools.partial(run, segment), params))
            for block in segment[1:]:
                _override(block, _passthrough)
    return plan


def _run_segment(segment, x, *args, **kwargs):
    """The class forwards of consecutive blocks: x -> block_n(... block_1(x, *args, **kwargs)).

    Every block of a segment takes the first one's arguments: a model passes each block the same
    ones (context parallelism's ring attention and global positions), and dropping them would run
    the later blocks' attention on the shard alone."""
    for block in segment:
        x = type(block).forward(block, x, *args, **kwargs)
    return x


def _run_segment_gathered(sharded, segment, x, *args, **kwargs):
    """:func:`_run_segment` with each block's parameters gathered around its forward."""
    for block in segment:
        with sharded.gathered(block):
            x = type(block).forward(block, x, *args, **kwargs)
    return x


def _checkpointed(impl, fn, params):
    """A forward that calls ``fn`` through the checkpoint of ``impl``.

    A ``functools.partial``, not a closure: ``copy.deepcopy`` of the model then copies the modules
    and parameters it refers to, and the copy runs its own blocks, not the original's.
    """
    if impl == "scratch":
        return functools.partial(checkpoint_scratch, fn, params=params)
    return functools.partial(checkpoint_torch, fn)
