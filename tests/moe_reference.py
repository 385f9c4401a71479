"""A mixture-of-experts layer written the slow way, sharing none of labkit.moe's code.

Every expert runs on every token (dense); a (N, E) gate matrix, zero where a token did not
choose the expert or was dropped, weighs the outputs. The choice is a full sort per token, the
capacity a Python loop over choices and tokens in GShard's order, the loss a loop over experts.
"""

from __future__ import annotations

import math

import torch


def reference_gates(logits, k, *, score="softmax", normalize=True, bias=None, scaling=1.0,
                    capacity_factor=None):
    """(N, E) gates: g for each (token, chosen and kept expert), else 0; and (N, k) choices."""
    N, E = logits.shape
    s = torch.softmax(logits, dim=1) if score == "softmax" else 1 / (1 + torch.exp(-logits))
    pick = s if bias is None else s + bias[None, :]
    chosen = torch.argsort(pick, dim=1, descending=True, stable=True)[:, :k]  # (N, k)
    gates = torch.zeros_like(s)
    for t in range(N):
        total = sum(s[t, e] for e in chosen[t].tolist()) if normalize else 1.0
        for e in chosen[t].tolist():
            gates[t, e] = s[t, e] / total * scaling
    if capacity_factor is not None:
        capacity, used = math.ceil(capacity_factor * N * k / E), [0] * E
        for j in range(k):  # first choices of every token, then second choices, ...
            for t in range(N):
                e = int(chosen[t, j])
                if used[e] >= capacity:
                    gates[t, e] = 0.0
                used[e] += 1
    return gates, chosen


def reference_experts(x, c_gate, c_fc, c_proj):
    """(E, N, h): every expert's SwiGLU on every token."""
    out = []
    for e in range(c_gate.shape[0]):
        a = x @ c_gate[e].T
        out.append((a * torch.sigmoid(a) * (x @ c_fc[e].T)) @ c_proj[e].T)
    return torch.stack(out)


def reference_moe(x, router_weight, c_gate, c_fc, c_proj, k, *, shared=None, **routing):
    """x (N, h) -> (N, h): Σ_e gate[:, e] · expert_e(x), plus the shared experts' ``shared(x)``."""
    gates, _ = reference_gates(x @ router_weight.T, k, **routing)
    y = (gates.T[:, :, None] * reference_experts(x, c_gate, c_fc, c_proj)).sum(0)
    return y if shared is None else y + shared(x)


def reference_balance_loss(logits, k, score="softmax"):
    """Switch's E Σ_i f_i P_i with f_i = (choices of i) / N and P_i the mean normalised score."""
    N, E = logits.shape
    s = torch.softmax(logits, dim=1) if score == "softmax" else torch.sigmoid(logits)
    p = s / s.sum(1, keepdim=True)
    _, chosen = reference_gates(logits, k, score=score)
    return E * sum((chosen == i).sum().item() / N * p[:, i].mean() for i in range(E))
