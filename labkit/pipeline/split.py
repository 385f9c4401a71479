"""Cut the GPT into pipeline stages: contiguous layer ranges, balanced by parameters or a cost.

The embedding goes with the first stage, the final norm and the output layer with the last;
with tied embeddings both ends hold the shared weight and sum its gradient (the runtime's
``tied``), with untied ones (Llama) each holds its own. Rotary positions need no table: every
block rotates by positions 0..T-1 of the micro-batch it runs. With v chunks per rank the model
is cut into v p virtual stages of equal layer count (Narayanan et al. 2021b); chunk c of rank r
is virtual stage c p + r.
"""

from __future__ import annotations

import torch.nn as nn

from ..shapes import layer_split
from ..validate import check_float, check_int

__all__ = ["split_stages", "StageChunk", "build_chunks"]


def _partition(costs: list[float], first: float, last: float, n: int) -> list[tuple[int, int]]:
    """Contiguous split of ``costs`` into n non-empty ranges minimising the largest range's cost
    (``first`` added to range 0, ``last`` to range n - 1): dynamic programming over cut points."""
    L, INF = len(costs), float("inf")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i, j, s):  # layers [i, j) as stage s
        return prefix[j] - prefix[i] + (first if s == 0 else 0) + (last if s == n - 1 else 0)

    best = [[INF] * (L + 1) for _ in range(n + 1)]  # best[s][j]: first j layers in s stages
    cut = [[0] * (L + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for s in range(1, n + 1):
        for j in range(s, L - (n - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], cost(i, j, s - 1))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds, j = [], L
    for s in range(n, 0, -1):
        bounds.append((cut[s][j], j))
        j = cut[s][j]
    return bounds[::-1]


def _check_costs(costs, n_layer: int) -> None:
    """One finite, non-negative number per layer (an infinite or NaN cost makes every split tie,
    and the search would return an empty stage)."""
    if len(costs) != n_layer:
        raise ValueError(f"costs has {len(costs)} entries; it needs n_layer={n_layer} finite, "
                         "non-negative numbers")
    for i, c in enumerate(costs):
        check_float(f"costs[{i}]", c, 0.0)


def split_stages(model, pp_size: int, *, v: int = 1, costs: list[float] | None = None) -> list[tuple[int, int]]:
    """Layer ranges ``(start, stop)`` of the v p virtual stages, in pipeline order.

    v = 1: balanced by parameter count (embedding on stage 0, final LayerNorm and output layer on
    the last) or by ``costs``, one number per layer; v > 1: balanced by ``costs`` when given, else
    ``labkit.shapes.layer_split``'s v p ranges (equal, the first L mod v p one layer more).
    """
    L = len(model.blocks)
    check_int("pp_size", pp_size, 1)
    check_int("v", v, 1)
    if pp_size * v > L:
        raise ValueError(f"pp_size={pp_size} x v={v} stages exceed the model's n_layer={L}: "
                         "each stage needs at least one layer")
    if costs is not None:
        _check_costs(costs, L)
        return _partition([float(c) for c in costs], 0.0, 0.0, pp_size * v)
    if v > 1:
        sizes = layer_split(L, pp_size * v)
        return [(sum(sizes[:k]), sum(sizes[:k + 1])) for k in range(pp_size * v)]
    per_layer = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    first = sum(m.weight.numel() for m in (model.wte, model.wpe) if m is not None)  # rotary: no wpe
    last = sum(p.numel() for p in model.ln_f.parameters()) + model.lm_head.weight.numel()
    return _partition([float(c) for c in per_layer], float(first), float(last), pp_size)


class StageChunk(nn.Module):
    """Layers [start, stop) of a GPT, with its embedding if ``first`` and its head if ``last``.

    forward: idx (B, T) int64 (first) or x (B, T, C) -> x (B, T, C), or logits (B, T, V) (last).
    The modules are the model's own (no copies): the chunk's parameters are the model's.
    ``tied_embeddings``: whether the model's first and last stage share the embedding weight.
    """

    def __init__(self, model, start: int, stop: int, first: bool, last: bool):
        super().__init__()
        self.start, self.stop, self.first, self.last = start, stop, first, last
        self._gpt = [model]  # in a list: the parts below, not the whole model, are submodules
        wte, lm_head = getattr(model, "wte", None), getattr(model, "lm_head", None)
        self.tied_embeddings = wte is not None and lm_head is not None and lm_head.weight is wte.weight
        self.blocks = nn.ModuleList(model.blocks[start:stop])
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x):
        if self.first:
            x = self._gpt[0].embed(x)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        return self._gpt[0].head(x) if self.last else x  # (B, T, V) or (B, T, C)


def build_chunks(model, ranges: list[tuple[int, int]], pp_size: int, rank: int) -> list[StageChunk]:
    """The chunks rank ``rank`` holds: virtual stages rank, rank + p, ... of ``ranges``."""
    check_int("pp_size", pp_size, 1)
    check_int("rank", rank, 0, pp_size - 1)
    n = len(ranges)
    if n == 0 or n % pp_size:
        raise ValueError(f"ranges has {n} stages; it needs a positive multiple of "
                         f"pp_size={pp_size} (split_stages gives v x pp_size)")
    return [StageChunk(model, *ranges[k], first=k == 0, last=k == n - 1) for k in range(rank, n, pp_size)]
