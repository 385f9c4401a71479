"""What the Llama-family technique tests' ranks run: one 4-rank launch serves the whole test file.

Tensor parallelism at t = 2 (two groups) and t = 4, with and without sequence parallelism, on
each config of ``configs``: one step's logits, loss and gradients and a 3-step plain training loop
against one process; the refusal of a t that does not divide n_kv_head; greedy generation with
rotary positions through the KV cache. Then two 2-rank pipelines (ranks 0-1 and 2-3) run 1F1B
and interleaved 1F1B on a Llama model in float64.
"""

import copy

import torch
import torch.distributed as dist

from labkit.model import GPTConfig, build_model
from labkit.paged_attention import generate
from labkit.runs.pipeline import train_pipeline
from labkit.runs.tensor_parallel import make_batch, tp_rank, tp_train_rank
from labkit.tensor_parallel import apply_tensor_parallel


def _refusal(fn, kind=ValueError):
    try:
        fn()
    except kind as err:
        return str(err)
    return None


def _gqa_refusal(cfg):
    """apply_tensor_parallel over all 4 ranks of a model with 2 key-value heads."""
    fields = {**cfg.to_dict(), "n_kv_head": 2}
    return _refusal(lambda: apply_tensor_parallel(build_model(GPTConfig(**fields)), None))


def _generation(cfg, new_tokens=6):
    """Greedy tokens (float64) of the unsharded model without a cache, and of its t = world_size
    shard with and without the KV cache (rotary positions: the cache passes each step's offsets)."""
    torch.manual_seed(0)
    full = build_model(cfg).double().eval()
    prompt = make_batch(cfg, 2)[0][:, :5]
    with torch.no_grad():
        want = generate(full, prompt, new_tokens, use_cache=False)
        top2 = full(want[:, :-1])[:, prompt.size(1) - 1:].topk(2, dim=-1).values  # (B, n, 2)
    model = apply_tensor_parallel(copy.deepcopy(full), None)
    return {"want": want, "margin": (top2[..., 0] - top2[..., 1]).min().item(),
            "cached": generate(model, prompt, new_tokens),
            "uncached": generate(model, prompt, new_tokens, use_cache=False)}


def _pipelines(cfg, cases, global_batch):
    """Two 2-stage pipelines, ranks (0, 1) and (2, 3), each running every (schedule, m, v) case in
    float64; {case: this rank's {"losses", "grads", "ranges"}}."""
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    group, ranks = pairs[rank // 2], [rank // 2 * 2, rank // 2 * 2 + 1]
    out = {}
    for schedule, m, v in cases:
        res = train_pipeline(rank % 2, 2, schedule, m, v, cfg=cfg, global_batch=global_batch, group=group,
                             ranks=ranks, count_saved=False, dtype=torch.float64)
        out[(schedule, m, v)] = {k: res[k] for k in ("losses", "grads", "ranges")}
    return out


def llama_checks(rank, world_size, configs, gqa_cfg, gen_cfg, pipe_cfg, pipe_cases, pipe_batch):
    """Everything the test file reads, per rank (see the module docstring)."""
    out = {"tp": {}, "train": {}}
    for name, cfg in configs.items():
        out["tp"][name] = tp_rank(rank, world_size, cfg, tp_sizes=(2, 4), dtensor=False, recomputes=())
        out["train"][name] = {sp: tp_train_rank(rank, world_size, cfg, sequence_parallel=sp) for sp in (False, True)}
    out["gqa_refusal"] = _gqa_refusal(gqa_cfg)
    out["generation"] = _generation(gen_cfg)
    out["pipeline"] = _pipelines(pipe_cfg, pipe_cases, pipe_batch)
    return out
