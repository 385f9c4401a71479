"""Which tensors a step's objects hold: an optimizer's, and an operator's arguments' or outputs'."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["optimizer_tensors", "strided_tensors"]


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor an optimizer owns: its per-parameter state and, for optimizers that keep
    their own copies of the parameters (fp32 master weights), those copies."""
    if optimizer is None:
        return []
    if hasattr(optimizer, "state_tensors"):
        return list(optimizer.state_tensors())
    return [t for t in tree_leaves(list(optimizer.state.values())) if isinstance(t, torch.Tensor)]


def strided_tensors(obj, found=None) -> list[torch.Tensor]:
    """The strided tensors in an operator's arguments or outputs (nested tuples, lists and dicts of
    them, as the dispatcher passes them): what ``tree_leaves`` finds there, at a quarter of its cost
    per operator, which the meter pays on every one."""
    found = [] if found is None else found
    if isinstance(obj, torch.Tensor):
        if obj.layout == torch.strided:
            found.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            strided_tensors(item, found)
    elif isinstance(obj, dict):
        for item in obj.values():
            strided_tensors(item, found)
    return found
