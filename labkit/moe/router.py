"""The router: top-k gating, token dropping by capacity, the load-balancing loss and bias.

``route`` follows Mixtral (Jiang et al. 2024: softmax, top-k, weights renormalised) and
DeepSeek-V3 (DeepSeek-AI 2024, §2.1.2: sigmoid affinities, a bias added for the choice
only, weights renormalised and scaled by ``routed_scaling_factor``). ``keep_mask`` drops what
exceeds an expert's capacity (GShard's order), ``load_balancing_loss`` is Switch's auxiliary
loss (Fedus et al. 2022, eq. 4-6), ``update_bias`` DeepSeek-V3's auxiliary-loss-free update
(Wang et al. 2024). Pure functions of tensors; the layer (:mod:`.layer`) holds the state.
"""

from __future__ import annotations

import torch

from ..validate import ArgumentError, check_bool, check_choice, check_float, check_int
from .analytic import expert_capacity

__all__ = ["SCORES", "route", "keep_mask", "load_balancing_loss", "update_bias"]

SCORES = ("softmax", "sigmoid")  # Mixtral's and Switch's; DeepSeek-V3's


def route(logits: torch.Tensor, k: int, *, score: str = "softmax", normalize: bool = True,
          bias: torch.Tensor | None = None, scaling: float = 1.0):
    """Top-k routing: logits (N, E) -> weights (N, k), experts (N, k) int64, scores (N, E).

    s = softmax(logits) or sigmoid(logits); the k experts of largest s + ``bias`` are chosen
    (``bias``, (E,), steers the choice only: the weights are s's own, as in DeepSeek-V3);
    weights g = s of the chosen, divided by their sum when ``normalize``, times ``scaling``.
    """
    check_choice("score", score, SCORES)
    check_bool("normalize", normalize)
    check_float("scaling", scaling, above=0.0)
    if logits.dim() != 2:
        raise ArgumentError(f"logits of shape {tuple(logits.shape)} must be (tokens, n_experts)")
    check_int("k", k, 1, logits.size(-1))
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()  # (N, E)
    choice = scores if bias is None else scores + bias  # (N, E), for the top-k only
    experts = choice.topk(k, dim=-1).indices  # (N, k), best first
    weights = scores.gather(-1, experts)  # (N, k)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return (weights * scaling if scaling != 1.0 else weights), experts, scores


def keep_mask(experts: torch.Tensor, n_experts: int, capacity_factor: float | None) -> torch.Tensor | None:
    """(N, k) bool: which assignments fit their expert's capacity C = ceil(cf · N k / E); None: dropless.

    GShard's order (Lepikhin et al. 2021, Algorithm 1): every token's first choice takes a place
    before any token's second choice; within one choice, earlier tokens (in batch order, row
    by row) first. What is dropped skips the expert; the residual stream carries the token.
    """
    if capacity_factor is None:
        return None
    N, k = experts.shape
    capacity = expert_capacity(N, n_experts, k, capacity_factor)
    by_choice = experts.t().reshape(-1)  # (k N,): choice-major, tokens in order within a choice
    onehot = torch.nn.functional.one_hot(by_choice, n_experts)  # (k N, E)
    place = (onehot.cumsum(0) * onehot).sum(-1) - 1  # (k N,): the assignment's place in its queue
    return (place < capacity).view(k, N).t()  # (N, k)


def load_balancing_loss(scores: torch.Tensor, experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch's auxiliary loss E Σ_i f_i P_i: f_i the assignments to expert i per token (the k
    choices counted, before any drop; Σ f_i = k, as Hugging Face's Mixtral counts them), P_i the
    mean of the token's scores normalised to sum 1 (softmax's already do). () scalar."""
    probs = scores / scores.sum(-1, keepdim=True)  # (N, E)
    f = torch.bincount(experts.reshape(-1), minlength=n_experts).to(scores.dtype) / experts.size(0)  # (E,)
    return n_experts * (f * probs.mean(0)).sum()


@torch.no_grad()
def update_bias(bias: torch.Tensor, load: torch.Tensor, gamma: float) -> torch.Tensor:
    """DeepSeek-V3's bias update, in place: b_i += γ · sign(mean load - load_i): an overloaded
    expert's bias falls, an underloaded one's rises. ``load`` (E,): tokens routed to each expert
    over the step (summed over the data-parallel ranks by the caller)."""
    check_float("gamma", gamma, 0.0)
    return bias.add_(gamma * torch.sign(load.to(bias.dtype).mean() - load.to(bias.dtype)))
