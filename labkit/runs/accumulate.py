"""What each rank runs for Chapter 4's data-parallel accumulation (importable, for ``labkit.dist.launch``)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ..accumulate import accumulate_gradients_ddp, accumulate_gradients_ddp_naive, global_token_count, split_microbatches
from ..dist import CommCounter
from ..model import build_model
from ..data_parallel import DataParallelBucketed

__all__ = ["ddp_window_worker", "WRAPPERS"]

# how the ranks' model is wrapped: torch's DistributedDataParallel or labkit's own (Chapter 2),
# each with every gradient in one bucket, so that one call is one round over all the gradients
WRAPPERS = {
    "torch": lambda model, bucket_cap_mb: DDP(model, bucket_cap_mb=bucket_cap_mb),
    "labkit": lambda model, bucket_cap_mb: DataParallelBucketed(model, bucket_numel=int(bucket_cap_mb * 2**20) // 4),
}


def ddp_window_worker(rank: int, world_size: int, cfg, x: torch.Tensor, y: torch.Tensor, num_microbatches: int,
                      lr: float = 0.1, seed: int = 0, bucket_cap_mb: float = 100.0, wrappers=("torch",)) -> dict:
    """One accumulation window on this rank's shard of x, y (B, T), with and without ``no_sync``.

    For each variant ("no_sync", "every_step"; with ``wrappers`` beyond "torch", also
    "<wrapper>_no_sync" and "<wrapper>_every_step"): the all-reduce calls and elements issued
    during the window's k forward/backward passes (the token-count all-reduce before it not
    counted), the rank's loss share and the flat parameters after one SGD step.
    ``bucket_cap_mb`` large enough puts every gradient in one bucket: one call per round.
    Runs on CPU: launch it with ``backend="gloo"``.
    """
    torch.set_num_threads(1)  # ranks share the machine's cores, as under torchrun (OMP_NUM_THREADS=1)
    xs, ys = x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]  # this rank's (B/W, T)
    out = {"n_params": None}
    for wrapper in wrappers:
        prefix = "" if wrapper == "torch" else f"{wrapper}_"
        for name, accumulate in (("no_sync", accumulate_gradients_ddp), ("every_step", accumulate_gradients_ddp_naive)):
            torch.manual_seed(seed)
            model = build_model(cfg)
            out["n_params"] = sum(p.numel() for p in model.parameters())
            ddp = WRAPPERS[wrapper](model, bucket_cap_mb)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
            microbatches = split_microbatches(xs, ys, num_microbatches)
            n_tokens = global_token_count(microbatches)  # N of the whole window, all ranks
            with CommCounter() as comm:
                loss = accumulate(ddp, microbatches, n_tokens, world_size)
            optimizer.step()
            out[prefix + name] = {
                "all_reduce_calls": comm.stats.calls["all_reduce"],
                "all_reduce_numel": comm.stats.numel["all_reduce"],
                "loss": loss,
                "params": torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().copy(),
            }
    return out
