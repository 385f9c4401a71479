"""ZeRO's formulas: model-state bytes per rank, communication per step, what offloading saves.

Rajbhandari et al. (2020): stage 1 shards the optimizer states, stage 2 also the gradients,
stage 3 also the parameters (Section 5: 4Ψ + 12Ψ/N_d, 2Ψ + 14Ψ/N_d, 16Ψ/N_d bytes with
mixed-precision Adam); data parallelism and stages 1-2 communicate 2Ψ elements per rank and
step, stage 3 3Ψ (Section 7). Ren et al. (2021): ZeRO-Offload leaves only the 16-bit
parameters on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..memory.analytic import ModelStateBytes, model_state_bytes
from ..validate import check_choice, check_int

__all__ = ["STAGES", "check_zero", "zero_allowed", "shard_numel", "padded_numel", "zero_model_state_bytes", "zero_bytes_per_param",
           "deepspeed_model_state_bytes",
           "VOLUME_WEIGHT", "comm_volume", "analytic_comm_volume", "step_comm_volume", "OffloadSavings", "offload_savings"]

STAGES = (0, 1, 2, 3)


def check_zero(zero_stage: int, replicas: int, *, offload: bool = False, offload_params: bool = False,
               reshard_after_forward: bool = True, precision: str | None = None) -> int:
    """``zero_stage`` if it is valid over ``replicas`` ranks holding the same parameters, else a
    ValueError naming the argument: a stage of 0-3 (over one replica ZeRO shards nothing but still
    runs, as ZeRO-Offload does on one GPU); offloading the optimizer needs ZeRO (ZeRO-Offload: stage 1 or more); offloading the
    parameters, or keeping them gathered from forward to backward (FSDP's
    ``reshard_after_forward=False``), needs stage 3 (DeepSpeed's ``offload_param``); ``precision``
    "bf16-mixed-fp32-buffer" (DeepSpeed's BF16 optimizer, its own stage-1 equivalent) needs stage 0
    or 1. The one home of these rules."""
    check_choice("zero_stage", zero_stage, STAGES)
    check_int("replicas", replicas, 1)
    for name, value in (("offload", offload), ("offload_params", offload_params),
                        ("reshard_after_forward", reshard_after_forward)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r} must be a bool")
    if precision == "bf16-mixed-fp32-buffer" and zero_stage > 1:
        raise ValueError(f"precision='bf16-mixed-fp32-buffer' (DeepSpeed's BF16 optimizer) keeps its fp32 gradient "
                         f"buffer unsharded: zero_stage={zero_stage} must be 0 or 1")
    if offload and zero_stage == 0:
        raise ValueError("offload=True (ZeRO-Offload) moves the optimizer's shard to the CPU: it needs "
                         "zero_stage >= 1")
    if offload_params and zero_stage != 3:
        raise ValueError(f"offload_params=True needs zero_stage=3 (the parameters are sharded there); "
                         f"got zero_stage={zero_stage}")
    if not reshard_after_forward and zero_stage != 3:
        raise ValueError(f"reshard_after_forward=False keeps ZeRO-3's gathered parameters: it needs "
                         f"zero_stage=3; got zero_stage={zero_stage}")
    return zero_stage


@lru_cache(maxsize=256)
def zero_allowed(zero_stage: int, replicas: int, offload: bool = False, precision: str | None = None) -> bool:
    """Whether :func:`check_zero` takes ``zero_stage`` with these settings: a sweep asks it of every
    stage it could try and skips the others (DeepSpeed's BF16 optimizer runs at stage 0 or 1 only)."""
    try:
        check_zero(zero_stage, replicas, offload=offload, precision=precision)
    except ValueError:
        return False
    return True


def shard_numel(numel: int, world_size: int) -> int:
    """Elements of one rank's shard: ceil(numel / world_size)."""
    check_int("numel", numel, 0)
    check_int("world_size", world_size, 1)
    return -(-numel // world_size)


def padded_numel(numel: int, world_size: int) -> int:
    """Length of the padded flat buffer: world_size * ceil(numel / world_size)."""
    return shard_numel(numel, world_size) * world_size


def zero_model_state_bytes(n_params: int, world_size: int, stage: int, precision: str = "mixed",
                           optimizer: str = "adam") -> ModelStateBytes:
    """Per-rank model-state bytes under ZeRO ``stage`` 0-3 over ``world_size`` ranks (Chapter 2).

    Stage 1 shards optimizer states, stage 2 also gradients, stage 3 also parameters;
    shards are rounded up (ceil) as padding does.
    """
    check_int("world_size", world_size, 1)
    check_choice("stage", stage, STAGES)
    full = model_state_bytes(n_params, precision, optimizer)
    part = model_state_bytes(shard_numel(n_params, world_size), precision, optimizer)  # the padded shard
    return ModelStateBytes(params=part.params if stage >= 3 else full.params,
                           grads=part.grads if stage >= 2 else full.grads,
                           optimizer=part.optimizer if stage >= 1 else full.optimizer)


def deepspeed_model_state_bytes(n_params: int, world_size: int, stage: int, precision: str = "mixed",
                                optimizer: str = "adam") -> ModelStateBytes:
    """:func:`zero_model_state_bytes` as DeepSpeed 0.19.8 holds them (its ``DeepSpeedZeroOptimizer``
    and ``..._Stage3``, measured in tests/test_export.py on its tensors), where it differs from the
    paper's accounting:

    - at stage 1 it keeps only the rank's gradient partition after a backward, as at stage 2 (its
      stages 1 and 2 are one optimizer; the paper's stage 1 keeps the whole gradient);
    - its fp32 master partition is there even when the model is fp32 (``precision="fp32"``: 4 bytes
      a parameter of the shard more, in ``optimizer``).

    Stages 1 to 3 with ``precision`` "fp32" or "mixed" (bf16 or fp16 with fp32 master weights); the
    other precisions and stage 0 (DeepSpeed's BF16 and FP16 optimizers, not measured) are refused.
    """
    check_choice("stage", stage, (1, 2, 3))
    check_choice("precision", precision, ("fp32", "mixed"))
    states = zero_model_state_bytes(n_params, world_size, stage, precision, optimizer)
    part = model_state_bytes(shard_numel(n_params, world_size), precision, optimizer)
    master = 4 * shard_numel(n_params, world_size) if precision == "fp32" else 0
    return ModelStateBytes(params=states.params, grads=part.grads, optimizer=states.optimizer + master)


def zero_bytes_per_param(stage: int, world_size: int, precision: str = "mixed",
                         optimizer: str = "adam") -> float:
    """Model-state bytes per parameter per rank, unpadded: what stays whole plus what is sharded
    over N_d = ``world_size``. Mixed-precision Adam: 16, 4 + 12/N_d, 2 + 14/N_d, 16/N_d for
    stages 0-3 (Rajbhandari et al. 2020, Section 5). :func:`zero_model_state_bytes` counts the
    padded shards of an actual parameter count, to the byte."""
    check_int("world_size", world_size, 1)
    check_choice("stage", stage, STAGES)
    one = model_state_bytes(1, precision, optimizer)
    parts = ((one.params, 3), (one.grads, 2), (one.optimizer, 1))  # (bytes, the stage that shards them)
    whole = sum(b for b, first in parts if stage < first)
    sharded = sum(b for b, first in parts if stage >= first)
    return whole + sharded / world_size


# Elements moved per rank, per element of the full-size tensor (the paper's convention: an
# all-reduce is a reduce-scatter plus an all-gather; the (N-1)/N factor of a ring is dropped).
VOLUME_WEIGHT = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1}


def comm_volume(numel_by_kind: dict) -> int:
    """Elements a rank communicated, from a CommCounter's ``stats.numel`` (2 per all-reduced one)."""
    unknown = set(k for k, v in numel_by_kind.items() if v) - set(VOLUME_WEIGHT)
    if unknown:
        raise ValueError(f"numel_by_kind has collectives {sorted(unknown)}; "
                         f"valid kinds: {sorted(VOLUME_WEIGHT)}")
    return sum(VOLUME_WEIGHT[k] * v for k, v in numel_by_kind.items())


def analytic_comm_volume(n_params: int, stage: int, world_size: int = 1, group_numels=None) -> int:
    """Elements each rank communicates per step: 2Ψ for stages 0-2 (an all-reduce, or a
    reduce-scatter plus an all-gather), 3Ψ for stage 3 (a second all-gather in backward).

    ``group_numels``: the sizes of the flat groups a sharded stage pads separately to multiples
    of ``world_size``; with them the padded Ψ is used (stage 0 never pads).
    """
    check_choice("stage", stage, STAGES)
    psi = check_int("n_params", n_params, 0)
    if group_numels is not None and stage > 0:
        group_numels = list(group_numels)
        if sum(group_numels) != n_params:
            raise ValueError(f"group_numels sum to {sum(group_numels)}, not n_params={n_params}")
        psi = sum(padded_numel(n, world_size) for n in group_numels)
    return (3 if stage == 3 else 2) * psi


def step_comm_volume(n_params: int, stage: int, num_microbatches: int = 1, *,
                     reshard_after_forward: bool = True) -> dict:
    """Elements a rank moves in one step of m = ``num_microbatches`` micro-batches, by collective,
    as each stage communicates (labkit's, DeepSpeed's and FSDP's): stages 0-1 reduce the
    accumulated gradients once a step (2Ψ: an all-reduce, or a reduce-scatter and the all-gather of
    the updated shards); stage 2 reduce-scatters after every micro-batch's backward (mΨ) and gathers
    the updated parameters once (Ψ); stage 3 gathers the parameters for every forward and again for
    every backward and reduce-scatters every backward (3mΨ). With ``reshard_after_forward=False``
    stage 3 keeps the gathered parameters until the step ends (FSDP's option, torchtitan's default
    under a pipeline, Llama 3's setting): one gather a step and a reduce-scatter a micro-batch,
    (m + 1)Ψ. Weighted as :data:`VOLUME_WEIGHT` (an all-reduce counts 2)."""
    check_choice("stage", stage, STAGES)
    psi, m = check_int("n_params", n_params, 0), check_int("num_microbatches", num_microbatches, 1)
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward={reshard_after_forward!r} must be a bool")
    if stage <= 1:
        return {"reduce_scatter": psi, "all_gather": psi}
    if stage == 2:
        return {"reduce_scatter": m * psi, "all_gather": psi}
    return {"reduce_scatter": m * psi, "all_gather": (2 * m if reshard_after_forward else 1) * psi}


@dataclass(frozen=True)
class OffloadSavings:
    """Per-rank bytes: on the GPU with and without offload, on the CPU, and over PCIe per step."""

    gpu_bytes_without: int
    gpu_bytes_with: int
    cpu_bytes: int
    pcie_bytes_per_step: int


def offload_savings(n_params: int, world_size: int = 1, precision: str = "mixed",
                    optimizer: str = "adam") -> OffloadSavings:
    """What offloading a ZeRO-2 run saves on each GPU (Ren et al. 2021).

    The gradient shard and the optimizer bytes (master weights and states) move to the CPU;
    per step the gradient shard goes down and the parameter shard comes back, both in the
    parameters' dtype. Model states only: activations and transient buckets come on top.
    """
    model_state_bytes(0, precision, optimizer)  # checks precision and optimizer
    zero2 = zero_model_state_bytes(n_params, world_size, 2, precision, optimizer)
    per_param = model_state_bytes(1, precision, optimizer)  # bytes of one parameter and its gradient
    return OffloadSavings(gpu_bytes_without=zero2.total, gpu_bytes_with=zero2.params,
                          cpu_bytes=zero2.grads + zero2.optimizer,
                          pcie_bytes_per_step=(per_param.params + per_param.grads) * shard_numel(n_params, world_size))
