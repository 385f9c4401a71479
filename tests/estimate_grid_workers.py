"""What tests/test_estimate_grid.py's ranks run: one step of a composed run, measured by the meter.

For each case, a rank builds the tiny model (fp32, or all in bf16), composes it with
``parallelize_gpt``, takes one AdamW step unmeasured (the optimizer states exist from then on)
and measures the second: model states by the memory meter around ``forward_backward(); step();
zero_grad()``. Then activations, as the meter counts them at the end of a forward: one stage,
the rank's whole forward; a pipeline, one micro-batch's chunk forward times the most micro-batches
the pipeline runtime held at once in a step of the same schedule."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from labkit.memory import MemoryMeter
from labkit.memory.meter import optimizer_tensors
from labkit.expert_parallel import exchange_counts
from labkit.model import GPTConfig, build_model
from labkit.moe import moe_layers
from labkit.parallel import ParallelDims, parallelize_gpt
from labkit.pipeline import run_schedule
from labkit.runs.pipeline import make_batch

# the families, tiny: GPT-2's block (LayerNorm, GELU, learned positions, tied embeddings), the
# Llama block with grouped-query attention (RMSNorm, SwiGLU, rotary, untied, no biases), and two
# mixtures of experts on it: Mixtral's (every layer, softmax top-2 of 4) and DeepSeek's (the first
# layer dense, a shared expert, sigmoid scores with a selection bias, scaled weights)
FAMILIES = {
    "gpt2": dict(n_layer=4, d_model=32, n_head=4, vocab_size=64, seq_len=16),
    "llama-gqa": dict(n_layer=4, d_model=32, n_head=4, n_kv_head=2, d_ff=48, vocab_size=64, seq_len=16,
                      norm="rmsnorm", mlp="swiglu", pos="rope", tie_embeddings=False, bias=False),
}
FAMILIES["mixtral"] = dict(FAMILIES["llama-gqa"], n_experts=4, experts_per_token=2, d_expert=24)
FAMILIES["deepseek"] = dict(FAMILIES["llama-gqa"], n_experts=4, experts_per_token=2, d_expert=16, n_shared_experts=1,
                            first_dense_layers=1, router_score="sigmoid", router_bias=True, routed_scaling_factor=2.5)
FAMILIES["mixtral-capacity"] = dict(FAMILIES["mixtral"], capacity_factor=1.0)  # tokens beyond C = ceil(N k / E) dropped
# multi-head latent attention (labkit.mla), DeepSeek-V2-Lite's (a full-rank query) and DeepSeek-V3's
# (a compressed query), the latter also with DeepSeek's experts: head sizes that differ from d_model / n_head
_MLA = dict(n_kv_head=None, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=10)
FAMILIES["mla"] = dict(FAMILIES["llama-gqa"], **_MLA)
FAMILIES["mla-q-lora"] = dict(FAMILIES["mla"], q_lora_rank=20)
FAMILIES["deepseek-mla"] = dict(FAMILIES["deepseek"], **_MLA, q_lora_rank=20)
# labkit.estimate's precisions a plain torch optimizer runs: everything in one dtype
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class _Held(nn.Module):
    """The parameters a rank holds and trains (its stage's; ZeRO-3: its shards), for the meter:
    with a pipeline every rank built the whole model, and only its stage's part is its share.
    ZeRO-1/2 also: the optimizer's slices of them, which hold the sharded gradients."""

    def __init__(self, pm, optimizer):
        super().__init__()
        params = pm.parameters()
        seen = {id(p) for p in params}
        slices = [s for opt in _parts(optimizer) if hasattr(opt, "shard_entries") for *_, s in opt.shard_entries()]
        self.held = nn.ParameterList(params + [s for s in slices if id(s) not in seen])


class _States:
    """What the meter labels optimizer states: the optimizer's own (ZeRO-1/2: the inner one's)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def state_tensors(self):
        return [t for opt in _parts(self.optimizer) for t in optimizer_tensors(opt)]


def _parts(optimizer) -> list:
    """The optimizers a rank steps: ZeRO-1 with sharded experts runs two (the rest's, the experts')."""
    return [optimizer.dense, optimizer.experts] if hasattr(optimizer, "experts") else [optimizer]


def step_counter_bytes(optimizer) -> int:
    """Bytes of torch Adam's ``step`` counters (a 4-byte tensor per parameter tensor it steps;
    ZeRO-1/2: per flat shard): on a GPU they stay on the host, and the estimator leaves them out."""
    inners = [getattr(opt, "inner", opt) for opt in _parts(optimizer)]
    return sum(s["step"].untyped_storage().nbytes() for inner in inners for s in inner.state.values() if "step" in s)


def _chunk_activations(pm, x, y) -> int:
    """Bytes one micro-batch's forward keeps on this stage (its chunk; v = 1): the received
    activation (allocated in the forward, as the receive allocates it, and kept for backward),
    the chunk's saved tensors, its output sent on (kept until backward) or, on the last stage, the
    loss the pipeline takes (``pm.loss_fn``: under cp the global mean's). The graph is then dropped: no backward, so no collective is left waiting."""
    chunk, stage, mb = pm.chunks[0], pm.coords.pp, x.shape[0] // pm.num_microbatches
    seq = x.shape[1] // pm.dims.tp_size if pm.sequence_parallel else x.shape[1]
    with MemoryMeter() as meter:
        with meter.phase("forward"):
            if stage == 0:
                kept = chunk(x[:mb])
            else:
                h = _received(pm, mb, seq)
                kept = (h, chunk(h))
            if pm.is_last_stage:
                kept = (h, pm.loss_fn(kept[1], y[:mb]))  # the logits are freed once the loss is taken
    del kept
    return meter.report().activations


def _received(pm, mb: int, seq: int):
    """A stage's received activation for :func:`_chunk_activations`: the same values on every call
    and rank (seeded), so that a second forward routes its rows to the experts as the measured one."""
    gen = torch.Generator().manual_seed(1234)
    h = torch.empty(mb, seq, pm.model.cfg.d_model, dtype=pm.model.wte.weight.dtype).normal_(generator=gen)
    return h.requires_grad_()


def _chunk_rows(pm, x) -> list:
    """(rows dispatched, rows received) of each MoE layer of this stage's chunk in the forward
    :func:`_chunk_activations` measures (the same input, so the same routing); no backward."""
    chunk, mb = pm.chunks[0], x.shape[0] // pm.num_microbatches
    seq = x.shape[1] // pm.dims.tp_size if pm.sequence_parallel else x.shape[1]
    layers = moe_layers(chunk)
    for layer in layers:
        layer.exchange = _Counted(layer.exchange)
    out = chunk(x[:mb] if pm.coords.pp == 0 else _received(pm, mb, seq))
    rows = [(layer.kept, layer.exchange.received[-1]) for layer in layers]
    for layer in layers:
        layer.exchange = layer.exchange.exchange
    del out
    return rows


def _pipeline_activations(pm, x, y) -> tuple[int, int, list]:
    """The most activation bytes this stage keeps at once: the most micro-batches it held (counted
    by the pipeline runtime in the step ``pm.forward_backward`` runs, called here as it calls it)
    times one's; that count; and one micro-batch's MoE rows on this stage (:func:`_chunk_rows`)."""
    m, model = pm.num_microbatches, pm.model
    seq = x.shape[1] // pm.dims.tp_size if pm.sequence_parallel else x.shape[1]
    sync = pm.data_parallel.no_sync() if pm.data_parallel is not None else contextlib.nullcontext()
    with sync:  # the gradients are not needed: no data-parallel reduction
        res = run_schedule(pm.chunks, pm.actions, rank=pm.coords.pp, pp_size=pm.dims.pp_size,
                           inputs=x.chunk(m), targets=y.chunk(m), loss_fn=pm.loss_fn,
                           act_shape=(x.shape[0] // m, seq, model.cfg.d_model), act_dtype=model.wte.weight.dtype,
                           device=x.device, group=pm.group["pp"], ranks=pm.pp_ranks, tied=model.wte.weight,
                           count_saved=False)
    rows = _chunk_rows(pm, x) if pm.model.cfg.n_experts else []
    return res.peak_live * _chunk_activations(pm, x, y), res.peak_live, rows


def _local_activations(pm, x, y) -> int:
    """Activation bytes at the end of this rank's forward (one stage, one micro-batch); the backward
    then runs, unmeasured, so every rank's collectives match."""
    net = pm.fsdp or pm.model
    with MemoryMeter() as meter:
        with meter.phase("forward"):
            loss = net(x, y)
    loss.backward()
    return meter.report().activations


class _Counted:
    """A MoE layer's exchange that records the rows its experts run on this rank (over ranks, the
    rows other ranks route here: data-dependent), then exchanges as before."""

    def __init__(self, exchange):
        self.exchange, self.received = exchange, []

    def __call__(self, rows, counts, experts):
        if hasattr(self.exchange, "group"):
            ep = self.exchange.ep
            self.received.append(int(exchange_counts(counts, self.exchange.group).view(ep, -1).sum()))
        else:
            self.received.append(rows.size(0))
        return self.exchange(rows, counts, experts)


def _moe_rows(pm, x, y) -> list:
    """(rows dispatched, rows received) of each MoE layer in one forward of this rank."""
    layers = moe_layers(pm.model)
    for layer in layers:
        layer.exchange = _Counted(layer.exchange)
    (pm.fsdp or pm.model)(x, y).backward()  # under ZeRO-3 its wrapper gathers the units
    rows = [(layer.kept, layer.exchange.received[-1]) for layer in layers]
    for layer in layers:
        layer.exchange = layer.exchange.exchange
    return rows


def measure_case(family, degrees, kwargs, global_batch=8, seed=0) -> dict:
    """One case on this rank (``kwargs``: parallelize_gpt's, and ``precision``, "fp32" or "bf16"):
    the meter's params, grads, optimizer (max over the step), the activations it kept, Adam's
    step counters, and the rank's pipeline stage."""
    kwargs = dict(kwargs)
    dtype = DTYPES[kwargs.pop("precision", "fp32")]  # the model's and so AdamW's states' dtype
    cfg = GPTConfig(**FAMILIES[family])
    dims = ParallelDims(*degrees)  # (dp, tp, pp) or (dp, tp, pp, cp)
    pp = dims.pp_size
    torch.manual_seed(seed)
    pm = parallelize_gpt(build_model(cfg, dtype=dtype), dims, dims.build_mesh("cpu"), **kwargs)
    opt = pm.build_optimizer(torch.optim.AdamW, lr=1e-3)
    x, y = pm.shard_batch(*make_batch(cfg, global_batch, seed))
    pm.forward_backward(x, y)  # the optimizer states exist from this first step on
    opt.step()
    opt.zero_grad(set_to_none=True)
    # phases as labkit.memory.train_step's: what holds a gradient when backward ends is labelled a
    # gradient; what the step allocates and zero_grad frees (ZeRO-1's reduce-scattered shard of
    # the gradients, the input of its inner optimizer) is a temporary of the step
    with MemoryMeter(_Held(pm, opt), _States(opt)) as meter:
        with meter.phase("backward"):
            pm.forward_backward(x, y)
        with meter.phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    states = meter.report().max_by_category
    if pp > 1:  # a stage: the micro-batches it held at once, each with the rows its MoE layers ran
        acts, live, rows = _pipeline_activations(pm, x, y)
    else:
        acts, live = _local_activations(pm, x, y), 1
        rows = _moe_rows(pm, x, y) if cfg.n_experts else []
    opt.zero_grad(set_to_none=True)
    return {"params": states["parameters"], "grads": states["gradients"], "optimizer": states["optimizer"],
            "activations": acts, "step_counters": step_counter_bytes(opt), "stage": pm.coords.pp,
            "micro_batch": x.shape[0] // pm.num_microbatches, "moe_rows": rows, "live": live}


def grid_rank(rank, world_size, cases, global_batch=8, seed=0) -> list[dict]:
    """Every case of ``cases`` ((family, (dp, tp, pp[, cp]), parallelize_gpt's keywords)), in turn."""
    torch.set_num_threads(1)
    return [measure_case(family, degrees, kwargs, global_batch, seed) for family, degrees, kwargs in cases]
