"""Memory estimates in pure Python: a training run's bytes per GPU, and a served model's KV cache.

``training_memory(shape, seq_len=..., micro_batch=..., dims=...)`` -> :class:`MemoryEstimate`;
``serving_memory(shape, gpu=...)`` -> :class:`ServingEstimate`. Both compose the formulas the
techniques' tests check (``labkit.zero.analytic``, ``labkit.memory.analytic``,
``labkit.pipeline.analytic``, ``labkit.paged_attention.analytic``, ``labkit.shapes``) and import
no torch, so they run anywhere, a browser included.
"""

from ..hardware import GPU, GPUS, get_gpu
from ..shapes import PRESETS, ModelShape
from .serving import NON_TORCH_BYTES, PROFILE_TOKENS, ServingEstimate, check_context_len, serving_memory
from .training import (OPTIMIZERS, PRECISIONS, MemoryEstimate, as_shape, check_trainable, layer_activation_bytes,
                       training_memory)

__all__ = ["training_memory", "MemoryEstimate", "serving_memory", "check_context_len", "ServingEstimate", "ModelShape",
           "PRESETS", "GPU", "GPUS", "get_gpu", "as_shape", "layer_activation_bytes", "PRECISIONS",
           "OPTIMIZERS", "NON_TORCH_BYTES", "PROFILE_TOKENS", "check_trainable"]
