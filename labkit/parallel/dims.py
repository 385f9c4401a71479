"""The degrees of a composed run and the rank grid they make: :class:`ParallelDims`.

One axis order for all of labkit, outermost to innermost: ``("dp", "pp", "cp", "tp")``. Tensor
parallelism is innermost (consecutive ranks, inside a node: it all-reduces activations in the
critical path), context parallelism next to it (it exchanges keys and values every layer), the
pipeline next (point to point, one activation per micro-batch per stage boundary) and data
parallelism outermost (a gradient reduction a step, or ZeRO-2/3's per micro-batch). This is the
grid Chapter 6 draws, a ``DeviceMesh`` of shape (N_d, p, c, t): a replica's pipeline is one block
of ``t c p`` consecutive ranks.

Megatron-LM's default order, innermost first, is ``tp-cp-ep-dp-pp``: the data-parallel replicas of
a stage sit next to each other and the pipeline is outermost. torchtitan builds its mesh outermost
first as ``["pp", "dp_replicate", "dp_shard", "cp", "tp"]``, the same idea. All three keep t (and c)
inside a node; which of p and N_d crosses nodes first, and so whose traffic the network carries, is
a choice the cluster's topology decides, not the mathematics: every order trains the same model.

Importing this module imports no torch (the estimator in ``labkit.estimate`` reads a
``ParallelDims``'s four degrees); :meth:`ParallelDims.build_mesh` imports it when called.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

from ..validate import ArgumentError, check_int

__all__ = ["AXES", "MeshCoords", "ParallelDims"]

AXES = ("dp", "pp", "cp", "tp")  # outermost to innermost: tp's ranks are consecutive
MeshCoords = namedtuple("MeshCoords", AXES)  # one rank's index along each axis


@dataclass(frozen=True)
class ParallelDims:
    """Data, tensor, pipeline and context parallel degrees; their product is the world size.
    ``ep_size`` (expert parallelism) divides dp_size and adds no rank (:meth:`expert_groups`).

    ``ParallelDims(dp_size=2, tp_size=2, pp_size=2)`` is the 8-rank grid of Chapter 6. The mesh's
    axes are :data:`AXES`, outermost first; a degree of 1 keeps its axis (of size 1), so
    ``mesh.get_group("pp")`` exists whatever the degrees. ``cp_size`` is accepted and validated;
    what cannot use context parallelism yet refuses ``cp_size > 1`` (see :meth:`require_no_cp`).
    """

    dp_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1  # expert parallelism: groups of ep data-parallel ranks share their experts

    def __post_init__(self):
        for axis in AXES:
            check_int(f"{axis}_size", getattr(self, f"{axis}_size"), 1)
        check_int("ep_size", self.ep_size, 1)
        if self.dp_size % self.ep_size:
            raise ArgumentError(f"ep_size={self.ep_size} must divide dp_size={self.dp_size}: expert "
                                "parallelism splits the data-parallel ranks, the world size unchanged")

    def expert_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """(ep groups, expert replicas): global ranks, every group of each kind in one order.

        Expert parallelism is taken out of the data-parallel ranks, as Megatron-LM and torchtitan
        do: the mesh stays (dp, pp, cp, tp) and the world size is unchanged. Data-parallel index
        d = r · ep + j: ranks with the same r (and the same pp, cp, tp) form an ep group and hold
        all E experts between them; ranks with the same j hold the same experts (dp / ep of them),
        the replicas whose expert gradients are summed.
        """
        ep, reps = self.ep_size, self.dp_size // self.ep_size
        groups, replicas = [], []
        for pp in range(self.pp_size):
            for cp in range(self.cp_size):
                for tp in range(self.tp_size):
                    at = lambda d: self.rank_of(dp=d, pp=pp, cp=cp, tp=tp)  # noqa: E731
                    groups += [[at(r * ep + j) for j in range(ep)] for r in range(reps)]
                    replicas += [[at(r * ep + j) for r in range(reps)] for j in range(ep)]
        return groups, replicas

    @property
    def sizes(self) -> tuple[int, ...]:
        """The degrees in mesh order (outermost first): (dp_size, pp_size, cp_size, tp_size)."""
        return tuple(getattr(self, f"{axis}_size") for axis in AXES)

    @property
    def world_size(self) -> int:
        """dp_size x tp_size x pp_size x cp_size: the ranks the grid needs."""
        return self.dp_size * self.tp_size * self.pp_size * self.cp_size

    def _describe(self) -> str:
        return " x ".join(f"{axis}_size={getattr(self, f'{axis}_size')}" for axis in AXES)

    def check_world_size(self, world_size: int) -> None:
        """Raise a ValueError naming the degrees unless their product is ``world_size``."""
        check_int("world_size", world_size, 1)
        if world_size != self.world_size:
            raise ArgumentError(f"{self._describe()} = {self.world_size} ranks, but world_size={world_size}: "
                                "the degrees' product must equal the number of ranks")

    def require_no_cp(self, what: str) -> None:
        """Refuse ``cp_size > 1`` for ``what``, which has no context-parallel path yet."""
        if self.cp_size != 1:
            raise ArgumentError(f"cp_size={self.cp_size}: {what} does not support context parallelism yet; "
                                "use cp_size=1")

    def coords(self, rank: int) -> MeshCoords:
        """``rank``'s index along each axis, ``MeshCoords(dp, pp, cp, tp)``, as the mesh places it."""
        check_int("rank", rank, 0, self.world_size - 1)
        out = []
        for size in reversed(self.sizes):  # innermost varies fastest
            rank, index = divmod(rank, size)
            out.append(index)
        return MeshCoords(*reversed(out))

    def rank_of(self, **coords: int) -> int:
        """The global rank at the given coordinates (axes left out are 0): the inverse of :meth:`coords`."""
        unknown = set(coords) - set(AXES)
        if unknown:
            raise ArgumentError(f"unknown mesh axes {sorted(unknown)}; valid axes: {list(AXES)}")
        rank = 0
        for axis, size in zip(AXES, self.sizes):
            rank = rank * size + check_int(axis, coords.get(axis, 0), 0, size - 1)
        return rank

    def build_mesh(self, device_type: str):
        """The torch ``DeviceMesh`` of shape (dp, pp, cp, tp) named :data:`AXES`, over the default group.

        Call it on every rank after ``torch.distributed`` is initialised; the world's size must be
        :attr:`world_size`. ``mesh.get_group(axis)`` is this rank's group along ``axis``.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build_mesh needs torch.distributed initialised on every rank "
                               "(labkit.dist.launch does it)")
        self.check_world_size(dist.get_world_size())
        return init_device_mesh(device_type, self.sizes, mesh_dim_names=AXES)
