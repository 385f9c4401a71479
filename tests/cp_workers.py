"""What the context-parallel tests' ranks run: one 4-rank launch serves the whole test file.

Groups: cp = 2 over ranks {0, 1} and {2, 3} (each pair runs its own cases), cp = 4 over all four,
cp = 1 over each rank alone; tp x cp = 2 x 2 with tensor-parallel pairs {0, 1}, {2, 3} and
context-parallel pairs {0, 2}, {1, 3}. Everything is float64 but one run of the ring cases in bfloat16.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from labkit.checkpoint import checkpoint_scratch
from labkit.context_parallel import apply_context_parallel, ring_attention, shard_sequence
from labkit.dist import CommCounter
from labkit.memory import MemoryMeter, train_step
from labkit.model import GPTConfig, build_model
from labkit.parallel import ParallelDims, parallelize_gpt
from labkit.tensor_parallel import apply_tensor_parallel

DT = torch.float64
# (B, h, h_kv, S, d): odd head dims, grouped-query attention in one case
RING_SHAPES = [(2, 4, 4, 16, 5), (1, 4, 2, 16, 3)]
RING_CASES = [(shape, causal, layout) for shape in RING_SHAPES for causal in (False, True)
              for layout in ("contiguous", "zigzag")]
FAMILIES = {
    "gpt2": GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=16, vocab_size=64),
    "llama": GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=16, vocab_size=64, norm="rmsnorm",
                       mlp="swiglu", pos="rope", tie_embeddings=False, bias=False),
}
BATCH, STEPS, LR = 2, 3, 0.5


def ring_inputs(shape, seed):
    """q, k, v and the output's gradient of a ring case, the same on every rank and in the test."""
    B, h, h_kv, S, d = shape
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*dims, generator=g, dtype=DT) for dims in
            ((B, h, S, d), (B, h_kv, S, d), (B, h_kv, S, d), (B, h, S, d))]


def batch(cfg, seed, ignore=True):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(cfg.vocab_size, (BATCH, cfg.seq_len), generator=g)
    targets = torch.randint(cfg.vocab_size, (BATCH, cfg.seq_len), generator=g)
    if ignore:
        targets[0, :3] = -100  # a few positions with no target: the global count is what divides
    return idx, targets


def seeded_model(cfg):
    torch.manual_seed(0)
    return build_model(cfg, dtype=DT)


def _ring(group, rank, cp, dtype=DT):
    """Every ring case on this group: this rank's output and gradient shards (inputs cast to ``dtype``)."""
    out = {}
    for i, (shape, causal, layout) in enumerate(RING_CASES):
        q, k, v, dout = (t.to(dtype) for t in ring_inputs(shape, seed=i))
        mine = [shard_sequence(t, cp, rank, layout=layout, dim=2).requires_grad_() for t in (q, k, v)]
        o = ring_attention(*mine, group, causal=causal, layout=layout)
        o.backward(shard_sequence(dout, cp, rank, layout=layout, dim=2))
        out[i] = [o.detach()] + [t.grad for t in mine]
    return out


