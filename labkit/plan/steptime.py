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
  direction). A tensor group never leaves a node. The most loaded stage's layers (ceil(L / p)).
- Pipeline: each micro-batch crosses each boundary forward and backward, v times with
  interleaving; a (b, s / cp, h) 2-byte message divided by t: with sequence parallelism it is
  split already, without it Megatron's scatter/gather sends 1/t from each of the t ranks and
  gathers it again over NVLink (Narayanan et al. 2021b, Section 4.1). On the network
  (``network_gbps`` per GPU, one direction) when a pipeline spans nodes (t cp p > gpus_per_node:
  the rank grid is ``labkit.parallel.ParallelDims.AXES``, dp outermost, then pp, cp, and tp
  innermost), else on NVLink.
- Context parallelism (ring attention, zigzag layout): per layer and micro-batch a rank sends
  ``labkit.context_parallel.ring_bytes_per_layer`` forward (its K and V shard cp - 1 times, of
  its t-th of the key/value heads) and backward (K and V again, and their gradients cp times),
  and the forward once more under selective or full recomputation (the attention core is
  recomputed, and with it the ring). A cp group spans t cp consecutive ranks: on NVLink when
  t cp <= gpus_per_node, else on the network. The sends overlap the blocks' compute (the ring
  posts the next transfer before computing the current block): in forward, cp - 1 transfers hide
  behind cp - 1 steps of ``labkit.context_parallel.ring_step_flops`` (an (s/cp) x (s/cp) block of
  the rank's heads, half of it computed under the causal mask), in backward behind twice that
  compute; only what lasts longer than the compute adds to the step.
- Data parallelism and ZeRO: the elements of ``labkit.zero.analytic.step_comm_volume`` (stages
  0-1 once a step, stage 2's reduce-scatter and stage 3's gathers every micro-batch, as the
  mechanisms run them), 2 bytes each, times the ring's (N_d cp - 1) / (N_d cp), over the N_d cp
  ranks that hold the same parameters; on the network when the run spans nodes, else on NVLink.
  ``RunConfig.overlap_grad_reduce``: that traffic runs under the compute and only what exceeds
  the backward's share (two thirds of the compute) adds; otherwise it adds in full.
- Experts (a model with experts; ep > 1): per MoE layer and micro-batch, the dispatch and combine
  all-to-alls forward and their inverses backward, and the forward's once more under full
  recomputation: ``labkit.moe.analytic.all_to_all_bytes`` of the N k rows the rank routes (N = b s /
  cp tokens; under a capacity, ``labkit.estimate.experts.dispatched_rows_bound``), 2-byte rows, of
  which (ep - 1) / ep leave the rank under uniform routing. Where the ep group lies: labkit's order,
  innermost first, is tp-cp-pp-ep-dp, ep being the inner factor of dp (``ParallelDims.expert_groups``):
  an ep group spans ep p cp t consecutive ranks, on NVLink when that fits in a node, else every byte
  on the network (assumed: none of it stays inside a node). Megatron-LM's order is tp-cp-ep-dp-pp
  (ep inside a stage: t cp ep ranks); torchtitan's mesh, outermost first, is ["pp", "dp_replicate",
  "dp_shard", "cp", "tp"], ep borrowed from dp_shard x cp. Expert gradients reduce over the dp / ep
  ranks holding the same experts, the rest over all N_d cp replicas. Routing imbalance is not charged.
- Latency (the alpha of an alpha-beta model): every ring collective takes R - 1 steps over R
  ranks (an all-reduce 2 (R - 1)), each ``LATENCY_S`` of its link (1 us on NVLink, 5 us on the
  network: assumed orders of magnitude, not measured here); a pipeline message one. It matters for small messages over many ranks (ZeRO-3's
  per-layer gathers over hundreds of replicas), not for bandwidth-bound ones.
- ZeRO-Offload: the rank's shard of 2-byte gradients goes to the CPU and its shard of 2-byte
  weights comes back each step over PCIe at ``pcie_gbps`` (one direction); the CPU's optimizer step is not modelled.
- Nothing else overlaps: the communication times add to the compute time. MFU counts the model's
  FLOPs only; ``hfu`` counts the recomputed ones too (Narayanan et al.'s definition; both named
  by Chowdhery et al. 2022, PaLM, Appendix B).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from ..context_parallel.analytic import ring_bytes_per_layer, ring_step_flops
from ..moe.analytic import training_step_flops

