"""The step-time model the planner ranks plans by, and the FLOPs it counts.

Assumptions, all of them:

- Compute runs at ``efficiency`` of the GPU's dense peak (``labkit.hardware.peak_flops``; 0.5 by
  default) on the step's FLOPs: the model's matmuls (``labkit.model``'s count, Narayanan et al.
  2021), plus one more forward of every layer under full recomputation and the attention core's
  two matmuls once more under selective recomputation. The pipeline's bubble stretches it by
  1 / (1 - bubble) (``labkit.pipeline``'s formula for the schedule).
- Tensor parallelism: 4 all-reduces (or reduce-scatter + all-gather pairs, the same bytes) of a
  (b, s / cp, h) 2-byte activation per layer and micro-batch, 6 under full recomputation; ring
  traffic 2 (t - 1) / t of the message per GPU, on NVLink at half the table's ``link_gbps`` (one
  direction). A tensor group never leaves a node.
- Pipeline: each micro-batch crosses each boundary forward and backward, (b, s / cp, h) 2-byte
  (/ t with sequence parallelism), v times with interleaving; on the network (``network_gbps``
  per GPU, one direction) when a pipeline spans nodes (t cp p > gpus_per_node: the rank grid is
  ``labkit.parallel.ParallelDims.AXES``, dp outermost, then pp, cp, and tp innermost), else on NVLink.
- Context parallelism (ring attention, zigzag layout): per layer and micro-batch a rank sends
  ``labkit.context_parallel.ring_bytes_per_layer`` forward (its K and V shard cp - 1 times, of
  its t-th of the key/value heads) and backward (K and V again, and their gradients cp times),
  and the forward once more under selective or full recomputation (the attention core is
  recomputed, and with it the ring). A cp group spans t cp consecutive ranks: on NVLink when
  t cp <= gpus_per_node, else on the network. The sends overlap the blocks' compute (the ring
  posts the next transfer before computing the current block): in forward, cp - 1 transfers hide
  behind cp - 1 blocks of ``labkit.context_parallel.block_flops`` (an (s/cp) x (s/cp) block of
  the rank's heads, unmasked, as the FLOP count above counts attention), in backward behind twice
  that compute (its matmuls are twice the forward's); only what lasts
  longer than the compute adds to the step (the FLOPs-against-bytes test of
  ``labkit.context_parallel.hide_chunk_tokens``, on the group's link and at ``efficiency``).
- Data parallelism: ring all-reduce of the rank's 2-byte gradients over the N_d cp ranks that
  hold the same parameters, 2 (N_d cp - 1) / (N_d cp) of them (ZeRO shards over N_d cp too, as
  ``labkit.estimate`` counts); ZeRO-3 half as much again (the weights gathered once more); on the
  network when the run spans nodes, else on NVLink.
- ZeRO-Offload: the rank's 2-byte gradients go to the CPU and its 2-byte weights come back each
  step over PCIe at ``pcie_gbps`` (one direction); the CPU's optimizer step is not modelled.
- Apart from the ring's, nothing overlaps: the communication times add to the compute time. MFU
  counts the model's FLOPs only; ``hfu`` counts the recomputed ones too (Narayanan et al.'s definition).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..context_parallel.analytic import block_flops, ring_bytes_per_layer

__all__ = ["StepTime", "step_time", "step_flops", "ring_step"]


@dataclass(frozen=True)
class StepTime:
    """One step's time, by part, in seconds; ``mfu`` and ``hfu`` as fractions of the dense peak."""

    compute_s: float
    bubble: float
    tensor_s: float
    pipeline_s: float
    data_s: float
    context_s: float  # the ring's time that does not hide behind the blocks' compute
    offload_s: float
    mfu: float
    hfu: float
    comm_bytes: dict  # per GPU per step: {"tensor", "pipeline", "context", "data"}

    @property
    def total_s(self) -> float:
        return self.compute_s + self.tensor_s + self.pipeline_s + self.context_s + self.data_s + self.offload_s

    def to_dict(self) -> dict:
        return {**asdict(self), "total_s": self.total_s}


