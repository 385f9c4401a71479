"""The reference Chapter 2's schemes are judged against: one process on the whole batch.

``reference_run`` trains the tiny GPT in one process, also in another summation order
(``pieces``); ``adam_agreement`` judges a scheme's parameters against it, to the round-off that
pair measures; ``rank_batch`` gives every world size the same global batches.
"""

from __future__ import annotations

import torch

from ..data import get_batch, load_corpus
from ..memory.meter import train_step
from ..model import build_model
from ..validate import check_int

__all__ = ["adam_agreement", "make_model", "rank_batch", "reference_run"]


def rank_batch(corpus, step, rank, world_size, global_batch, seq_len, seed, device="cpu"):
    """Rank ``rank``'s rows of the global batch of ``step``: the same data at any world size."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    x, y = get_batch(corpus, global_batch, seq_len, generator=gen)  # (B, T) each
    b = global_batch // world_size
    return x[rank * b:(rank + 1) * b].to(device), y[rank * b:(rank + 1) * b].to(device)


def make_model(preset, seed, device):
    torch.manual_seed(seed)  # the same initial parameters on every rank
    return build_model(preset, device=device)


def _loss_in_pieces(pieces):
    """The mean loss of a batch as ``pieces`` blocks of rows: the mean of their means (equal rows)."""
    def loss_fn(model, batch):
        x, y = batch
        return sum(model(xi, yi) for xi, yi in zip(x.tensor_split(pieces), y.tensor_split(pieces))) / pieces
    return loss_fn


def reference_run(steps=4, *, preset="tiny", global_batch=8, seq_len=32, lr=3e-3, weight_decay=0.1, seed=0,
                  pieces=1, device="cpu"):
    """Single-process training on the whole global batch: (losses, final state dict).

    ``pieces > 1`` computes each step's loss as the mean over that many blocks of rows, added up
    before one backward pass: the same mathematics in another summation order, whose distance
    from ``pieces=1`` is the round-off floor :func:`adam_agreement` judges a scheme against.
    """
    check_int("pieces", pieces, 1, global_batch)
    if global_batch % pieces:
        raise ValueError(f"pieces={pieces} must divide global_batch={global_batch}")
    model = make_model(preset, seed, device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    corpus, losses = load_corpus(), []
    loss_fn = _loss_in_pieces(pieces) if pieces > 1 else None
    for step in range(steps):
        batch = rank_batch(corpus, step, 0, 1, global_batch, seq_len, seed, device=device)
        losses.append(train_step(model, opt, batch, loss_fn=loss_fn, keep_loss=True).item())
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _flat_abs_diff(a: dict, b: dict) -> torch.Tensor:
    return torch.cat([(torch.as_tensor(a[k]).detach().double() - torch.as_tensor(b[k]).detach().double())
                      .abs().reshape(-1) for k in b])


def adam_agreement(ours: dict, ref: dict, lr: float, ref_other, factor: float = 4.0,
                   quantile: float = 0.999) -> dict:
    """Whether AdamW-trained parameters ``ours`` follow ``ref`` to the run's own round-off.

    ``ref_other`` (one state dict or a list) is ``ref`` trained again in another summation order
    (:func:`reference_run` with ``pieces``): its distance from ``ref`` is the floor. The scheme
    passes when all but 1 - ``quantile`` of its elements are within ``factor`` times the floor's
    same quantile (floored at one fp32 ulp of the parameters' rms). The few elements whose
    gradient is itself round-off (a key bias's) AdamW moves by about lr * g / (|g| + eps), by
    amounts that change from machine to machine and order to order: their largest difference is
    reported ("max", beside "floor_max"), not judged. Returns those, "share_off" (the share
    beyond 1e-6), "ok", "names_match" and ``lr``.
    """
    others = ref_other if isinstance(ref_other, (list, tuple)) else [ref_other]
    if ours.keys() != ref.keys() or any(o.keys() != ref.keys() for o in others):
        return {"max": float("inf"), "share_off": 1.0, "floor_max": 0.0, "ok": False, "names_match": False}
    d = _flat_abs_diff(ours, ref)
    f = torch.stack([_flat_abs_diff(o, ref) for o in others]).amax(0)  # the floor, element by element
    ulp = 2**-24 * float(torch.cat([torch.as_tensor(v).detach().double().reshape(-1) for v in ref.values()])
                         .square().mean().sqrt())
    k = max(1, int(quantile * d.numel()))
    bulk, bulk_floor = (float(t.kthvalue(k).values) for t in (d, f))
    return {"max": float(d.max()), "share_off": float((d > 1e-6).double().mean()), "floor_max": float(f.max()),
            "ok": bulk <= factor * max(bulk_floor, ulp), "names_match": True, "lr": lr}
