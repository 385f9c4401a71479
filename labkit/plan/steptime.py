"""The step-time model the planner ranks plans by, and the FLOPs it counts.

Assumptions, all of them:

- Compute runs at ``efficiency`` of the GPU's dense peak (``labkit.hardware.peak_flops``; 0.5 by
  default) on the step's FLOPs: the model's matmuls (``labkit.model``'s count, Narayanan et al.
  2021), plus one more forward of every layer under full recomputation and the attention core's
  two matmuls once more under selective recomputation. The pipeline's bubble stretches it by
  1 / (1 - bubble) (``labkit.pipeline``'s formula for the schedule).
- Tensor parallelism: 4 all-reduces (or reduce-scatter + all-gather pairs, the same bytes) of a
  (b, s, h) 2-byte activation per layer and micro-batch, 6 under full recomputation; ring
  traffic 2 (t - 1) / t of the message per GPU, on NVLink at half the table's ``link_gbps`` (one
  direction). A tensor group never leaves a node.
- Pipeline: each micro-batch crosses each boundary forward and backward, (b, s, h) 2-byte
  (/ t with sequence parallelism), v times with interleaving; on the network (``network_gbps``
  per GPU, one direction) when the pipeline spans nodes, else on NVLink.
- Data parallelism: ring all-reduce of the rank's 2-byte gradients, 2 (N_d - 1) / N_d of them;
  ZeRO-3 half as much again (the weights gathered once more); on the network when the run spans
  nodes, else on NVLink.
- ZeRO-Offload: the rank's 2-byte gradients go to the CPU and its 2-byte weights come back each
  step over PCIe at ``pcie_gbps`` (one direction); the CPU's optimizer step is not modelled.
- Nothing overlaps: the communication times add to the compute time. MFU counts the model's
  FLOPs only; ``hfu`` counts the recomputed ones too (Narayanan et al.'s definition).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["StepTime", "step_time", "step_flops"]


@dataclass(frozen=True)
class StepTime:
    """One step's time, by part, in seconds; ``mfu`` and ``hfu`` as fractions of the dense peak."""

    compute_s: float
    bubble: float
    tensor_s: float
    pipeline_s: float
    data_s: float
    offload_s: float
    mfu: float
    hfu: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.tensor_s + self.pipeline_s + self.data_s + self.offload_s

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


def step_time(model_flops: float, run_flops: float, *, shape, num_gpus: int, gpus_per_node: int,
              tp_size: int, pp_size: int, dp_size: int, micro_batch: int, num_microbatches: int,
              v: int, bubble: float, recompute: str, sequence_parallel: bool, zero_stage: int,
              rank_params: int, peak: float, efficiency: float, nvlink_gbps: float,
              network_gbps: float, offload: bool = False, pcie_gbps: float = 25.0) -> StepTime:
    """The model of the module docstring for one plan; ``rank_params``: the parameters a rank
    holds (its gradients' count), ``peak``: the dense FLOP/s of one GPU."""
    t, p, dp, m = tp_size, pp_size, dp_size, num_microbatches
    compute = run_flops / (num_gpus * peak * efficiency) / (1 - bubble)
    message = micro_batch * shape.seq_len * shape.d_model * 2  # one (b, s, h) bf16 activation
    layers = shape.n_layer // p
    tensor = (6 if recompute == "full" else 4) * layers * m * 2 * (t - 1) / t * message
    pipe = 2 * m * v * message / (t if sequence_parallel else 1) if p > 1 else 0.0
    data = 2 * (dp - 1) / dp * rank_params * 2 * (1.5 if zero_stage == 3 else 1.0)
    pipe_link = network_gbps if t * p > gpus_per_node else nvlink_gbps
    data_link = network_gbps if num_gpus > gpus_per_node else nvlink_gbps
    tensor_s, pipe_s, data_s = tensor / nvlink_gbps / 1e9, pipe / pipe_link / 1e9, data / data_link / 1e9
    offload_s = 2 * rank_params * 2 / pcie_gbps / 1e9 if offload else 0.0
    total = compute + tensor_s + pipe_s + data_s + offload_s
    return StepTime(compute, bubble, tensor_s, pipe_s, data_s, offload_s, model_flops / (total * num_gpus * peak),
                    run_flops / (total * num_gpus * peak))