__all__ = ["StepTime", "step_time", "step_flops", "ring_step", "expert_traffic", "LATENCY_S"]


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
    latency_s: float = 0.0  # the collectives' per-step latencies, added up
    expert_s: float = 0.0  # the experts' all-to-all (dispatch and combine)

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.tensor_s + self.pipeline_s + self.context_s + self.data_s + self.offload_s
                + self.latency_s + self.expert_s)

    def to_dict(self) -> dict:
        return {**asdict(self), "total_s": self.total_s}


def step_flops(flops, shape, global_batch: int, recompute: str) -> tuple[float, float]:
    """(model FLOPs, FLOPs run) of one step: ``flops(shape, batch, recompute=bool)`` counts the
    matmuls; selective recomputation adds the attention core's (4 B s^2 h a layer;
    ``ShapeProperties.score_flops``)."""
    model = flops(shape, global_batch)
    if recompute == "full":
        return model, flops(shape, global_batch, recompute=True)
    if recompute == "selective":
        return model, model + shape.n_layer * shape.score_flops(global_batch)
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
    block_s = ring_step_flops(b, shape.n_head // t, shape.head_dim, chunk) / flops_per_s  # causal
    exposed_fwd = max(0.0, forward / link_gbps / 1e9 - (cp - 1) * block_s)
    exposed_bwd = max(0.0, backward / link_gbps / 1e9 - 2 * (cp - 1) * block_s)
    passes = 2 if recompute in ("selective", "full") else 1  # recomputation runs the forward ring again
    return passes * forward + backward, passes * exposed_fwd + exposed_bwd


LATENCY_S = {"nvlink": 1e-6, "network": 5e-6}  # seconds per ring step, by link: assumed, not measured


def _links(run, num_gpus: int, gpus_per_node: int, nvlink_gbps: float, network_gbps: float) -> dict:
    """(GB/s, latency) of each group's link: tp stays in a node; cp, pp, ep and dp leave it when
    the ranks they span (t cp, t cp p, t cp p ep, the whole run) outnumber a node's GPUs."""
    net, nv = (network_gbps, LATENCY_S["network"]), (nvlink_gbps, LATENCY_S["nvlink"])
    t, cp, p = run.tp_size, run.cp_size, run.pp_size
    return {"tensor": nv, "context": net if t * cp > gpus_per_node else nv,
            "pipeline": net if t * cp * p > gpus_per_node else nv, "data": net if num_gpus > gpus_per_node else nv,
            "expert": net if t * cp * p * run.ep_size > gpus_per_node else nv}


def expert_traffic(shape, run) -> tuple[float, int]:
    """(bytes a rank sends, all-to-all calls) of one step's expert parallelism: the module
    docstring's count over the MoE layers of the most loaded stage and the m micro-batches."""
    from ..estimate.experts import dispatched_rows_bound
    from ..moe.analytic import all_to_all_bytes
    ep = run.ep_size
    if ep == 1:
        return 0.0, 0
    tokens = run.micro_batch * (shape.seq_len // run.cp_size)
    rows = ep * dispatched_rows_bound(tokens, shape.n_experts, shape.experts_per_token, run.capacity_factor)
    group = all_to_all_bytes(rows, shape.d_model, shape.n_experts, ep, 2)  # the group's, forward and backward
    calls = 5  # forward: the counts, dispatch, combine; backward: combine's and dispatch's inverses
    if run.recompute == "full":
        group += all_to_all_bytes(rows, shape.d_model, shape.n_experts, ep, 2, backward=False)
        calls += 3
    layers = _moe_layers_per_stage(shape, run.pp_size, run.v) * run.num_microbatches
    return layers * group / ep * (ep - 1) / ep, layers * calls


@lru_cache(maxsize=256)
def _moe_layers_per_stage(shape, p: int, v: int) -> int:
    """The most MoE layers a pipeline stage holds."""
    return max(sum(shape.is_moe_layer(i) for a, b in shape.stage_ranges(p, st, v) for i in range(a, b))
               for st in range(p))


def _data_traffic(run, rank_params: int, layers: int, replicas: int) -> tuple[float, int]:
    """(bytes a rank sends, ring steps) of one step's data-parallel and ZeRO collectives of
    ``rank_params`` over ``replicas`` ranks."""
    from ..zero.analytic import step_comm_volume
    r, m = replicas, run.num_microbatches
    if r == 1:
        return 0.0, 0
    volume = step_comm_volume(rank_params, run.zero_stage, m, reshard_after_forward=run.reshard_after_forward)
    sent = sum(volume.values()) * 2 * (r - 1) / r
    if run.zero_stage <= 1:
        calls = 2  # an all-reduce: 2 (R - 1) steps, as a reduce-scatter and an all-gather
    elif run.zero_stage == 2:
        calls = m + 1
    elif run.reshard_after_forward:  # per layer (labkit's unit) and micro-batch: two gathers, a reduce-scatter
        calls = layers * m * 3
    else:  # per layer: one gather a step, a reduce-scatter a micro-batch
        calls = layers * (m + 1)
    return sent, calls * (r - 1)


def step_time(run, shape, *, num_gpus: int, gpus_per_node: int, peak: float, efficiency: float,
              nvlink_gbps: float, network_gbps: float, pcie_gbps: float = 25.0, flops=None) -> StepTime:
    """The model of the module docstring for ``run`` (a checked ``labkit.parallel.RunConfig``) of
    ``shape``; ``peak``: the dense FLOP/s of one GPU; ``flops``: (model, run) FLOPs of the step
    (:func:`step_flops`; computed when None)."""
    from ..pipeline.analytic import bubble_fraction
    t, p, cp, m, v = run.tp_size, run.pp_size, run.cp_size, run.num_microbatches, run.v
    model_flops, run_flops = flops or step_flops(training_step_flops, shape, run.global_batch, run.recompute)
    bubble = bubble_fraction(p, m, run.schedule, v)
    compute = run_flops / (num_gpus * peak * efficiency) / (1 - bubble)
    message = run.micro_batch * (shape.seq_len // cp) * shape.d_model * 2  # one (b, s/cp, h) bf16 activation
    layers = -(-shape.n_layer // p)
    links = _links(run, num_gpus, gpus_per_node, nvlink_gbps, network_gbps)
    collectives = (6 if run.recompute == "full" else 4) * layers * m
    tensor = collectives * 2 * (t - 1) / t * message
    pipe = 2 * m * v * message / t if p > 1 else 0.0
    data, data_steps = _gradient_traffic(shape, run, layers)
    ring, ring_s = ring_step(shape, tp_size=t, cp_size=cp, micro_batch=run.micro_batch, recompute=run.recompute,
                             flops_per_s=peak * efficiency, link_gbps=links["context"][0])
    tensor_s, pipe_s = tensor / nvlink_gbps / 1e9, pipe / links["pipeline"][0] / 1e9
    data_s = data / links["data"][0] / 1e9
    if run.overlap_grad_reduce:
        data_s = max(0.0, data_s - 2 / 3 * compute * (1 - bubble))
    latency = (collectives * 2 * (t - 1) * links["tensor"][1] + (2 * m * v if p > 1 else 0) * links["pipeline"][1]
               + data_steps * links["data"][1])
    context, context_s = layers * m * ring, layers * m * ring_s
    expert, expert_calls = expert_traffic(shape, run)
    expert_s = expert / links["expert"][0] / 1e9
    latency += expert_calls * (run.ep_size - 1) * links["expert"][1]
    shard = -(-shape.stage_params(t, p, 0, v) // run.replicas)  # ZeRO-Offload moves a rank's shard (stage >= 1)
    offload_s = 2 * shard * 2 / pcie_gbps / 1e9 if run.offload else 0.0
    total = compute + tensor_s + pipe_s + context_s + data_s + offload_s + latency + expert_s
    return StepTime(compute, bubble, tensor_s, pipe_s, data_s, context_s, offload_s,
                    model_flops / (total * num_gpus * peak), run_flops / (total * num_gpus * peak),
                    {"tensor": tensor, "pipeline": pipe, "context": context, "data": data, "expert": expert},
                    latency, expert_s)


def _gradient_traffic(shape, run, layers: int) -> tuple[float, int]:
    """:func:`_data_traffic` of stage 0's parameters: the experts' over the replicas / ep that hold
    them, the rest over all replicas (one group when ep = 1)."""
    from ..estimate.experts import rank_params
    dense, experts = rank_params(shape, run.tp_size, run.pp_size, 0, run.v, run.ep_size)
    if run.ep_size == 1:
        return _data_traffic(run, dense + experts, layers, run.replicas)
    a, b = _data_traffic(run, dense, layers, run.replicas), _data_traffic(run, experts, layers,
                                                                          run.replicas // run.ep_size)
    return a[0] + b[0], a[1] + b[1]
