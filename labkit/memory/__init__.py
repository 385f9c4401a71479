"""The memory meter: what a training step should need (analytic) and what it does (measured).

``analytic`` imports no torch and is loaded at once; the meter, the figures and the snapshot
(which need torch) are loaded on first use, so that ``labkit.estimate`` runs without torch.
"""

from .._lazy import lazy_exports
from .analytic import (RECOMPUTE, ActivationBytes, ModelStateBytes, activation_bytes, head_bytes,
                       korthikanti_activation_bytes, llama_layer_bytes, model_state_bytes)
from .fused import KERNELS, fused_llama_layer_bytes
from .runtime import CONTEXT_BYTES, NCCL_BUFFSIZE, NCCL_CHANNELS, non_torch_bytes, ring_peers

__all__ = [
    # analytic: Chapter 1's formulas
    "ModelStateBytes", "model_state_bytes", "ActivationBytes", "activation_bytes",
    "korthikanti_activation_bytes", "llama_layer_bytes", "head_bytes", "RECOMPUTE",
    "KERNELS", "fused_llama_layer_bytes",
    # runtime: what a GPU process holds outside PyTorch's tensors (assumed, stated)
    "CONTEXT_BYTES", "NCCL_BUFFSIZE", "NCCL_CHANNELS", "non_torch_bytes", "ring_peers",
    # measured: the meter and the one step loop
    "CATEGORIES", "MemoryMeter", "MemoryReport", "measure_forward_backward", "measure_step",
    "optimizer_tensors", "train_step",
    # figures and PyTorch's memory viewer
    "plot_breakdown", "plot_timeline", "dump_memory_snapshot", "memory_snapshot",
]

# the torch side (the meter, the figures, the snapshot) loads on first use
__getattr__, __dir__ = lazy_exports(__name__, {
    ".meter": ("CATEGORIES", "MemoryMeter", "MemoryReport", "measure_forward_backward", "measure_step",
               "optimizer_tensors", "train_step"),
    ".plot": ("plot_breakdown", "plot_timeline"),
    ".snapshot": ("dump_memory_snapshot", "memory_snapshot"),
})
