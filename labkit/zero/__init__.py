"""ZeRO from scratch over ``torch.distributed`` collectives (Chapter 2; Rajbhandari et al. 2020).

``ShardedOptimizer`` (stage 1: optimizer states), ``ShardedGradOptimizer`` (stage 2: and
gradients), ``FullyShardedModule`` (stage 3: and parameters), ``OffloadOptimizer``
(ZeRO-Offload, Ren et al. 2021), sharded checkpoints that load at any world size
(``sharded_state``), the shard arithmetic they share (``flat``) and the paper's formulas
(``analytic``). The data-parallel baselines ZeRO is measured against, ``DataParallelNaive`` and
``DataParallelBucketed``, are :mod:`labkit.data_parallel`.

``analytic`` imports no torch and is loaded at once; the mechanisms are loaded on first use.
"""

from .analytic import (STAGES, VOLUME_WEIGHT, OffloadSavings, analytic_comm_volume, comm_volume,
                       offload_savings, padded_numel, shard_numel, zero_bytes_per_param,
                       zero_model_state_bytes)

__all__ = [
    "ShardedOptimizer", "ShardedGradOptimizer", "FullyShardedModule", "OffloadOptimizer",
    "INIT_SYNCS", "check_elementwise_optimizer",
    "save_sharded", "load_sharded", "verify_sharded", "CheckpointError",
    "shard_numel", "padded_numel", "shard_range", "FlatLayout",
    "zero_model_state_bytes", "zero_bytes_per_param", "STAGES", "VOLUME_WEIGHT", "comm_volume",
    "analytic_comm_volume", "OffloadSavings", "offload_savings",
]
_SUBMODULES = ("comm", "flat", "offload", "sharded_state", "stage1", "stage2", "stage3")


def _load() -> dict:
    """Import the mechanisms (they need torch) and return their exports."""
    from ..collectives import INIT_SYNCS
    from .flat import FlatLayout, shard_range
    from .offload import OffloadOptimizer
    from .sharded_state import CheckpointError, load_sharded, save_sharded, verify_sharded
    from .stage1 import ShardedOptimizer, check_elementwise_optimizer
    from .stage2 import ShardedGradOptimizer
    from .stage3 import FullyShardedModule
    return locals()


def __getattr__(name: str):
    """Load the mechanisms (and submodules) on first use, so ``zero.analytic`` needs no torch."""
    if name in __all__:
        exports = _load()
        globals().update(exports)  # as the eager imports did: an export wins over a submodule of its name
        return exports[name]
    if name in _SUBMODULES:
        globals().update(_load())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
