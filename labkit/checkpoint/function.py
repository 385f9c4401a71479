"""Activation checkpointing from scratch: an ``autograd.Function`` that forgets and recomputes.

Forward runs ``fn`` without building a graph and saves only its tensor inputs (Chen et al. 2016,
a checkpoint). Backward restores the RNG state of the forward, runs ``fn`` again with gradients
on, and differentiates that fresh graph with ``torch.autograd.grad``. The parameters ``fn`` uses
are inputs of the Function too: the node then exists even when no input requires grad, and
their gradients flow back through the ordinary graph (so ``torch.autograd.grad`` works outside).
``checkpoint_torch`` is the reference: ``torch.utils.checkpoint`` in its non-reentrant mode.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["CheckpointFunction", "checkpoint_scratch", "checkpoint_torch", "RNGState"]


class RNGState:
    """The CPU generator's state and that of every CUDA device ``tensors`` live on."""

    def __init__(self, tensors):
        self.cpu = torch.get_rng_state()
        self.cuda_devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]

    @contextlib.contextmanager
    def restored(self):
        """Run a block from the saved state; the generators are put back as they were afterwards."""
        with torch.random.fork_rng(devices=self.cuda_devices):
            torch.set_rng_state(self.cpu)
            for d, state in zip(self.cuda_devices, self.cuda):
                torch.cuda.set_rng_state(state, d)
            yield


class CheckpointFunction(torch.autograd.Function):
    """``apply(run, n_inputs, preserve_rng_state, *inputs, *params)``: ``run(*inputs)``, checkpointed.

    ``inputs`` are the tensor leaves of the call's arguments, ``params`` the parameters ``run``
    reads. Saved for backward: ``inputs`` only. Returns ``run``'s tensor outputs as a tuple.
    """

    @staticmethod
    def forward(ctx, run, n_inputs, preserve_rng_state, *tensors):
        inputs, params = tensors[:n_inputs], tensors[n_inputs:]
        ctx.run, ctx.params = run, params
        ctx.rng = RNGState(inputs) if preserve_rng_state else None
        device = next((t.device.type for t in inputs), "cpu")
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(*inputs)  # the checkpoint: nothing inside run is kept
        with torch.no_grad():  # autograd.Function.forward already runs without a graph
            outputs = run(*inputs)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        device, autocast_on, autocast_dtype = ctx.autocast
        rng = ctx.rng.restored() if ctx.rng is not None else contextlib.nullcontext()
        with rng, torch.enable_grad(), torch.autocast(device, dtype=autocast_dtype, enabled=autocast_on):
            # Recompute from views of the inputs: no copy, and module backward hooks (e.g.
            # FlopCounterMode's) see non-leaf tensors, which autograd.grad allows them to watch.
            outputs = ctx.run(*[t.view_as(t) for t in inputs])  # the same dropout masks as forward
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad and g is not None]
        outs, gouts = [o for o, _ in pairs], [g for _, g in pairs]
        wrt = [t for t in list(inputs) + list(ctx.params) if t.requires_grad]
        hidden = _hidden_leaves(outs, wrt)  # parameters fn reads that nobody passed in
        grads = iter(torch.autograd.grad(outs, wrt, gouts, allow_unused=True, retain_graph=bool(hidden))
                     if pairs and wrt else [None] * len(wrt))
        by_input = [next(grads) if t.requires_grad else None for t in list(inputs) + list(ctx.params)]
        if hidden:  # into their .grad, as torch.utils.checkpoint does (their hooks run as usual)
            torch.autograd.backward(outs, gouts, inputs=hidden)
        return (None, None, None, *by_input)


def _hidden_leaves(outputs, known) -> list:
    """Leaves of the recomputed graph that require grad and are not in ``known``: parameters a
    closure or a ``functools.partial`` reads without passing them in."""
    seen, found, known_ids = set(), [], {id(t) for t in known}
    todo = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node holds its leaf
        if leaf is not None and id(leaf) not in known_ids and id(leaf) not in {id(f) for f in found}:
            found.append(leaf)
        todo.extend(n for n, _ in node.next_functions)
    return found


def _module_params(fn):
    """The parameters a call of ``fn`` reads when ``fn`` is a module or a module's bound method."""
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    return list(owner.parameters()) if isinstance(owner, torch.nn.Module) else []


def checkpoint_scratch(fn, *args, params=None, preserve_rng_state: bool = True, **kwargs):
    """``fn(*args, **kwargs)``, keeping only its tensor arguments for backward and recomputing the rest.

    ``params``: the parameters ``fn`` reads (default: those of ``fn`` when it is a module or a
    module's method); others that ``fn`` reads (a closure's, a ``functools.partial``'s) get their
    gradients into ``.grad`` in backward, as with ``torch.utils.checkpoint``. Keyword arguments, non-tensor arguments and inputs without grad are allowed.
    Under ``torch.no_grad()`` this is a plain call.
    """
    if params is None:
        params = _module_params(fn)
    params = [p for p in params if p.requires_grad]
    leaves, spec = tree_flatten((args, kwargs))
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    tensors = [x for x, t in zip(leaves, is_tensor) if t]
    template = [None if t else x for x, t in zip(leaves, is_tensor)]  # no references to inputs
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors + params):
        return fn(*args, **kwargs)  # no graph would be built: nothing to checkpoint
    out_spec = []

    def run(*tensor_inputs):
        it = iter(tensor_inputs)
        call_args, call_kwargs = tree_unflatten([next(it) if t else x for x, t in zip(template, is_tensor)], spec)
        out_leaves, out_tree = tree_flatten(fn(*call_args, **call_kwargs))
        out_spec[:] = [out_tree]
        bad = [type(o).__name__ for o in out_leaves if not isinstance(o, torch.Tensor)]
        if bad:
            raise TypeError(f"checkpointed fn must return tensors only, got {bad}")
        return out_leaves

    outputs = CheckpointFunction.apply(run, len(tensors), preserve_rng_state, *tensors, *params)
    return tree_unflatten(list(outputs), out_spec[0])


def checkpoint_torch(fn, *args, preserve_rng_state: bool = True, **kwargs):
    """The reference: ``torch.utils.checkpoint.checkpoint`` with ``use_reentrant=False``."""
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False,
                                       preserve_rng_state=preserve_rng_state, **kwargs)
