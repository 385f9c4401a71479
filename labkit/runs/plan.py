"""Choose t, p, N_d, micro-batch, ZeRO stage and recomputation for a model on a cluster (Chapter 6).

Memory per GPU (bf16 mixed-precision Adam): model states of the largest stage, 16 bytes a
parameter, or 4 + 12/N_d with ZeRO-1 and 2 + 14/N_d with ZeRO-2 (Rajbhandari et al. 2020;
``labkit.zero.analytic.zero_bytes_per_param``); the
activations of the micro-batches stage 0 holds, per layer: min(p, m) of its L/p layers under
1F1B, 2(p - 1) + (v - 1)p + 1 chunks of L/(vp) layers under the interleaved schedule with v
chunks a rank (a factor 1 + (p - 1)/(pv) over 1F1B, as Korthikanti et al. state), per layer
(Korthikanti et al. 2022, 2-byte activations): sbh(10 + 24/t + 5as/(ht)) with tensor parallelism,
sbh/t (34 + 5as/h) with sequence parallelism, without the 5as/h term under selective
recomputation, 2sbh (or 2sbh/t) under full recomputation plus one layer being recomputed
(``labkit.memory.analytic.korthikanti_activation_bytes``).
The embedding's and logits' activations are left out. Step time, a stated model: compute =
the step's matmul FLOPs / (GPUs x peak x ``efficiency``), stretched by the bubble; plus tensor
all-reduces (4 a layer per micro-batch, 6 with full recomputation, ring 2(t-1)/t of b s h
2-byte elements) on NVLink when t fits in a node, pipeline sends b s h (/t with SP) on the
network when the pipeline spans nodes (v times as many with interleaving), and the gradient
all-reduce over N_d on the network; none of it overlapped with compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hardware import get_gpu, peak_flops
from ..memory.analytic import RECOMPUTE, korthikanti_activation_bytes
from ..model import GPTConfig, training_flops
from ..pipeline.analytic import bubble_fraction, max_in_flight
from ..shapes import ModelShape
from ..validate import check_choice, check_float, check_int, check_positive
from ..zero.analytic import zero_bytes_per_param

__all__ = ["Plan", "NoPlanFits", "plan_parallelism", "plan_memory", "RECOMPUTE"]

_ZERO_STAGES = (0, 1, 2)  # the stages the planner weighs (ZeRO-3's gathers are not in its time model)


@dataclass(frozen=True)
class Plan:
    t: int
    p: int
    dp: int                  # N_d
    micro_batch: int         # b
    num_microbatches: int    # m, per pipeline per step
    zero: int
    recompute: str
    sequence_parallel: bool
    states_bytes: float      # per GPU, largest stage
    activation_bytes: float  # per GPU, stage 0's micro-batches in flight
    bubble: float
    comm_bytes: dict         # per GPU per step: {"tensor", "pipeline", "data"}
    step_time_s: float
    mfu: float
    fits: bool
    v: int = 1               # model chunks a rank holds: 1, or the interleaved schedule's v

    @property
    def schedule(self) -> str:
        return _schedule(self.p, self.num_microbatches, self.v)

    @property
    def memory_bytes(self) -> float:
        return self.states_bytes + self.activation_bytes


def _schedule(p: int, m: int, v: int) -> str:
    """The schedule a plan assumes: interleaved with v > 1 chunks, else 1F1B, or GPipe when m < p."""
    return "interleaved" if v > 1 else ("1f1b" if m >= p else "gpipe")


class NoPlanFits(ValueError):
    """No configuration fits: ``closest`` is the plan with the least memory (None when no
    configuration exists at all), and the message names the term that overflowed."""

    def __init__(self, message: str, closest=None):
        super().__init__(message)
        self.closest = closest


def _layer_bytes(cfg: GPTConfig, b: int, t: int, recompute: str, sp: bool) -> tuple[float, float]:
    """(bytes kept per layer per micro-batch, bytes of one layer recomputed in full)."""
    s, h, a = cfg.seq_len, cfg.d_model, cfg.n_head
    kept = korthikanti_activation_bytes(s, b, h, a, t, sp, recompute)
    return kept, (korthikanti_activation_bytes(s, b, h, a, t, sp) if recompute == "full" else 0.0)


def _stage_params(cfg: GPTConfig, t: int, p: int) -> float:
    """Parameters per GPU of a stage, as the planner approximates them: L/p blocks and the
    embeddings, all divided by t (``ModelShape.stage_params`` places and splits each exactly)."""
    shape = ModelShape.from_config(cfg)
    return (cfg.n_layer // p) * shape.layer_params() / t + shape.embedding_params() / t


def plan_memory(cfg: GPTConfig, t: int, p: int, dp: int, micro_batch: int, num_microbatches: int,
                zero: int = 0, recompute: str = "full", sequence_parallel: bool = False,
                v: int = 1) -> tuple[float, float]:
    """(model-state bytes, activation bytes) per GPU of the largest pipeline stage; ``v`` > 1:
    the interleaved schedule with v chunks a rank (needs m a multiple of p)."""
    L = cfg.n_layer
    for name, value in (("t", t), ("p", p), ("dp", dp), ("micro_batch", micro_batch),
                        ("num_microbatches", num_microbatches), ("v", v)):
        check_int(name, value, 1)
    check_choice("zero", zero, _ZERO_STAGES)
    check_choice("recompute", recompute, RECOMPUTE)
    check_choice("sequence_parallel", sequence_parallel, (False, True))
    if cfg.n_head % t:
        raise ValueError(f"t={t} must divide n_head={cfg.n_head} (each rank holds whole heads)")
    if L % p:
        raise ValueError(f"p={p} must divide n_layer={L} (stages of equal layer count)")
    if v > 1 and (p == 1 or L % (p * v)):
        raise ValueError(f"v={v} chunks a rank needs pp_size={p} > 1 and v x p to divide n_layer={L}")
    states = _stage_params(cfg, t, p) * zero_bytes_per_param(zero, dp, "mixed", "adam")
    kept, extra = _layer_bytes(cfg, micro_batch, t, recompute, sequence_parallel)
    m = num_microbatches
    # stage 0 holds max_in_flight chunks of L / (v p) layers each
    layers = max_in_flight(p, m, _schedule(p, m, v), v) * (L // p) / v
    return states, layers * kept + extra


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_parallelism(cfg: GPTConfig, gpu, n_gpus: int, gpus_per_node: int, global_batch: int, *,
                     dtype: str = "bf16", efficiency: float = 0.5, network_gbps: float = 25.0,
                     nvlink_gbps: float | None = None, micro_batches=(1, 2, 4, 8), zero_stages=(0, 1),
                     recompute=RECOMPUTE, sequence_parallel=(False, True), interleave=None,
                     memory_fraction: float = 0.9, include_infeasible: bool = False) -> list[Plan]:
    """Every (t, p, N_d, b, v, ZeRO, recomputation) that fits, fastest estimated step first;
    raises :class:`NoPlanFits` (a ValueError) naming the term that overflowed when none does.

    t divides n_head and gpus_per_node (a tensor group never straddles two nodes); p divides
    n_layer; t p N_d = n_gpus; N_d b divides the global batch; ``interleave``: the chunks v a rank
    may hold (default 1 to 8), v > 1 when p > 1, v p divides n_layer and m is a multiple of p.
    ``network_gbps``: GB/s per GPU across nodes, one direction (25: a 200 Gb/s InfiniBand port per
    GPU); ``nvlink_gbps``: inside a node, one direction (default: half the table's total). A plan
    fits when its memory is at most ``memory_fraction`` of nvidia-smi's total.
    """
    g = get_gpu(gpu)
    _check_plan_args(n_gpus, gpus_per_node, global_batch, efficiency, network_gbps, nvlink_gbps,
                     micro_batches, zero_stages, recompute, sequence_parallel, interleave, memory_fraction)
    interleave = range(1, 9) if interleave is None else interleave
    nvlink = g.link_gbps / 2 if nvlink_gbps is None else nvlink_gbps
    peak = peak_flops(g, dtype) * efficiency
    L = cfg.n_layer
    plans = []
    for t in (d for d in _divisors(cfg.n_head) if gpus_per_node % d == 0 and n_gpus % d == 0):
        for p in (d for d in _divisors(L) if (n_gpus // t) % d == 0):
            dp = n_gpus // (t * p)
            for b in micro_batches:
                if global_batch % (dp * b):
                    continue
                m = global_batch // (dp * b)
                for v in (v for v in interleave if v == 1 or (p > 1 and L % (p * v) == 0 and m % p == 0)):
                    plans += _plans_for(cfg, g, n_gpus, gpus_per_node, global_batch, t, p, dp, b, m, v, dtype,
                                        peak, nvlink, network_gbps, recompute, sequence_parallel, zero_stages,
                                        memory_fraction)
    fitting = plans if include_infeasible else [pl for pl in plans if pl.fits]
    if not fitting:
        raise _no_plan(plans, g, n_gpus, global_batch, memory_fraction)
    return sorted(fitting, key=lambda pl: (pl.step_time_s, pl.memory_bytes))


def _check_plan_args(n_gpus, gpus_per_node, global_batch, efficiency, network_gbps, nvlink_gbps,
                     micro_batches, zero_stages, recompute, sequence_parallel, interleave, memory_fraction):
    """Each argument of :func:`plan_parallelism` checked, named in the error."""
    for name, value in (("n_gpus", n_gpus), ("gpus_per_node", gpus_per_node), ("global_batch", global_batch)):
        check_int(name, value, 1)
    check_float("efficiency", efficiency, maximum=1.0, above=0.0)  # a share of the dense peak: MFU cannot pass 1
    check_float("memory_fraction", memory_fraction, maximum=1.0, above=0.0)  # a share of the GPU's memory
    check_positive("network_gbps", network_gbps)
    if nvlink_gbps is not None:
        check_positive("nvlink_gbps", nvlink_gbps)
    for name, values, valid in (("micro_batches", micro_batches, None), ("interleave", interleave, None),
                                ("zero_stages", zero_stages, _ZERO_STAGES),
                                ("recompute", recompute, RECOMPUTE),
                                ("sequence_parallel", sequence_parallel, (False, True))):
        if values is None and name == "interleave":
            continue
        values = tuple(values)
        if not values:
            raise ValueError(f"{name}=() must hold at least one choice")
        for x in values:
            try:
                check_int(name, x, 1) if valid is None else check_choice(name, x, valid)
            except ValueError as err:
                raise ValueError(f"{name}={values!r}: {err}") from None


def _no_plan(plans, g, n_gpus, global_batch, memory_fraction) -> NoPlanFits:
    """Why nothing fits: no configuration at all, or the term of the leanest plan that overflows."""
    limit = memory_fraction * g.memory_bytes
    if not plans:
        return NoPlanFits(f"no (t, p, N_d, b) splits n_gpus={n_gpus} and global_batch={global_batch}: "
                          "t must divide n_head and gpus_per_node, p n_layer, N_d b the global batch")
    best = min(plans, key=lambda pl: pl.memory_bytes)
    where = (f"(leanest plan: t={best.t}, p={best.p}, N_d={best.dp}, b={best.micro_batch}, ZeRO-{best.zero}, "
             f"recompute={best.recompute!r})")
    if best.states_bytes > limit:
        term = f"model states alone need {best.states_bytes / 1e9:.1f} GB per GPU"
    else:
        term = (f"activations need {best.activation_bytes / 1e9:.1f} GB on top of "
                f"{best.states_bytes / 1e9:.1f} GB of model states")
    return NoPlanFits(f"no plan fits on {n_gpus} x {g.name}: {term} {where}, over "
                      f"memory_fraction={memory_fraction:g} of {g.memory_bytes / 1e9:.1f} GB = "
                      f"{limit / 1e9:.1f} GB", best)


def _plans_for(cfg, g, n_gpus, gpus_per_node, global_batch, t, p, dp, b, m, v, dtype, peak, nvlink,
               network_gbps, recompute, sequence_parallel, zero_stages, memory_fraction):
    """The plans of one (t, p, N_d, b, m, v): every recomputation, SP and ZeRO choice."""
    s, h, L = cfg.seq_len, cfg.d_model, cfg.n_layer
    plans = []
    bubble = bubble_fraction(p, m, _schedule(p, m, v), v)
    for rc in recompute:
        flops = training_flops(cfg, global_batch, recompute=rc == "full")
        if rc == "selective":  # the attention core's two matmuls, once more
            flops += L * 4 * global_batch * s * s * h
        compute = flops / (n_gpus * peak) / (1 - bubble)
        for sp in sequence_parallel:
            if sp and t == 1:
                continue
            msg = b * s * h * 2  # one (b, s, h) bf16 activation
            n_ar = (6 if rc == "full" else 4) * (L // p) * m
            tp_bytes = n_ar * 2 * (t - 1) / t * msg
            pp_bytes = 2 * m * v * msg / (t if sp else 1) if p > 1 else 0.0
            dp_bytes = 2 * (dp - 1) / dp * _stage_params(cfg, t, p) * 2
            comm = (tp_bytes / nvlink / 1e9
                    + pp_bytes / (network_gbps if t * p > gpus_per_node else nvlink) / 1e9
                    + dp_bytes / (network_gbps if n_gpus > gpus_per_node else nvlink) / 1e9)
            for z in zero_stages:
                if z and dp == 1:
                    continue
                st, act = plan_memory(cfg, t, p, dp, b, m, z, rc, sp, v)
                fits = st + act <= memory_fraction * g.memory_bytes
                time_s = compute + comm
                plans.append(Plan(t, p, dp, b, m, z, rc, sp, st, act, bubble,
                                  {"tensor": tp_bytes, "pipeline": pp_bytes, "data": dp_bytes},
                                  time_s, training_flops(cfg, global_batch) / (time_s * n_gpus
                                                                             * peak_flops(g, dtype)),
                                  fits, v))
    return plans
