"""Memory a GPU process holds outside PyTorch's tensors: the CUDA context and NCCL's buffers.

Torch-free. The memory meter cannot see these bytes (they are not tensors) and the suite has no GPU
to measure them on, so the figures are assumed and stated here, once, for the training and the
serving estimate alike:

- the CUDA context with its loaded kernels and the cuBLAS/cuDNN workspaces: ``CONTEXT_BYTES``,
  1 GiB (some hundreds of MB to about a GB by GPU, driver and library versions; vLLM measures it
  at start-up for the same reason);
- NCCL's buffers: each communicator connects a rank to its peers, and holds for each peer and each
  of its channels a buffer of ``NCCL_BUFFSIZE`` (NCCL's default, 4 MiB); ``NCCL_CHANNELS``
  channels are assumed (NCCL picks 2 to 32 by topology). A ring collective (all-reduce,
  all-gather, reduce-scatter) connects a rank to 2 peers (1 in a group of 2), a pipeline stage to
  its neighbours, an all-to-all (expert parallelism) to every other rank of its group: the buffers
  grow with the peers, not with the model.

Left out: communication buckets (labkit's gradients are views of its buckets; DDP's 25 MB buckets
and DeepSpeed's reduce buckets are engine settings), the caching allocator's fragmentation, and
CUDA graphs (vLLM's captures reserve their own memory).
"""

from __future__ import annotations

from ..validate import check_int

__all__ = ["CONTEXT_BYTES", "NCCL_BUFFSIZE", "NCCL_CHANNELS", "ring_peers", "non_torch_bytes"]

CONTEXT_BYTES = 2**30  # assumed: the CUDA context, its kernels and the cuBLAS/cuDNN workspaces
NCCL_BUFFSIZE = 4 * 2**20  # NCCL's default buffer per channel and peer (NCCL_BUFFSIZE)
NCCL_CHANNELS = 16  # assumed channels per communicator


def ring_peers(group_size: int) -> int:
    """The peers a rank connects to for a ring collective over ``group_size`` ranks: 2, 1 or 0."""
    return min(2, check_int("group_size", group_size, 1) - 1)


def non_torch_bytes(peers: int = 0) -> int:
    """Bytes outside PyTorch's tensors in one process connected to ``peers`` peers over NCCL
    (summed over its communicators): ``CONTEXT_BYTES`` + peers x ``NCCL_CHANNELS`` x ``NCCL_BUFFSIZE``."""
    return CONTEXT_BYTES + check_int("peers", peers, 0) * NCCL_CHANNELS * NCCL_BUFFSIZE