def _saved(group, rank, cp):
    """The bytes of each tensor autograd keeps for the ring's backward (saved-tensor hooks), for the
    grouped-query case, causal, zigzag, in fp32 and bf16, plain and checkpointed (selective)."""
    shape, saved = RING_SHAPES[1], {}
    for dtype in (torch.float32, torch.bfloat16):
        for recompute in ("none", "selective"):
            q, k, v, _ = ring_inputs(shape, seed=0)
            mine = [shard_sequence(t.to(dtype), cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
            attend = ring_attention if recompute == "none" else partial(checkpoint_scratch, ring_attention, params=[])
            kept = []

            def pack(t):
                kept.append(t.numel() * t.element_size())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                attend(*mine, group, causal=True)
            saved[str(dtype).removeprefix("torch."), recompute] = kept
    return saved


def _flops(group, rank, cp):
    """Matmul FLOPs of one causal ring forward on this rank, per layout, counted as they run."""
    q, k, v, _ = ring_inputs(RING_SHAPES[0], seed=0)
    counted = {}
    for layout in ("contiguous", "zigzag"):
        mine = [shard_sequence(t, cp, rank, layout=layout, dim=2) for t in (q, k, v)]
        with FlopCounterMode(display=False) as fc:
            ring_attention(*mine, group, causal=True, layout=layout)
        counted[layout] = fc.get_total_flops()
    return counted


def _train(cfg, group, rank, cp, counters=False):
    """STEPS plain SGD steps on this rank's shards; losses, parameters, per-pass bytes sent."""
    model = apply_context_parallel(seeded_model(cfg), group)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, sent = [], []
    for step in range(STEPS):
        idx, targets = (shard_sequence(t, cp, rank) for t in batch(cfg, seed=step))
        with CommCounter() as fwd:
            loss = model(idx, targets)
        with CommCounter() as bwd:
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        sent.append((fwd.stats.bytes["send"], bwd.stats.bytes["send"]))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "sent": sent, "reductions": model._cp_grad_sum.reductions}


def _memory(cfg, group, rank, cp):
    """Activation bytes one forward keeps on this rank (the memory meter), and the step's peak."""
    model = apply_context_parallel(seeded_model(cfg), group)
    idx, targets = (shard_sequence(t, cp, rank) for t in batch(cfg, seed=0))
    with MemoryMeter(model) as meter:
        train_step(model, None, (idx, targets), meter=meter)
    report = meter.report()
    return {"activations": report.activations, "peak": report.peak_bytes}


def _refusal(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _refusals(group, rank, cp):
    """Bad inputs, refused with a ValueError on every rank (none of them hangs)."""
    q, k, v, _ = ring_inputs(RING_SHAPES[0], seed=0)
    mine = [shard_sequence(t, cp, rank, layout="contiguous", dim=2) for t in (q, k, v)]
    uneven = [t[..., : t.size(-2) - rank, :] for t in mine]  # rank 1 holds one token fewer
    odd = [t[..., :3, :] for t in mine]
    return {
        "mismatched_across_ranks": _refusal(lambda: ring_attention(*uneven, group, layout="contiguous")),
        "zigzag_odd_shard": _refusal(lambda: ring_attention(*odd, group, layout="zigzag")),
        "cp_size_vs_group": _refusal(lambda: apply_context_parallel(seeded_model(FAMILIES["gpt2"]), group,
                                                                    cp_size=cp + 1)),
    }


def _tp_cp(cfg, tp_group, cp_group, cp_rank):
    """tp = 2 x cp = 2: tensor parallelism first, then context parallelism; STEPS plain steps."""
    model = apply_tensor_parallel(seeded_model(cfg), tp_group)
    model = apply_context_parallel(model, cp_group)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        idx, targets = (shard_sequence(t, 2, cp_rank) for t in batch(cfg, seed=step))
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "ln_f": model.ln_f.weight.detach().clone()}


def _parallelized(cfg, dims, ignore):
    """parallelize_gpt over a (dp, pp, cp, tp) mesh, STEPS steps of its plain loop: the losses
    (each data-parallel replica's) and the parameters (this tensor-parallel rank's shards)."""
    pm = parallelize_gpt(seeded_model(cfg), dims, dims.build_mesh("cpu"))
    opt = pm.build_optimizer(torch.optim.SGD, lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        losses.append(pm.forward_backward(*pm.shard_batch(*batch(cfg, seed=step, ignore=ignore))))
        opt.step()
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in pm.named_parameters()}}


def cp_checks(rank, world_size):
    """Every distributed check of tests/test_context_parallel.py, on 4 ranks."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(world_size)]
    cp_pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pair, pair_rank, family = pairs[rank // 2], rank % 2, ("gpt2", "llama")[rank // 2]
    res = {"ring2": _ring(pair, pair_rank, 2), "ring4": _ring(None, rank, 4)}
    res["ring2_bf16"], res["ring4_bf16"] = _ring(pair, pair_rank, 2, torch.bfloat16), _ring(None, rank, 4, torch.bfloat16)
    res["flops4"] = _flops(None, rank, 4)
    res["saved2"] = _saved(pair, pair_rank, 2)
    res["refusals"] = _refusals(pair, pair_rank, 2)
    res["family"] = family
    res["train2"] = _train(FAMILIES[family], pair, pair_rank, 2)  # pair {0, 1}: GPT-2; {2, 3}: Llama
    res["memory"] = {cp: _memory(FAMILIES["llama"], g, r, cp)
                     for cp, g, r in ((1, singles[rank], 0), (2, pair, pair_rank), (4, None, rank))}
    res["tp_cp"] = _tp_cp(FAMILIES["gpt2"], pairs[rank // 2], cp_pairs[rank % 2], rank // 2)
    res["parallelize"] = {"tp2_cp2": _parallelized(FAMILIES["gpt2"], ParallelDims(tp_size=2, cp_size=2), True),
                          "dp2_cp2": _parallelized(FAMILIES["llama"], ParallelDims(dp_size=2, cp_size=2), False)}
    return res


def reference_training(cfg, ignore=True):
    """The same STEPS steps in one process on the whole sequence: losses and parameters."""
    model = seeded_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(*batch(cfg, seed=step, ignore=ignore))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "ln_f": model.ln_f.weight.detach().clone()}


__all__ = ["cp_checks", "reference_training", "ring_inputs", "batch", "RING_CASES", "RING_SHAPES", "FAMILIES"]
