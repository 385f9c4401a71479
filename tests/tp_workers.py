"""What the tensor-parallel tests' ranks run: one 4-rank launch serves the whole test file."""

import copy

import torch
import torch.distributed as dist

from labkit.paged_attention import Engine, Request, generate
from labkit.model import build_model, get_preset
from labkit.runs.tensor_parallel import make_batch, roundoff, tp_rank, tp_train_rank, tp_zero1_rank
from labkit.tensor_parallel import VocabParallelEmbedding, apply_tensor_parallel, vocab_parallel_cross_entropy


def _refusal(fn, kind=ValueError):
    try:
        fn()
    except kind as err:
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


def _seeded(cfg, seed):
    torch.manual_seed(seed)
    return build_model(cfg)


def _unequal_ranks(cfg):
    """Models built from a different seed on each rank, and batches that differ by rank."""
    rank = dist.get_rank()
    out = {"check": _refusal(lambda: apply_tensor_parallel(_seeded(cfg, rank), None))}
    model = apply_tensor_parallel(_seeded(cfg, rank), None, init_sync="broadcast")
    twin = apply_tensor_parallel(_seeded(cfg, 0), None)  # what rank 0's model is, on every rank
    x, y = make_batch(cfg, 2)
    with torch.no_grad():
        out["broadcast"] = max((p - q).abs().max().item() for p, q in zip(model.parameters(), twin.parameters()))
    x_rank, y_rank = make_batch(cfg, 2, seed=rank)
    out["batch"] = _refusal(lambda: copy.deepcopy(twin)(x_rank, y_rank))
    out["same_batch_loss"] = twin(x, y).item()  # the same batch everywhere passes the check
    return out


def _bad_targets(cfg):
    """The vocabulary-parallel loss given targets the unsharded model refuses."""
    model = apply_tensor_parallel(_seeded(cfg, 0), None)
    x, y = make_batch(cfg, 2)
    out = {}
    for name, value in (("too_large", cfg.vocab_size), ("minus_one", -1)):
        bad = y.clone()
        bad[0, 3] = value
        out[name] = _refusal(lambda: model(x, bad))
    out["all_ignored"] = _refusal(lambda: model(x, torch.full_like(y, -100)))
    return out


def _generation(cfg, new_tokens=8):
    """Greedy tokens of the unsharded model, and of its t = world_size shard with and without the
    KV cache; the reference's smallest top-1 logit margin; the sequence-parallel refusal."""
    full = _seeded(cfg, 0).eval()
    prompt, _ = make_batch(cfg, 2)
    prompt = prompt[:, :8]
    with torch.no_grad():
        want = generate(full, prompt, new_tokens, use_cache=False)
        top2 = full(want[:, :-1])[:, prompt.size(1) - 1:].topk(2, dim=-1).values  # (B, n, 2)
    model = apply_tensor_parallel(copy.deepcopy(full), None)
    out = {"want": want, "margin": (top2[..., 0] - top2[..., 1]).min().item(),
           "scale": top2.abs().max().item(),
           "cached": generate(model, prompt, new_tokens), "uncached": generate(model, prompt, new_tokens,
                                                                               use_cache=False)}
    # Chapter 8's engine on the sharded model: a paged cache of this rank's heads (once all of them)
    out["engine"] = Engine(model, num_blocks=16, block_size=4).serve([Request(prompt[0].tolist(), new_tokens)])
    out["engine"] = out["engine"].outputs[0]
    sp = apply_tensor_parallel(copy.deepcopy(full), None, sequence_parallel=True)
    out["sp_cache"] = _refusal(lambda: generate(sp, prompt, new_tokens))
    return out


def _stage_and_copy(cfg):
    """A pipeline stage's part of the model (the embedding and two blocks, no head) sharded over the
    world group, and a deep copy of it: (error, floor) of each against the unsharded part."""
    full = _seeded(cfg, 0)
    x, _ = make_batch(cfg, 2)
    full64 = copy.deepcopy(full).double()
    with torch.no_grad():
        want = full.blocks[1](full.blocks[0](full.embed(x)))  # (B, T, C)
        want64 = full64.blocks[1](full64.blocks[0](full64.embed(x)))
    stage = copy.deepcopy(full)
    stage.blocks, stage.ln_f, stage.lm_head = stage.blocks[:2], None, None
    stage = apply_tensor_parallel(stage, None)
    twin = copy.deepcopy(stage)  # shares the process group, copies the shards
    with torch.no_grad():
        return [roundoff(m.blocks[1](m.blocks[0](m.embed(x))), want, want64) for m in (stage, twin)]


def _more_refusals(cfg):
    """Faults a new user meets on real ranks, each once a silent result or a far error: every rank
    of the group must raise, and none may be left waiting (the last call needs all of them)."""
    sub = dist.new_group([0, 1])  # every rank must create it; ranks 2 and 3 are not in it
    out = {}
    if dist.get_rank() >= 2:
        out["not_member"] = _refusal(lambda: apply_tensor_parallel(build_model(cfg), sub))
    model = apply_tensor_parallel(_seeded(cfg, 0), None)
    x, y = make_batch(cfg, 2)
    out["short_targets"] = _refusal(lambda: model(x, y[:, :8]))  # once a loss over half the positions
    Vt = cfg.vocab_size // dist.get_world_size()
    logits = torch.zeros(2, 4, Vt)
    out["start"] = _refusal(lambda: vocab_parallel_cross_entropy(logits, y[:, :4], None, 0))  # 0 on every rank
    emb = VocabParallelEmbedding(_seeded(cfg, 0).wte, None)
    out["embedding_id"] = _refusal(lambda: emb(torch.tensor([[1, cfg.vocab_size]])))  # once embedded as 0
    with torch.no_grad():
        out["after"] = model(x, y).item()
    return out


def tp_checks(rank, world_size, cfg, roundoff_only=False):
    """tp_size 2 (two groups) and 4, with and without SP; plain loops; the 2 x 2 TP x ZeRO-1 runs.
    ``roundoff_only``: only what the file's round-off tests read (t = 2 and the SP runs)."""
    if roundoff_only:
        return {"tp": tp_rank(rank, world_size, cfg, tp_sizes=(2,), dtensor=False, recomputes=()),
                "train": {True: tp_train_rank(rank, world_size, cfg, sequence_parallel=True)},
                "zero1": {True: tp_zero1_rank(rank, world_size, cfg, sequence_parallel=True)}}
    out = {"tp": tp_rank(rank, world_size, cfg, tp_sizes=(2, 4))}
    out["train"] = {sp: tp_train_rank(rank, world_size, cfg, sequence_parallel=sp) for sp in (True, False)}
    out["zero1"] = {sp: tp_zero1_rank(rank, world_size, cfg, sequence_parallel=sp) for sp in (False, True)}
    out["refusals"] = _bad_inputs(world_size)
    out["unequal"] = _unequal_ranks(cfg)
    out["targets"] = _bad_targets(cfg)
    out["generation"] = _generation(cfg)
    out["stage"] = _stage_and_copy(cfg)
    out["more"] = _more_refusals(cfg)
    return out
