"""ZeRO stage 3: the parameters are sharded too, and gathered only while they are needed.

``FullyShardedModule(module, unit_types=(Block,))`` splits the model into units: every module
of ``unit_types`` owns the parameters of its subtree, the root owns the rest (and every
parameter that two units share, such as tied embeddings). Each unit is flattened, padded and
sharded; its full parameters are all-gathered just before its forward and freed right after,
all-gathered again when backward first needs them, and their gradients are reduce-scattered
(Rajbhandari et al. 2020, Section 5.3: P_os+g+p, 16Ψ/N_d bytes, 3Ψ communication).
Backward finds the parameters through saved-tensor hooks: what autograd saves of a gathered
parameter is a handle, and unpacking it gathers the unit again.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..collectives import FinishAfterBackward, all_gather_flat, check_init_sync, sync_initial_state
from .unit import Handle as _Handle
from .unit import Unit as _Unit

__all__ = ["FullyShardedModule"]

_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16)


def _unit_predicate(unit_types):
    if callable(unit_types) and not isinstance(unit_types, type):
        return unit_types
    types = (unit_types,) if isinstance(unit_types, type) else tuple(unit_types)
    if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
        raise TypeError(f"unit_types={unit_types!r} must be nn.Module classes or a predicate module -> bool")
    return lambda m: isinstance(m, types)


def _own_groups(module, by_unit, unit_groups, group, init_sync) -> dict:
    """{unit name: (group, gradient divisor)} of the units ``unit_groups`` shards elsewhere; every
    unit's parameters synced (``init_sync``) over the group it is sharded over, buffers over ``group``."""
    own = {n: unit_groups(module.get_submodule(n)) for n in by_unit if n} if unit_groups else {}
    own = {n: g for n, g in own.items() if g is not None}
    sync_initial_state([m for n, ms in by_unit.items() if n not in own for m in ms], module.named_buffers(),
                       group=group, init_sync=init_sync)
    for n, (g, _) in own.items():  # parameters that differ across ``group``: synced over their own
        sync_initial_state(by_unit[n], group=g, init_sync=init_sync)
    return own


