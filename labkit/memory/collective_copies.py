"""A collective run on copies of its tensors, so that the process group's threads never hold a
caller's storage (the memory meter runs every c10d operator through it).

gloo's worker thread lets go of a finished collective's tensors a moment after the rank resumes;
a meter that watches storages would count such a buffer as alive, now and then. Here the
process group only ever sees copies that no meter tracks: a caller's buffer counts exactly as
long as the caller keeps it (not while the group's own reference lingers).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["collective_on_copies"]

_POINT_TO_POINT = {"send", "recv_", "recv_any_source_", "barrier", "monitored_barrier_"}


def collective_on_copies(func, args, kwargs):
    """Run the c10d operator ``func`` on untracked copies of its tensors, wait for it, and write
    what it wrote back into the caller's tensors; return its outputs with the caller's tensors.

    The process group's worker thread then holds only the copies, so a caller's storage lives
    exactly as long as the caller keeps it. A send runs on a copy without waiting (its buffer is
    only read); a receive and a barrier run as they are (a receive writes when it is waited on).
    """
    name = func.overloadpacket.__name__
    if name in _POINT_TO_POINT:
        if name == "send":
            args = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, args)
        return func(*args, **kwargs)
    copy_of = {}  # id(copy) -> the caller's tensor

    def copy(t):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return t
        c = t.clone()
        copy_of[id(c)] = t
        return c

    cargs, ckwargs = tree_map(copy, args), tree_map(copy, kwargs)
    out = func(*cargs, **ckwargs)
    for work in tree_leaves(out):
        if hasattr(work, "wait") and not isinstance(work, torch.Tensor):
            work.wait()
    for c in tree_leaves(cargs[0]):  # every c10d collective writes its first argument
        orig = copy_of.get(id(c))
        if orig is not None:
            with torch.autograd._unsafe_preserve_version_counter(orig):  # the op bumped it already
                orig.copy_(c)
    return tree_map(lambda t: copy_of.get(id(t), t) if isinstance(t, torch.Tensor) else t, out)
