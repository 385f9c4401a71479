"""What Chapter 9's ranks run: tensor parallelism, ZeRO and recomputation composed on one model,
one step measured by the memory meter, for the estimator to predict.

``composed_rank`` serves the lab; launch it with ``labkit.dist.launch(composed_rank, world_size,
cases)``. Each case is ``(dp_size, tp_size, zero_stage, recompute, sequence_parallel)``, composed
by ``labkit.parallel.parallelize_gpt`` (tensor parallelism over "tp", the blocks checkpointed,
AdamW sharded by ZeRO-1 or 2 over "dp"); this module only measures.
Every rank returns its measured bytes by category: parameters, gradients, optimizer states (and,
apart, AdamW's step counts among them) and the activations kept at the end of forward.
"""

from __future__ import annotations

import torch

from ..dist import rank_device
from ..memory.meter import MemoryMeter, train_step
from ..model import build_model, get_preset
from ..parallel import ParallelDims, parallelize_gpt
from .zero import _StateView

__all__ = ["composed_rank", "CASE_FIELDS"]

CASE_FIELDS = ("dp_size", "tp_size", "zero_stage", "recompute", "sequence_parallel")


def _measure_case(cfg, batch_size: int, dp: int, tp: int, zero_stage: int, recompute: str, sp: bool, dev) -> dict:
    """One measured step of one composed configuration on this rank."""
    dims = ParallelDims(dp_size=dp, tp_size=tp)
    torch.manual_seed(0)  # the same model on every rank, as parallelize_gpt checks
    pm = parallelize_gpt(build_model(cfg, device=dev), dims, dims.build_mesh(dev.type),
                         sequence_parallel=sp, zero_stage=zero_stage, checkpoint=recompute)
    opt = pm.build_optimizer(torch.optim.AdamW, lr=1e-3)
    view = _StateView(pm.model, [s for _, _, _, s in opt.shard_entries()])
    g = torch.Generator().manual_seed(1)  # the global batch, the same on every rank
    x = torch.randint(0, cfg.vocab_size, (dp * batch_size, cfg.seq_len), generator=g).to(dev)  # (B, s)
    x, y = pm.shard_batch(x, torch.roll(x, -1, dims=1))  # this replica's (b, s); next tokens as targets
    with MemoryMeter(view, opt) as meter:  # one micro-batch: forward_backward's step, in the meter's phases
        train_step(pm.model, opt, (x, y), meter=meter, zero_grad=False)
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
