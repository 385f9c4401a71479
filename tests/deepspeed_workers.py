"""What the ranks of tests/test_export.py's DeepSpeed run execute (in .venv-engines): each emitted
ds_config.json drives one training step of tests/export_fsdp2_workers.py's TinyLlama, and each rank
reports the model states DeepSpeed's own tensors hold.

One change to the emitted configuration, and only for the test: the optimizer is torch's AdamW,
passed to ``deepspeed.initialize``, in place of the config's ``{"type": "AdamW"}``. DeepSpeed's own
AdamW is a C++ op (FusedAdam; DeepSpeedCPUAdam under offload) JIT-compiled on first use, 60 to 220 s
on a fresh 2-core machine; torch's keeps the same two fp32 moments a parameter of the shard.
"""

from __future__ import annotations

import os
import sys


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _init() -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (the module object is taken from sys.modules below)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # the shared-memory op's 60 s JIT build
    deepspeed.init_distributed(dist_backend="gloo")  # takes the launcher's gloo group


def _one_step(config: dict, rank: int) -> dict:
    import deepspeed
    import torch
    import torch.nn.functional as F

    import export_fsdp2_workers as w

    config = {k: v for k, v in config.items() if k != "optimizer"}
    config["zero_force_ds_cpu_optimizer"] = False  # offload with torch's AdamW (see the docstring)
    stage = config["zero_optimization"]["stage"]
    torch.manual_seed(0)
    if stage == 3:  # ZeRO-3 partitions the parameters as the model is built
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = w.TinyLlama()
    else:
        model = w.TinyLlama()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                           config=config)
    tokens = torch.randint(0, w.VOCAB, (1, 17), generator=torch.Generator().manual_seed(1 + rank))
    logits = engine(tokens[:, :-1])
    engine.backward(F.cross_entropy(logits.reshape(-1, w.VOCAB).float(), tokens[:, 1:].reshape(-1)))
    zero = engine.optimizer
    grads = zero.averaged_gradients  # this rank's gradient partition, right after the backward
    grads = [g for v in (grads.values() if isinstance(grads, dict) else grads) for g in v]
    if stage == 3:
        params, master = [p.ds_tensor for p in model.parameters()], zero.fp32_partitioned_groups_flat
    else:
        params, master = [p.data for p in model.parameters()], zero.single_partition_of_fp32_groups
    out = {"stage": stage, "params": _nbytes(params), "grads": _nbytes(grads), "master": _nbytes(master),
           "whole_grads_left": _nbytes(p.grad for p in model.parameters() if p.grad is not None),
           "param_dtype": str(next(model.parameters()).dtype).replace("torch.", "")}
    engine.step()
    state = zero.optimizer.state.values()
    out["moments"] = _nbytes(t for st in state for k, t in st.items() if k in ("exp_avg", "exp_avg_sq"))
    return out


def run_configs(rank: int, world_size: int, configs: list) -> list:
    """One step under each ds_config in ``configs``, one engine after another in this process."""
    _init()
    return [_one_step(config, rank) for config in configs]


def main() -> None:
    """Read a JSON list of ds_configs on stdin; print what rank 0 and rank 1 held under each."""
    import json

    from deepspeed_workers import run_configs  # by its module name, which the spawned ranks import

    from labkit.dist import launch

    configs = json.load(sys.stdin)
    print(json.dumps(launch(run_configs, 2, configs, backend="gloo", timeout_s=120)))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # export_fsdp2_workers, for the ranks
    main()
