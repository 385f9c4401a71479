"""What the tensor-parallel tests' ranks run: one 4-rank launch serves the whole test file."""

import copy

import torch
import torch.distributed as dist

from labkit.model import build_model, get_preset
from labkit.runs.tensor_parallel import make_batch, tp_rank, tp_zero1_rank
from labkit.tensor_parallel import apply_tensor_parallel


def _refusal(fn):
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def _bad_inputs(world_size):
    """The messages of apply_tensor_parallel's refusals, over the world group of ``world_size``."""
    def shard(**overrides):
        return lambda: apply_tensor_parallel(build_model(get_preset("tiny", **overrides)), None)

    def twice():
        sub = dist.new_group([0, 1])  # every rank must create it; ranks 0 and 1 use it
        model = build_model("tiny")
        if dist.get_rank() < 2:
            apply_tensor_parallel(model, sub)
        else:
            model.tp_size = 2  # what ranks 0 and 1 hold now
        apply_tensor_parallel(model, None)

    return {"n_head": _refusal(shard(n_head=2, d_model=128)), "vocab_size": _refusal(shard(vocab_size=250)),
            "dropout": _refusal(shard(dropout=0.1)), "twice": _refusal(twice)}


def _stage_and_copy(cfg):
    """A pipeline stage's part of the model (the embedding and two blocks, no head) sharded over the
    world group, and a deep copy of it: max |output - the unsharded part's| for each."""
    torch.manual_seed(0)
    full = build_model(cfg)
    x, _ = make_batch(cfg, 2)
    with torch.no_grad():
        want = full.blocks[1](full.blocks[0](full.embed(x)))  # (B, T, C)
    stage = copy.deepcopy(full)
    stage.blocks, stage.ln_f, stage.lm_head = stage.blocks[:2], None, None
    stage = apply_tensor_parallel(stage, None)
    twin = copy.deepcopy(stage)  # shares the process group, copies the shards
    diffs = []
    with torch.no_grad():
        for model in (stage, twin):
            diffs.append((model.blocks[1](model.blocks[0](model.embed(x))) - want).abs().max().item())
    return diffs


def tp_checks(rank, world_size, cfg):
    """tp_size 2 (two groups) and 4, with and without SP; then the 2 x 2 TP x ZeRO-1 runs."""
    out = {"tp": tp_rank(rank, world_size, cfg, tp_sizes=(2, 4))}
    out["zero1"] = {sp: tp_zero1_rank(rank, world_size, cfg, sequence_parallel=sp) for sp in (False, True)}
    out["refusals"] = _bad_inputs(world_size)
    out["stage"] = _stage_and_copy(cfg)
    return out