def step_flops(flops, shape, global_batch: int, recompute: str) -> tuple[float, float]:
    """(model FLOPs, FLOPs run) of one step: ``flops(shape, batch, recompute=bool)`` counts the
    matmuls; selective recomputation adds the attention core's 4 B s^2 h a layer."""
    model = flops(shape, global_batch)
    if recompute == "full":
        return model, flops(shape, global_batch, recompute=True)
    if recompute == "selective":
        return model, model + shape.n_layer * 4 * global_batch * shape.seq_len ** 2 * shape.d_model
    return model, model


def ring_step(shape, *, tp_size: int, cp_size: int, micro_batch: int, recompute: str, flops_per_s: float,
              link_gbps: float) -> tuple[int, float]:
    """(bytes a rank sends, seconds they add) per layer and micro-batch for the ring of the
    module docstring; ``flops_per_s``: the compute rate of one GPU (peak x efficiency)."""
    t, cp, b = tp_size, cp_size, micro_batch
    if cp == 1:
        return 0, 0.0
    ring = dict(batch_size=b, seq_len=shape.seq_len, n_kv_head=shape.kv_heads // t, head_dim=shape.head_dim,
                cp_size=cp)
    forward, backward = (ring_bytes_per_layer(**ring, direction=d) for d in ("forward", "backward"))
    chunk = shape.seq_len // cp
    block_s = block_flops(b, shape.n_head // t, shape.head_dim, chunk, chunk) / flops_per_s
    exposed_fwd = max(0.0, forward / link_gbps / 1e9 - (cp - 1) * block_s)
    exposed_bwd = max(0.0, backward / link_gbps / 1e9 - 2 * (cp - 1) * block_s)
    passes = 2 if recompute in ("selective", "full") else 1  # recomputation runs the forward ring again
    return passes * forward + backward, passes * exposed_fwd + exposed_bwd


def step_time(model_flops: float, run_flops: float, *, shape, num_gpus: int, gpus_per_node: int,
              tp_size: int, pp_size: int, dp_size: int, micro_batch: int, num_microbatches: int,
              v: int, bubble: float, recompute: str, sequence_parallel: bool, zero_stage: int,
              rank_params: int, peak: float, efficiency: float, nvlink_gbps: float,
              network_gbps: float, offload: bool = False, pcie_gbps: float = 25.0, cp_size: int = 1) -> StepTime:
    """The model of the module docstring for one plan; ``rank_params``: the parameters a rank
    holds (its gradients' count), ``peak``: the dense FLOP/s of one GPU."""
    t, p, dp, cp, m = tp_size, pp_size, dp_size, cp_size, num_microbatches
    compute = run_flops / (num_gpus * peak * efficiency) / (1 - bubble)
    message = micro_batch * (shape.seq_len // cp) * shape.d_model * 2  # one (b, s/cp, h) bf16 activation
    layers = shape.n_layer // p
    tensor = (6 if recompute == "full" else 4) * layers * m * 2 * (t - 1) / t * message
    pipe = 2 * m * v * message / (t if sequence_parallel else 1) if p > 1 else 0.0
    replicas = dp * cp  # the ranks that hold the same parameters
    data = 2 * (replicas - 1) / replicas * rank_params * 2 * (1.5 if zero_stage == 3 else 1.0)
    ring_link = network_gbps if t * cp > gpus_per_node else nvlink_gbps
    ring, ring_s = ring_step(shape, tp_size=t, cp_size=cp, micro_batch=micro_batch, recompute=recompute,
                             flops_per_s=peak * efficiency, link_gbps=ring_link)
    pipe_link = network_gbps if t * cp * p > gpus_per_node else nvlink_gbps
    data_link = network_gbps if num_gpus > gpus_per_node else nvlink_gbps
    tensor_s, pipe_s, data_s = tensor / nvlink_gbps / 1e9, pipe / pipe_link / 1e9, data / data_link / 1e9
    context, context_s = layers * m * ring, layers * m * ring_s
    offload_s = 2 * rank_params * 2 / pcie_gbps / 1e9 if offload else 0.0
    total = compute + tensor_s + pipe_s + context_s + data_s + offload_s
    return StepTime(compute, bubble, tensor_s, pipe_s, data_s, context_s, offload_s,
                    model_flops / (total * num_gpus * peak), run_flops / (total * num_gpus * peak),
                    {"tensor": tensor, "pipeline": pipe, "context": context, "data": data})
