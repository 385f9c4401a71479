"""Tensor and sequence parallelism from scratch over ``torch.distributed`` (Chapter 5).

``comm``: Megatron's conjugate operators f and g, the sequence-parallel reduce-scatter, and the
logits' gather, as autograd Functions. ``layers``: column- and row-parallel linears, the
vocabulary-parallel embedding and cross-entropy. ``apply``: ``apply_tensor_parallel(model,
group, sequence_parallel=False)`` on labkit's GPT. ``sync``: the end-of-backward sum of the
sequence-parallel gradients. ``analytic``: Korthikanti et al.'s activation bytes, labkit's own,
parameters per rank and collectives per layer. ``rules``: when sequence parallelism applies
(torch-free, loaded at once; the rest on first use).
"""

from .._lazy import lazy_exports
from .rules import check_sequence_parallel

__all__ = [
    "apply_tensor_parallel", "sync_sequence_parallel_grads", "SequenceParallelGradSync", "check_tp_size",
    "INIT_SYNCS", "ParallelSelfAttention", "ParallelSwiGLU", "SequenceShardedEmbedding", "ColumnParallelLinear",
    "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "VocabParallelLoss",
    "shard_indices", "column_parallel", "copy_to_tp", "reduce_from_tp", "reduce_scatter_to_sp", "gather_from_tp",
    "activation_bytes", "model_activation_bytes", "params_per_rank", "collectives_per_layer",
    "collectives_per_step", "layer_flops", "layer_comm_bytes", "RECOMPUTE", "check_sequence_parallel",
]

# ``rules`` imports no torch and loads at once; the rest on first use
__getattr__, __dir__ = lazy_exports(__name__, {
    ".analytic": ("RECOMPUTE", "activation_bytes", "collectives_per_layer", "collectives_per_step",
                  "layer_comm_bytes", "layer_flops", "model_activation_bytes", "params_per_rank"),
    ".apply": ("INIT_SYNCS", "ParallelSelfAttention", "ParallelSwiGLU", "SequenceShardedEmbedding",
               "apply_tensor_parallel", "check_tp_size"),
    ".comm": ("copy_to_tp", "gather_from_tp", "reduce_from_tp", "reduce_scatter_to_sp"),
    ".layers": ("ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelLoss",
                "column_parallel", "shard_indices", "vocab_parallel_cross_entropy"),
    ".sync": ("SequenceParallelGradSync", "sync_sequence_parallel_grads"),
})
