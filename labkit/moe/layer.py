"""The mixture-of-experts layer: a router, E SwiGLU experts, optional shared experts.

Mixtral (Jiang et al. 2024): every layer routes each token to k = 2 of 8 experts. DeepSeek-V3
(DeepSeek-AI 2024): sigmoid affinities with a selection bias, always-on shared experts, the
first layers dense. The routed experts' weights are stacked, (E, f, h) and (E, h, f), so that
expert parallelism keeps a slice of them; ``exchange`` is where tokens meet their experts: on
this process (:class:`LocalExchange`), or over ranks (:mod:`labkit.expert_parallel`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..layers import SwiGLU
from ..shapes import ModelShape
from ..validate import ArgumentError, check_bool, check_choice, check_float
from .router import SCORES, keep_mask, load_balancing_loss, route, update_bias

__all__ = ["Experts", "LocalExchange", "MoE", "check_moe_config", "moe_layers", "update_expert_bias",
           "with_aux_loss", "set_aux_grad_scale"]


def check_moe_config(cfg) -> None:
    """The router's fields (the rest are ModelShape's, checked there); experts are SwiGLU, so a
    model with experts has ``mlp="swiglu"`` (its dense layers too, as DeepSeek's)."""
    check_choice("router_score", cfg.router_score, SCORES)
    check_bool("norm_topk_prob", cfg.norm_topk_prob)
    check_float("routed_scaling_factor", cfg.routed_scaling_factor, above=0.0)
    if cfg.capacity_factor is not None:
        check_float("capacity_factor", cfg.capacity_factor, above=0.0)
    check_float("aux_loss_coef", cfg.aux_loss_coef, 0.0)
    if cfg.n_experts and cfg.mlp != "swiglu":
        raise ArgumentError(f"n_experts={cfg.n_experts} needs mlp='swiglu' (the experts are SwiGLU), not {cfg.mlp!r}")


class Experts(nn.Module):
    """E SwiGLU experts, c_proj(silu(c_gate x) * c_fc x), as stacked weights: ``c_gate``, ``c_fc``
    (E, f, h) and ``c_proj`` (E, h, f) (Hugging Face's gate/up/down_proj; Mixtral's w1, w3, w2)."""

    def __init__(self, n_experts: int, d_model: int, d_expert: int, std: float = 0.02):
        super().__init__()
        self.c_gate = nn.Parameter(torch.randn(n_experts, d_expert, d_model) * std)  # (E, f, h)
        self.c_fc = nn.Parameter(torch.randn(n_experts, d_expert, d_model) * std)  # (E, f, h)
        self.c_proj = nn.Parameter(torch.randn(n_experts, d_model, d_expert) * std)  # (E, h, f)

    @property
    def n_experts(self) -> int:
        return self.c_gate.size(0)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows (M, h), sorted by expert, ``counts[e]`` of them expert e's -> (M, h), same order."""
        out = []
        for e, x in enumerate(rows.split(counts)):  # x (n_e, h); n_e may be 0
            h = F.silu(x @ self.c_gate[e].t()) * (x @ self.c_fc[e].t())  # (n_e, f)
            out.append(h @ self.c_proj[e].t())  # (n_e, h)
        return torch.cat(out) if out else rows.new_zeros(0, rows.size(-1))


class LocalExchange:
    """Tokens meet their experts on this process: ``exchange(rows, counts, experts)`` runs them."""

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        return experts(rows, counts.tolist())


class _AuxLossGrad(torch.autograd.Function):
    """y -> y; in backward, the layer's weighted aux loss joins the graph here, its gradient the
    layer's ``aux_grad_scale`` (Megatron-LM's MoEAuxLossAutoScaler): the router gets it wherever
    the step's loss is (a pipeline's last stage) and from whichever forward built the graph (a
    checkpoint's recomputation, not its graph-less first pass). None: no aux gradient."""

    @staticmethod
    def forward(ctx, y, aux, layer):
        ctx.layer, ctx.dtype, ctx.device = layer, aux.dtype, aux.device  # nothing kept: a scalar's gradient
        return y

    @staticmethod
    def backward(ctx, grad):
        scale = ctx.layer.aux_grad_scale  # a float, or the loss's gradient (a () tensor: no host sync)
        if scale is None:
            return grad, None, None
        return grad, torch.as_tensor(scale).to(dtype=ctx.dtype, device=ctx.device).reshape(()), None


class _LossScaleProbe(torch.autograd.Function):
    """loss -> loss; its backward, the first of the model's (the loss is the graph's end), records
    the gradient the step gives the loss (1, 1 / m, ...) as every MoE layer's ``aux_grad_scale``."""

    @staticmethod
    def forward(ctx, loss, layers):
        ctx.layers = layers
        return loss

    @staticmethod
    def backward(ctx, grad):
        set_aux_grad_scale(ctx.layers, grad.detach())
        return grad, None


def set_aux_grad_scale(layers, scale) -> None:
    """The gradient each MoE layer of ``layers`` gives its weighted aux loss in the next backward:
    the step's scale of the loss (a pipeline stage's 1 / m, set by its runner), or None."""
    for layer in layers:
        layer.aux_grad_scale = scale


def with_aux_loss(loss, layers):
    """The model's loss plus the layers' weighted aux losses (values of the last forward): what a
    step reports; their gradients reach the routers at the layers (:class:`_AuxLossGrad`), at
    the scale ``loss``'s backward is given. () scalar; ``loss`` itself when no layer has one."""
    aux = [m.aux_loss for m in layers if m.aux_loss is not None]
    if not aux:
        return loss
    return _LossScaleProbe.apply(loss + layers[0].cfg.aux_loss_coef * sum(aux), layers)


class MoE(nn.Module):
    """A mixture-of-experts MLP, built from a GPTConfig's expert fields: x (B, T, h) -> (B, T, h).

    The capacity counts the N = B T tokens of this forward (a rank's micro-batch), in training
    and in eval alike. After a forward, ``aux_loss`` is the load-balancing loss's value (when
    ``cfg.aux_loss_coef`` > 0 and training; its gradient: :class:`_AuxLossGrad`), ``kept`` counts
    the assignments kept, and ``load`` (E,) has accumulated the tokens routed to each expert (the
    bias update reads and clears it) if the forward built a graph: once per trained forward, a
    checkpoint's recomputation included and its graph-less first pass not (as Megatron-LM counts).
    """

    def __init__(self, cfg):
        super().__init__()
        self.cfg, self.k, self.n_experts = cfg, cfg.experts_per_token, cfg.n_experts
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        shape = ModelShape.from_config(cfg)  # d_expert and d_shared as the shape resolves them
        self.experts = Experts(cfg.n_experts, cfg.d_model, shape.expert_dim)
        width = cfg.n_shared_experts * shape.shared_dim
        self.shared = SwiGLU(dataclasses.replace(cfg, d_ff=width, bias=False, dropout=0.0)) if width else None
        # DeepSeek-V3's selection bias, moved by update_expert_bias, never by a gradient
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts) if cfg.router_bias else None)
        self.register_buffer("load", torch.zeros(cfg.n_experts), persistent=False)  # (E,)
        self.exchange = LocalExchange()
        self.aux_loss, self.kept, self.aux_grad_scale = None, 0, None

    def forward(self, x):
        B, T, C = x.shape
        h = x.reshape(B * T, C)  # (N, h)
        cfg = self.cfg
        weights, experts, scores = route(self.router(h), self.k, score=cfg.router_score,
                                         normalize=cfg.norm_topk_prob, bias=self.expert_bias,
                                         scaling=cfg.routed_scaling_factor)  # (N, k), (N, k), (N, E)
        graph = torch.is_grad_enabled()
        if graph:  # a recomputed forward counts, the checkpoint's first pass (no graph) does not
            with torch.no_grad():
                self.load += torch.bincount(experts.reshape(-1), minlength=self.n_experts).to(self.load.dtype)
        aux = load_balancing_loss(scores, experts, self.n_experts) if self.training and cfg.aux_loss_coef > 0 else None
        self.aux_loss = None if aux is None else aux.detach()  # the value; the gradient joins below
        y = self._routed(h, weights, experts, keep_mask(experts, self.n_experts, cfg.capacity_factor))
        if self.shared is not None:
            y = y + self.shared(h)
        if aux is not None and graph:
            y = _AuxLossGrad.apply(y, cfg.aux_loss_coef * aux, self)
        return y.view(B, T, C)

    def _routed(self, h, weights, experts, keep):
        """Σ over a token's kept choices of g · expert(x): sort the assignments by expert (a stable
        sort: tokens in order within an expert), run them, weight them, add them back per token."""
        N, k = experts.shape
        token = torch.arange(N, device=h.device).repeat_interleave(k)  # (N k,)
        expert, weight = experts.reshape(-1), weights.reshape(-1)  # (N k,)
        if keep is not None:
            kept = keep.reshape(-1)
            token, expert, weight = token[kept], expert[kept], weight[kept]  # (M,)
        self.kept = token.numel()
        order = torch.argsort(expert, stable=True)  # (M,)
        counts = torch.bincount(expert, minlength=self.n_experts)  # (E,)
        rows = self.exchange(h[token[order]], counts, self.experts)  # (M, h), by expert
        return torch.zeros_like(h).index_add(0, token[order], rows * weight[order, None])  # (N, h)


def moe_layers(model) -> list[MoE]:
    """The model's MoE layers, in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def update_expert_bias(model, gamma: float, group=None) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after a step: each MoE layer's ``load`` summed
    over ``group`` (the data-parallel ranks, so every rank moves its bias alike), then
    b_i += γ sign(mean - load_i) (:func:`labkit.moe.router.update_bias`), then ``load`` cleared."""
    check_float("gamma", gamma, 0.0)
    for layer in moe_layers(model):
        if group is not None:
            dist.all_reduce(layer.load, group=group)
        if layer.expert_bias is not None:
            update_bias(layer.expert_bias, layer.load, gamma)
        layer.load.zero_()