class FullyShardedModule(nn.Module):
    """ZeRO stage 3 around any ``nn.Module``; its ``parameters()`` are this rank's shards.

    ``compute_dtype`` (``torch.float16``/``torch.bfloat16``) gathers, computes and
    reduce-scatters in 16 bits while the shards stay fp32 master weights. Build the optimizer
    on ``parameters()``; gradients are complete after backward (``finish_grad_sync`` runs by
    itself at its end). ``full_state_dict()`` gathers a plain state dict of the wrapped module.
    ``unit_groups(module)``: None, or (group, divisor) to shard that unit over another group, its
    gradient summed there and divided by ``divisor`` (expert parallelism's experts).
    """

    def __init__(self, module: nn.Module, *, group=None, unit_types=(), compute_dtype=None,
                 init_sync: str = "broadcast", unit_groups=None):
        super().__init__()
        if compute_dtype not in _DTYPES:
            raise ValueError(f"compute_dtype={compute_dtype!r} must be one of {list(_DTYPES)}")
        is_unit = _unit_predicate(unit_types)
        check_init_sync(init_sync)
        self.group, self.compute_dtype = group, compute_dtype
        self.world_size = dist.get_world_size(group)
        named = list(module.named_parameters())
        fqn_of = {id(p): fqn for fqn, p in named}  # a tied parameter answers to its first name
        self._state_plan = []  # (key, fqn of a parameter) or (key, (module, buffer name))
        for key, value in module.state_dict(keep_vars=True).items():
            if id(value) in fqn_of:
                self._state_plan.append((key, fqn_of[id(value)]))
            else:
                prefix, _, attr = key.rpartition(".")
                self._state_plan.append((key, (module.get_submodule(prefix), attr)))
        self._live = {}  # storage address of a unit's gathered parameters -> the unit, while gathered
        self._after_backward = FinishAfterBackward(self.finish_grad_sync)

        unit_of = {}  # id(module) -> name of its nearest enclosing unit ("" is the root)

        def walk(mod, prefix, current):
            if prefix and is_unit(mod):
                current = prefix
            unit_of.setdefault(id(mod), current)
            for child_name, child in mod._modules.items():
                if child is not None:
                    walk(child, f"{prefix}.{child_name}" if prefix else child_name, current)
        walk(module, "", "")

        refs, units_using = {}, {}  # id(param) -> [(module, attr)], set of unit names
        for _, mod in module.named_modules(remove_duplicate=False):
            for attr, p in mod._parameters.items():
                if p is not None and (mod, attr) not in refs.setdefault(id(p), []):
                    refs[id(p)].append((mod, attr))
                    units_using.setdefault(id(p), set()).add(unit_of[id(mod)])
        by_unit = {}  # unit name -> [(fqn, param)], shared parameters go to the root
        for fqn, p in named:
            owners = units_using[id(p)]
            by_unit.setdefault(owners.pop() if len(owners) == 1 else "", []).append((fqn, p))
        own = _own_groups(module, by_unit, unit_groups, group, init_sync)
        self._units, slices = [], []
        for name, members in by_unit.items():
            g, divisor = own.get(name, (group, None))
            unit = _Unit(name, members, [refs[id(p)] for _, p in members], g, compute_dtype,
                         self._after_backward, divisor)
            self._units.append(unit)
            slices += unit.slices
            for module_ref, attr in (r for _, p in members for r in refs[id(p)]):
                del module_ref._parameters[attr]
                module_ref.__dict__[attr] = None
        self._root = next((u for u in self._units if u.name == ""), None)
        self._unit_of_module = self._hook_units(module)  # id(a unit's module) -> the unit
        self.module = module
        self.shards = nn.ParameterList(slices)

    def _hook_units(self, module) -> dict:
        """Gather each unit around its module's forward; {id(module): unit}."""
        out = {}
        for unit in self._units:
            if unit.name:
                mod = module.get_submodule(unit.name)
                out[id(mod)] = unit
                mod.register_forward_pre_hook(lambda m, args, unit=unit: self._enter(unit))
                mod.register_forward_hook(lambda m, args, out, unit=unit: self._leave(unit))
        return out

    # -- forward and backward ---------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.compute_dtype is not None:  # floating inputs enter in the compute dtype
            cast = lambda t: t.to(self.compute_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            if self._root is not None:
                self._enter(self._root)
            try:
                return self.module(*args, **kwargs)
            except BaseException:  # a unit whose forward raised never reached its release hook
                self._release_all()
                raise
            finally:
                if self._root is not None and self._root.depth:
                    self._leave(self._root)

    def _release_all(self) -> None:
        for unit in self._units:
            if unit.depth:
                unit.depth = 0
                unit.post_forward()
        self._live = {}

    def _enter(self, unit):
        unit.depth += 1
        if unit.depth == 1:  # inside an enclosing call (its hook, around a checkpointed forward): gathered
            self._live[unit.pre_forward()] = unit

    def _leave(self, unit):
        unit.depth -= 1
        if unit.depth == 0:
            unit.post_forward()
            self._live = {ptr: u for ptr, u in self._live.items() if u is not unit}

    def _unit(self, module):
        unit = self._unit_of_module.get(id(module))
        if unit is None:
            raise ValueError(f"module ({type(module).__name__}) is not one of this FullyShardedModule's units")
        return unit

    @contextlib.contextmanager
    def gathered(self, module):
        """The unit ``module`` roots gathered onto its modules for the block (under grad mode
        through the gather's autograd node: the gradients reduce-scatter to the shards), then freed.
        A recomputed forward (activation checkpointing) runs the unit's class forward without its
        hooks: it gathers the unit again so."""
        unit = self._unit(module)
        self._enter(unit)
        try:
            yield
        finally:
            self._leave(unit)

    def is_unit(self, module) -> bool:
        """Whether ``module`` roots one of this wrapper's units (not the root's)."""
        return id(module) in self._unit_of_module

    def unit_parameters(self, module) -> list:
        """This rank's shard parameters of the unit ``module`` roots: the leaves its gradients reach."""
        return list(self._unit(module).slices)

    def _pack(self, t):
        try:
            unit = self._live.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a tensor without storage
            return t
        return t if unit is None else _Handle(unit, t)

    def _unpack(self, saved):
        if not isinstance(saved, _Handle):
            return saved
        return saved.unit.full_for_backward().as_strided(saved.size, saved.stride, saved.offset)

    def finish_grad_sync(self) -> None:
        """Wait for every reduce-scatter, set the shards' gradients, free what backward gathered."""
        for unit in self._units:
            unit.finish()

    # -- what the lab, the optimizer and the checkpoints read -------------------------------
    def unit_numels(self) -> list[int]:
        """Ψ_u of each unit, before padding."""
        return [u.layout.numel for u in self._units]

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The wrapped module's ``state_dict()``, parameters gathered in full (every rank)."""
        values = {}
        for unit in self._units:
            full = all_gather_flat(unit.shard, unit.world_size, unit.group)
            for name, view in zip(unit.names, unit.layout.views(full)):
                values[name] = view.clone()
        return {key: values[src] if isinstance(src, str) else getattr(*src).detach().clone()
                for key, src in self._state_plan}

    def shard_entries(self):
        """(key, shape, (a, b), slice) for every parameter, unit by unit."""
        return [(name, shape, bounds, s) for u in self._units
                for name, shape, bounds, s in zip(u.names, u.layout.shapes, u.bounds, u.slices)]

    @torch.no_grad()
    def load_entry_values(self, values: dict) -> None:
        """Set this rank's shards from full flat values keyed like the entries."""
        for u in self._units:
            for name, (a, b), s in zip(u.names, u.bounds, u.slices):
                s.copy_(values[name][a:b])
