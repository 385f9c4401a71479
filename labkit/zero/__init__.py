"""ZeRO from scratch over ``torch.distributed`` collectives (Chapter 2).

``ShardedOptimizer`` (stage 1: optimizer states), ``ShardedGradOptimizer`` (stage 2: and
gradients), ``FullyShardedModule`` (stage 3: and parameters), ``OffloadOptimizer``
(ZeRO-Offload), the data-parallel baselines ``DataParallelNaive`` and ``DataParallelBucketed``,
sharded checkpoints that load at any world size, and the shard arithmetic they share.
"""

from .checkpoint import CheckpointError, load_sharded, save_sharded, verify_sharded
from .comm import analytic_comm_volume, check_same_across_ranks, comm_volume
from .ddp import DataParallelBucketed, DataParallelNaive
from .flat import FlatLayout, padded_numel, shard_numel, shard_range
from .offload import OffloadOptimizer, offload_savings
from .stage1 import ShardedOptimizer, check_elementwise_optimizer
from .stage2 import ShardedGradOptimizer
from .stage3 import FullyShardedModule

__all__ = [
    "ShardedOptimizer", "ShardedGradOptimizer", "FullyShardedModule", "OffloadOptimizer",
    "DataParallelNaive", "DataParallelBucketed", "save_sharded", "load_sharded", "verify_sharded", "CheckpointError",
    "shard_numel", "padded_numel", "shard_range", "FlatLayout", "comm_volume", "analytic_comm_volume",
    "offload_savings", "check_same_across_ranks", "check_elementwise_optimizer",
]
