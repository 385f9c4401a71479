"""The references Chapter 5's runs compare tensor parallelism with, and how they compare.

An equivalence is judged against round-off measured in the same run: the unsharded model is run
in float32 and in float64; :func:`roundoff` gives the sharded result's error against float64 and
the floor, the unsharded float32 result's own error against it. A check then asks for the error
within a small multiple of the floor, on any machine, where a bug is orders of magnitude larger.
"""

from __future__ import annotations

import copy

import torch

from ..data import get_batch, load_corpus
from ..tensor_parallel import apply_tensor_parallel
from ..validate import check_int

__all__ = ["make_batch", "reference_step", "sharded_like", "sharded_copy", "named_tensors", "roundoff",
           "roundoff_named", "check_mesh"]

_EPS32 = torch.finfo(torch.float32).eps


def check_mesh(world_size, tp_sizes=(), dp_size=None, batch_size=None) -> tuple:
    """``tp_sizes`` as a tuple, each t dividing ``world_size`` (the mesh is (world_size / t, t)), and
    ``dp_size`` dividing both ``world_size`` and ``batch_size`` (equal rows per data-parallel rank),
    or a ValueError naming the argument, before any rank builds a mesh."""
    check_int("world_size", world_size, minimum=1)
    sizes = tuple(tp_sizes)
    for t in sizes:
        check_int("tp_size", t, minimum=1, maximum=world_size)
        if world_size % t:
            raise ValueError(f"tp_size={t} must divide world_size={world_size}: the mesh is (world_size / t, t)")
    if dp_size is not None:
        check_int("dp_size", dp_size, minimum=1, maximum=world_size)
        for name, n in (("world_size", world_size), ("batch_size", batch_size)):
            if n is not None and check_int(name, n, minimum=1) % dp_size:
                raise ValueError(f"dp_size={dp_size} must divide {name}={n}: every data-parallel rank takes "
                                 "an equal share, or their mean is not the whole batch's")
    return sizes


def roundoff(ours, ref32, ref64) -> tuple[float, float]:
    """(max |ours - ref64|, floor): the floor is max |ref32 - ref64|, the float32 round-off of the
    unsharded computation measured in this run, and at least float32's epsilon times max |ref64|."""
    ref64 = torch.as_tensor(ref64).double()
    err = (torch.as_tensor(ours).double() - ref64).abs().max().item()
    floor = (torch.as_tensor(ref32).double() - ref64).abs().max().item()
    return err, max(floor, _EPS32 * ref64.abs().max().item())


def roundoff_named(ours: dict, ref32: dict, ref64: dict) -> tuple[float, float]:
    """:func:`roundoff` of every named tensor, each relative to its own max |ref64|; the largest of each."""
    pairs = []
    for n in ref64:
        scale = ref64[n].abs().max().item() or 1.0
        err, floor = roundoff(ours[n], ref32[n], ref64[n])
        pairs.append((err / scale, floor / scale))
    return max(e for e, _ in pairs), max(f for _, f in pairs)


def make_batch(cfg, batch_size: int, seed: int = 0, device="cpu"):
    """(x, y) (B, T) int64 from the shipped corpus, the same on every rank for a seed."""
    return get_batch(load_corpus(), batch_size, cfg.seq_len, generator=torch.Generator().manual_seed(seed),
                     device=device)


def reference_step(model, x, y):
    """Logits, loss and gradients of the unsharded model (gradients left in ``.grad``)."""
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(x)  # (B, T, V)
    loss = model(x, y)
    loss.backward()
    return logits, loss.detach()


def sharded_like(full_model, group, sequence_parallel: bool, grads: bool = False) -> dict:
    """name -> this rank's shard of each parameter (or of its gradient) of ``full_model``, cut
    by the same ``apply_tensor_parallel`` whose output is being checked (on the CPU)."""
    twin = copy.deepcopy(full_model)
    if grads:
        for p, q in zip(twin.parameters(), full_model.parameters()):
            p.data = q.grad.detach().clone()
    # init_sync=None: each rank computed this reference itself (on a GPU, not always bit for bit)
    apply_tensor_parallel(twin, group, sequence_parallel, init_sync=None)
    return {n: p.detach().cpu() for n, p in twin.named_parameters()}


def sharded_copy(full, group, sequence_parallel, shard=True):
    """A copy of ``full`` without its gradients, sharded over ``group`` (or left whole)."""
    model = copy.deepcopy(full)
    model.zero_grad(set_to_none=True)
    return apply_tensor_parallel(model, group, sequence_parallel) if shard else model


def named_tensors(model, grads: bool = False) -> dict:
    """name -> this rank's parameters (or their gradients), on the CPU."""
    return {n: (p.grad if grads else p).detach().cpu() for n, p in model.named_parameters()}
