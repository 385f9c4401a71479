"""What Chapter 10's ranks run: ring attention against full attention, the zigzag layout's work,
memory per rank against cp, a GPT trained with context parallelism against one process, and the
benchmark's timings (against PyTorch's own context parallelism where it runs).

Launch with ``labkit.dist.launch(fn, world_size, ...)``; every rank builds the same inputs from
a seed, so each can compare its shard with the whole computation done in one process.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from ..attention import reference_attention
from ..context_parallel.apply import apply_context_parallel
from ..context_parallel.ring import ring_attention
from ..context_parallel.shard import shard_sequence
from ..data import get_batch, load_corpus
from ..dist import CommCounter
from ..memory import MemoryMeter, train_step
from ..model import build_model

__all__ = ["ring_check_rank", "gpt_cp_rank", "bench_rank", "torch_cp_rank", "attention_inputs"]


def attention_inputs(batch_size, n_head, n_kv_head, seq_len, head_dim, dtype=torch.float64, seed=0):
    """q, k, v and an output gradient, drawn from ``seed`` (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch_size, n_head, seq_len, head_dim), (batch_size, n_kv_head, seq_len, head_dim),
              (batch_size, n_kv_head, seq_len, head_dim), (batch_size, n_head, seq_len, head_dim)]
    return [torch.randn(*s, generator=g).to(dtype) for s in shapes]


def _relative_error(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def ring_check_rank(rank, world_size, batch_size=2, n_head=4, n_kv_head=2, seq_len=64, head_dim=16):
    """Per layout, causal: this rank's largest relative error against full attention (SDPA on the
    whole sequence, float64) in out, dq, dk, dv; matmul FLOPs counted; bytes sent in forward."""
    q, k, v, dout = attention_inputs(batch_size, n_head, n_kv_head, seq_len, head_dim)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    ref.backward(dout)
    want = [ref.detach()] + [t.grad for t in full]
    out = {}
    for layout in ("contiguous", "zigzag"):
        def mine(t):
            return shard_sequence(t, world_size, rank, layout=layout, dim=2)
        shards = [mine(t).requires_grad_() for t in (q, k, v)]
        with FlopCounterMode(display=False) as flops, CommCounter() as comm:
            o = ring_attention(*shards, None, causal=True, layout=layout)
        o.backward(mine(dout))
        got = [o.detach()] + [t.grad for t in shards]
        out[layout] = {"error": max(_relative_error(g, mine(w)) for g, w in zip(got, want)),
                       "flops": flops.get_total_flops(), "sent": comm.stats.bytes["send"]}
    return out


def _corpus_batch(cfg, batch_size, seed):
    g = torch.Generator().manual_seed(seed)
    return get_batch(load_corpus(), batch_size, cfg.seq_len, generator=g)


def gpt_cp_rank(rank, world_size, cfg, steps=3, batch_size=2, lr=0.3, memory_cps=()):
    """``steps`` SGD steps of ``cfg`` (float64) with cp = world_size on corpus batches, and the same
    steps in one process on the whole sequences: both losses, and the largest parameter gap. With
    ``memory_cps``: the activation bytes the meter measures on this rank for each cp in it (cp
    ranks starting at rank 0 form each group; cp = 1 runs alone)."""
    def fresh():
        torch.manual_seed(0)
        return build_model(cfg, dtype=torch.float64)
    model, ref = apply_context_parallel(fresh(), None), fresh()
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in (model, ref)]
    losses, ref_losses = [], []
    for step in range(steps):
        x, y = _corpus_batch(cfg, batch_size, seed=step)
        mine = [shard_sequence(t, world_size, rank) for t in (x, y)]
        losses.append(train_step(model, opts[0], mine, keep_loss=True).item())
        ref_losses.append(train_step(ref, opts[1], (x, y), keep_loss=True).item())
    gap = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    out = {"losses": losses, "ref_losses": ref_losses, "param_gap": gap, "activations": {}}
    for cp in memory_cps:  # new_group is collective: every rank creates every group
        groups = [dist.new_group(list(range(s, s + cp))) for s in range(0, world_size, cp)]
        m = apply_context_parallel(fresh(), groups[rank // cp], init_sync=None)
        with MemoryMeter(m) as meter:
            train_step(m, None, [shard_sequence(t, cp, rank % cp) for t in _corpus_batch(cfg, batch_size, 0)],
                       meter=meter)
        out["activations"][cp] = meter.report().activations
    return out


def _time(fn, repeats):
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def bench_rank(rank, world_size, batch_size, n_head, seq_len, head_dim, repeats=3):
    """Forward + backward of causal attention, float32: ring on this rank's zigzag shards, and full
    attention on the whole sequence (what every rank would run without context parallelism), both
    with the core's reference attention, the ring's own kernel for a block.
    Seconds per step and the meter's peak bytes (activations and temporaries) of each."""
    q, k, v, dout = attention_inputs(batch_size, n_head, n_head, seq_len, head_dim, torch.float32)
    shards = [shard_sequence(t, world_size, rank, dim=2) for t in (q, k, v, dout)]

    def ring():
        qs, ks, vs = (t.clone().requires_grad_() for t in shards[:3])
        ring_attention(qs, ks, vs, None, causal=True, check=False).backward(shards[3])

    def full():
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        reference_attention(qf, kf, vf, causal=True).backward(dout)

    out = {}
    for name, fn in (("ring", ring), ("full", full)):
        with MemoryMeter() as meter:
            fn()
        out[name] = {"seconds": _time(fn, repeats), "peak_bytes": meter.report().peak_bytes}
        dist.barrier()
    return out


def torch_cp_rank(rank, world_size, batch_size=1, n_head=4, seq_len=64, head_dim=16):
    """PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` on this backend: whether
    it runs, and if so its causal output's largest relative error against full attention."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    q, k, v, _ = attention_inputs(batch_size, n_head, n_head, seq_len, head_dim, torch.float32)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    bufs = [t.clone() for t in (q, k, v)]
    try:
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(*bufs, is_causal=True)
    except Exception as e:  # noqa: BLE001  (reported, not hidden: the benchmark prints it)
        return {"ran": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    mine = shard_sequence(want, world_size, rank, dim=2)  # torch's layout is the same zigzag
    return {"ran": True, "error": _relative_error(out, mine) if out.shape == mine.shape else "shape differs"}
