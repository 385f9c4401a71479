"""ZeRO from scratch over ``torch.distributed`` collectives (Chapter 2; Rajbhandari et al. 2020).

``ShardedOptimizer`` (stage 1: optimizer states), ``ShardedGradOptimizer`` (stage 2: and
gradients), ``FullyShardedModule`` (stage 3: and parameters), ``OffloadOptimizer``
(ZeRO-Offload, Ren et al. 2021), sharded checkpoints that load at any world size
(``sharded_state``), the shard arithmetic they share (``flat``) and the paper's formulas
(``analytic``). The data-parallel baselines ZeRO is measured against, ``DataParallelNaive`` and
``DataParallelBucketed``, are :mod:`labkit.data_parallel`.

``analytic`` imports no torch and is loaded at once; the mechanisms are loaded on first use.
"""

from .._lazy import lazy_exports
from .analytic import (STAGES, VOLUME_WEIGHT, OffloadSavings, analytic_comm_volume, comm_volume,
                       check_zero, offload_savings, padded_numel, shard_numel, step_comm_volume,
                       zero_bytes_per_param, zero_model_state_bytes)

__all__ = [
    "ShardedOptimizer", "ShardedGradOptimizer", "FullyShardedModule", "OffloadOptimizer",
    "INIT_SYNCS", "check_elementwise_optimizer",
    "save_sharded", "load_sharded", "verify_sharded", "CheckpointError",
    "shard_numel", "padded_numel", "shard_range", "FlatLayout",
    "zero_model_state_bytes", "zero_bytes_per_param", "STAGES", "VOLUME_WEIGHT", "comm_volume",
    "analytic_comm_volume", "OffloadSavings", "offload_savings", "step_comm_volume", "check_zero",
]

# the mechanisms (they need torch) load on first use, so that zero.analytic needs no torch
__getattr__, __dir__ = lazy_exports(__name__, {
    "..collectives": ("INIT_SYNCS",),
    ".flat": ("FlatLayout", "shard_range"),
    ".offload": ("OffloadOptimizer",),
    ".sharded_state": ("CheckpointError", "load_sharded", "save_sharded", "verify_sharded"),
    ".stage1": ("ShardedOptimizer", "check_elementwise_optimizer"),
    ".stage2": ("ShardedGradOptimizer",),
    ".stage3": ("FullyShardedModule",),
}, submodules=("comm",))
