"""The budgeted plan: the least recomputation whose peak fits a memory budget (Chen et al. 2016, Sec. 4).

Chen et al. search the checkpoints for a budget greedily; our blocks are identical, so an exact
dynamic program is cheap. Walk the blocks in order; a state is (blocks placed, bytes kept so far),
which is all a later segment's peak depends on. From each state, place a block without
checkpointing, a selective block, or a full segment of any length; drop any move whose peak
(:func:`labkit.checkpoint.analytic.checkpoint_activation_bytes`) exceeds the budget; keep per
state the cheapest way there (fewest recomputed FLOPs, then the lowest peak), and drop a state
that keeps more bytes than another for no fewer FLOPs and no lower peak (GPT-3's 96 blocks: seconds).
"""

from __future__ import annotations

from ..model import check_gpt2_block
from ..validate import check_int
from .analytic import _head_peak, _segment_peak, block_bytes, block_forward_flops, core_forward_flops
from .plan import Plan

__all__ = ["plan_for_budget", "min_peak_plan"]


def _search(cfg, batch_size, seq_len, budget, by_peak, **kw):
    """Best (cost, peak, segments) over all plans whose peak <= budget; by_peak: minimise the peak."""
    # the byte formulas (labkit.checkpoint.analytic) follow GPT-2's block; a Llama-family block's
    # parts (RMSNorm, SwiGLU, rotary, grouped-query attention) keep other tensors
    check_gpt2_block(cfg, "the checkpointing planner (policy='budget')")
    q = block_bytes(cfg, batch_size, seq_len, **kw)
    L = cfg.n_layer
    f_block, f_core = block_forward_flops(cfg, batch_size, seq_len), core_forward_flops(cfg, batch_size, seq_len)
    keep = {"none": q.A, "selective": q.A - q.C, "full": q.u}
    key = (lambda c, p: (p, c)) if by_peak else (lambda c, p: (c, p))
    best = [{} for _ in range(L + 1)]  # blocks placed -> {bytes kept: (flops, peak so far, segments)}
    best[0][0] = (0, 0, ())
    for i in range(L):
        frontier = []  # (flops, peak) of the states kept at i, by increasing bytes kept
        for kept, (cost, peak, segs) in sorted(best[i].items()):
            # every later peak grows with the bytes kept: a state that keeps more for no fewer
            # FLOPs and no lower peak than another can only end worse, so it is dropped
            if any(c <= cost and p <= peak for c, p in frontier):
                continue
            frontier.append((cost, peak))
            moves = [("none", 1, 0), ("selective", 1, f_core)] + [("full", n, n * f_block) for n in range(1, L - i + 1)]
            for mode, n, flops in moves:
                seg_peak = max(peak, kept + q.rest + _segment_peak(q, mode, n))
                if seg_peak > budget:
                    continue
                states, value = best[i + n], (cost + flops, seg_peak, segs + ((mode, n),))
                if kept + keep[mode] not in states or key(*value[:2]) < key(*states[kept + keep[mode]][:2]):
                    states[kept + keep[mode]] = value
    finals = []
    for kept, (cost, peak, segs) in best[L].items():
        total = max(peak, _head_peak(q, kept + q.head))
        if total <= budget:
            finals.append((cost, total, segs))
    return min(finals, key=lambda v: key(v[0], v[1]), default=None)


def min_peak_plan(cfg, batch_size: int, seq_len: int | None = None, *, dtype_bytes: int = 4,
                  device_type: str = "cpu", training: bool = True) -> tuple[int, Plan]:
    """The smallest peak any plan reaches, and the cheapest plan that reaches it."""
    kw = dict(dtype_bytes=dtype_bytes, device_type=device_type, training=training)
    _, peak, segs = _search(cfg, batch_size, seq_len, float("inf"), by_peak=True, **kw)
    _, peak, segs = _search(cfg, batch_size, seq_len, peak, by_peak=False, **kw)
    return peak, Plan(segs)


def plan_for_budget(cfg, budget: int, batch_size: int, seq_len: int | None = None, *, dtype_bytes: int = 4,
                    device_type: str = "cpu", training: bool = True) -> Plan:
    """The plan with the fewest recomputed FLOPs whose predicted step peak is at most ``budget`` bytes.

    The peak counts activations and temporaries, as :class:`labkit.memory.MemoryMeter` measures them.
    A budget below the smallest reachable peak raises ``ValueError`` naming that peak.
    """
    check_int("budget", budget, 1)
    kw = dict(dtype_bytes=dtype_bytes, device_type=device_type, training=training)
    found = _search(cfg, batch_size, seq_len, budget, by_peak=False, **kw)
    if found is None:
        smallest, plan = min_peak_plan(cfg, batch_size, seq_len, **kw)
        raise ValueError(f"budget={budget:,} bytes is below the smallest peak that can be reached, "
                         f"{smallest:,} bytes (plan {plan}) for batch_size={batch_size}, "
                         f"seq_len={seq_len or cfg.seq_len}, n_layer={cfg.n_layer}")
    return Plan(found[2])
