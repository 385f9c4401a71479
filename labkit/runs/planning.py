"""What Chapter 9's ranks run: tensor parallelism, ZeRO and recomputation composed on one model,
one step measured by the memory meter, for the estimator to predict.

``composed_rank`` serves the lab; launch it with ``labkit.dist.launch(composed_rank, world_size,
cases)``. Each case is ``(dp_size, tp_size, zero_stage, recompute, sequence_parallel)`` on a
(dp, tp) mesh: the tiny GPT sharded over "tp" (``labkit.tensor_parallel``), its blocks
checkpointed (``labkit.checkpoint``), AdamW sharded over "dp" (ZeRO-1 or 2, ``labkit.zero``).
Every rank returns its measured bytes by category: parameters, gradients, optimizer states (and,
apart, AdamW's step counts among them) and the activations kept at the end of forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..checkpoint import apply_checkpointing
from ..dist import rank_device
from ..memory.meter import MemoryMeter, train_step
from ..model import build_model, get_preset
from ..tensor_parallel import apply_tensor_parallel
from ..zero import ShardedGradOptimizer, ShardedOptimizer
from .zero import _StateView

__all__ = ["composed_rank", "CASE_FIELDS", "OPTIMIZERS"]

CASE_FIELDS = ("dp_size", "tp_size", "zero_stage", "recompute", "sequence_parallel")
OPTIMIZERS = {1: ShardedOptimizer, 2: ShardedGradOptimizer}  # ZeRO stage -> the sharded optimizer


def _measure_case(cfg, batch_size: int, dp: int, tp: int, zero_stage: int, recompute: str, sp: bool, dev) -> dict:
    """One measured step of one composed configuration on this rank."""
    world = dist.get_world_size()
    mesh = init_device_mesh(dev.type, (dp, tp), mesh_dim_names=("dp", "tp")) if dp * tp == world else None
    if mesh is None:
        raise ValueError(f"dp_size={dp} x tp_size={tp} must equal world_size={world}")
    torch.manual_seed(0)
    model = build_model(cfg, device=dev)
    apply_tensor_parallel(model, mesh.get_group("tp"), sp)
    apply_checkpointing(model, recompute)
    opt = OPTIMIZERS[zero_stage](model.parameters(), torch.optim.AdamW, group=mesh.get_group("dp"), lr=1e-3)
    view = _StateView(model, [s for _, _, _, s in opt.shard_entries()])
    g = torch.Generator().manual_seed(1 + dist.get_rank(mesh.get_group("dp")))  # each dp rank its own rows
    x = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), generator=g).to(dev)  # (b, s)
    y = torch.roll(x, -1, dims=1)  # (b, s): the next token (the last wraps round)
    with MemoryMeter(view, opt) as meter:
        train_step(model, opt, (x, y), meter=meter, zero_grad=False)
    report = meter.report()
    # torch's AdamW keeps a 4-byte `step` count a tensor (on the host on a GPU): counted apart
    steps = sum(st["step"].nbytes for st in opt.state.values() if torch.is_tensor(st.get("step")))
    return {"params": report.max_by_category["parameters"], "grads": report.max_by_category["gradients"],
            "optimizer": report.max_by_category["optimizer"], "activations": report.activations,
            "step_counters": steps if dev.type == "cpu" else 0}


def composed_rank(rank: int, world_size: int, cases, cfg="tiny", batch_size: int = 2) -> list[dict]:
    """Each case of ``cases`` (tuples of :data:`CASE_FIELDS`) measured on this rank, in order."""
    dev = rank_device()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    out = []
    for case in cases:
        dp, tp, zero_stage, recompute, sp = case
        out.append({**dict(zip(CASE_FIELDS, case)), "rank": rank,
                    **_measure_case(get_preset(cfg) if isinstance(cfg, str) else cfg, batch_size,
                                    dp, tp, zero_stage, recompute, sp, dev)})
    return out
