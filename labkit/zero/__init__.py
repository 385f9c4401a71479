"""ZeRO from scratch over ``torch.distributed`` collectives (Chapter 2; Rajbhandari et al. 2020).

``ShardedOptimizer`` (stage 1: optimizer states), ``ShardedGradOptimizer`` (stage 2: and
gradients), ``FullyShardedModule`` (stage 3: and parameters), ``OffloadOptimizer``
(ZeRO-Offload, Ren et al. 2021), sharded checkpoints that load at any world size
(``sharded_state``), the shard arithmetic they share (``flat``) and the paper's formulas
(``analytic``). The data-parallel baselines ZeRO is measured against, ``DataParallelNaive`` and
``DataParallelBucketed``, are :mod:`labkit.data_parallel`.
"""

from .analytic import (VOLUME_WEIGHT, OffloadSavings, analytic_comm_volume, comm_volume, offload_savings,
                       zero_model_state_bytes)
from ..collectives import INIT_SYNCS
from .flat import FlatLayout, padded_numel, shard_numel, shard_range
from .offload import OffloadOptimizer
from .sharded_state import CheckpointError, load_sharded, save_sharded, verify_sharded
from .stage1 import ShardedOptimizer, check_elementwise_optimizer
from .stage2 import ShardedGradOptimizer
from .stage3 import FullyShardedModule

__all__ = [
    "ShardedOptimizer", "ShardedGradOptimizer", "FullyShardedModule", "OffloadOptimizer",
    "INIT_SYNCS", "check_elementwise_optimizer",
    "save_sharded", "load_sharded", "verify_sharded", "CheckpointError",
    "shard_numel", "padded_numel", "shard_range", "FlatLayout",
    "zero_model_state_bytes", "VOLUME_WEIGHT", "comm_volume", "analytic_comm_volume",
    "OffloadSavings", "offload_savings",
]
