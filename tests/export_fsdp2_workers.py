"""What the ranks of tests/test_export.py's FSDP2 check run: the script ``to_fsdp2`` emits, on a
tiny Llama with torchtitan's module names, one training step, against the same model unsharded."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.runs.tensor_parallel_ref import roundoff, roundoff_named
from labkit.runs.zero_reference import adam_agreement

VOCAB, D, HEADS, FF, LAYERS = 64, 32, 4, 64, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x):
        B, S, _ = x.shape
        hd = D // HEADS  # heads split over TP: -1 is this rank's count
        q, k, v = (w(x).view(B, S, -1, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))  # (B, nh, S, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, S, -1))  # (B, S, D)


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False)
        self.w2 = nn.Linear(FF, D, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.output = nn.RMSNorm(D), nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            x = block(x)
        return self.output(self.norm(x))


LR = 1e-2


def _loss(model, tokens):
    logits = model(tokens[:, :-1])  # bf16 logits are taken in fp32, float64 ones stay float64
    return F.cross_entropy(logits.reshape(-1, VOCAB).to(torch.promote_types(logits.dtype, torch.float32)),
                           tokens[:, 1:].reshape(-1))


def _step(model, tokens, pieces: int = 1):
    """One AdamW step on ``tokens``, the batch's mean loss taken whole or as ``pieces`` equal parts
    (the same loss summed in another order: the reference's own round-off)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = [_loss(model, part) / pieces for part in tokens.chunk(pieces)]
    for loss in losses:
        loss.backward()
    opt.step()
    return sum(loss.detach() for loss in losses)


def run_emitted(rank: int, world_size: int, script: str) -> dict:
    """Run ``script``'s ``parallelize`` on a tiny Llama, one AdamW step; report the loss, the
    reference loss of the same model unsharded, and this rank's parameter elements."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    reference = TinyLlama()
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    model = TinyLlama()
    model.load_state_dict(reference.state_dict())
    reference64, other = copy.deepcopy(reference).double(), copy.deepcopy(reference)
    ref_loss, ref_loss64 = _step(reference, tokens), _step(reference64, tokens)
    _step(other, tokens, pieces=2)
    namespace = {}
    exec(compile(script, "<to_fsdp2>", "exec"), namespace)
    model, mesh = namespace["parallelize"](model, device_type="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tracked = _tracked_step(model, opt, tokens)
    loss = tracked.pop("loss")
    local = sum(_local(p).numel() for p in model.parameters())
    after = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
    after = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in after.items()}
    # the step judged against the reference stepped again in another summation order
    # (labkit.runs.zero_reference.adam_agreement); the loss against float64, floored by fp32's own error
    step = adam_agreement({n: p.float() for n, p in after.items()}, dict(reference.named_parameters()), LR,
                          dict(other.named_parameters()))
    return {"loss": float(loss), "ref_loss": float(ref_loss), "local_params": local,
            "loss_roundoff": roundoff(loss.double(), ref_loss, ref_loss64),
            "params": sum(p.numel() for p in reference.parameters()), "mesh": list(mesh.shape), "step": step,
            **tracked}


def _local(t):
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _excess(param) -> int:
    """Bytes of ``param``'s gradient beyond its own shard: torch's RowwiseParallel embedding (vocab
    split over TP) leaves each rank its weight's whole gradient, replicated, not its shard."""
    return _bytes([param.grad]) - _bytes([param])


def _tracked_step(model, opt, tokens) -> dict:
    """One AdamW step on the parallelized ``model``, and this rank's model states after it, counted
    twice: from the tensors themselves (each parameter's local shard, its gradient, Adam's two
    moments and, apart, its 4-byte step counts) and, where fully_shard ran, by torch's
    FSDPMemTracker (its Sharded Param, Sharded Grad and OptState bytes after the step)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import FSDPModule

    params = list(model.parameters())
    tracker = FSDPMemTracker(model, opt) if isinstance(model, FSDPModule) else None
    with tracker if tracker is not None else contextlib.nullcontext():
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        snap = tracker.get_tracker_snapshot("current") if tracker is not None else None
    states = [opt.state[p] for p in params]
    out = {"loss": loss.detach().float(), "param_bytes": _bytes(params), "grad_bytes": _bytes(p.grad for p in params),
           "moment_bytes": _bytes(t for st in states for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")),
           "step_bytes": _bytes(st["step"] for st in states), "names": [n for n, _ in model.named_parameters()],
           "whole_embedding_grad": _excess(model.tok_embeddings.weight)}
    if snap is not None:
        cpu = snap[torch.device("cpu")]
        out["tracker"] = {k: int(cpu.get(k, 0)) for k in ("Sharded Param", "Sharded Grad", "OptState")}
    return out


class _First(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.tok_embeddings, self.block = model.tok_embeddings, model.layers[0]

    def forward(self, tokens):
        return self.block(self.tok_embeddings(tokens))


class _Last(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.block, self.norm, self.output = model.layers[1], model.norm, model.output

    def forward(self, x):
        return self.output(self.norm(self.block(x)))


def run_emitted_pipeline(rank: int, world_size: int, script: str) -> dict:
    """Two pipeline stages from ``script``'s mesh and ``pipeline()``: the micro-batches' mean loss
    and each stage's gradients, against the same model run whole."""
    torch.manual_seed(0)
    reference = TinyLlama()
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    reference64 = copy.deepcopy(reference).double()
    ref_loss = F.cross_entropy(reference(x).reshape(-1, VOCAB), y.reshape(-1))
    ref_loss.backward()
    ref_loss64 = F.cross_entropy(reference64(x).reshape(-1, VOCAB), y.reshape(-1))
    ref_loss64.backward()
    namespace = {}
    exec(compile(script, "<to_fsdp2>", "exec"), namespace)
    model = TinyLlama()
    model.load_state_dict(reference.state_dict())
    model, mesh = namespace["parallelize"](model, device_type="cpu")
    stage = _First(model) if rank == 0 else _Last(model)

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))

    schedule = namespace["pipeline"]([stage], mesh, loss_fn, device="cpu")
    losses = []
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    m = namespace["NUM_MICROBATCHES"]
    ref, ref64 = dict(reference.named_parameters()), dict(reference64.named_parameters())
    names = {n: p for n, p in model.named_parameters() if any(p is q for q in stage.parameters())}
    # each micro-batch's loss is its own mean, and the schedule divides the summed gradients by m:
    # (error against float64, fp32's own error there) of every gradient, each relative to its size
    grads = roundoff_named({n: p.grad for n, p in names.items()}, {n: ref[n].grad for n in names},
                           {n: ref64[n].grad for n in names})
    loss = sum(losses).detach() / m if losses else None
    return {"loss": None if loss is None else float(loss), "ref_loss": float(ref_loss.detach()),
            "loss_roundoff": None if loss is None else roundoff(loss.double(), ref_loss.detach(), ref_loss64.detach()),
            "grads": grads, "mesh": list(mesh.shape), "stages": len(names)}
