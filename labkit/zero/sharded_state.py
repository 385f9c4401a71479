"""Sharded checkpoints: each rank saves its own shard; any world size can load them.

A checkpoint is a folder with one ``shard-RRRRR-of-WWWWW.pt`` per rank and a ``manifest.json``
that rank 0 writes last: the format, the world size, the model's fingerprint (every
parameter's name and shape) and the size and SHA-256 of every shard. A rank's file holds, for
each parameter, the slice ``[start, stop)`` of its flattened values that the rank owned and
the optimizer state of that slice and the optimizer's class. A save writes a new folder beside
the old one and renames it into place once complete. Loading reads every shard, checks all of them, rebuilds
each parameter and state in full, and cuts out the new rank's slice, so a checkpoint saved at
4 ranks resumes at 2 or 8. Nothing is changed until every check has passed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..messages import say

__all__ = ["save_sharded", "load_sharded", "verify_sharded", "CheckpointError", "shard_filename", "MANIFEST"]

FORMAT = "labkit.zero.sharded/1"
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A sharded checkpoint is missing, damaged, or belongs to another model."""


def shard_filename(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


def _fingerprint(entries) -> list:
    return [[key, list(shape)] for key, shape, _, _ in entries]


def _optimizer_kind(optimizer) -> str:
    """The class of the optimizer whose states are saved (a ShardedOptimizer's inner one)."""
    return type(getattr(optimizer, "inner", optimizer)).__name__


def _shard_bytes(shards, optimizer, rank, world_size, extra) -> bytes:
    """This rank's shard file: its slice of every parameter and of its optimizer state."""
    entries = shards.shard_entries()
    records = []
    for key, shape, (a, b), s in entries:
        state = optimizer.state.get(s, {})
        sliced = {k: v.detach().cpu().clone() for k, v in state.items()
                  if isinstance(v, torch.Tensor) and v.shape == s.shape}
        replicated = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                      for k, v in state.items() if k not in sliced}
        on_device = [k for k, v in state.items() if k not in sliced and isinstance(v, torch.Tensor)
                     and v.device.type != "cpu"]
        records.append({"key": key, "start": a, "stop": b, "param": s.detach().cpu().clone(),
                        "has_state": bool(state), "sliced": sliced, "replicated": replicated,
                        "on_param_device": on_device})
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    payload = {"format": FORMAT, "rank": rank, "world_size": world_size, "fingerprint": _fingerprint(entries),
               "entries": records, "param_groups": groups, "extra": extra,
               "optimizer": _optimizer_kind(optimizer)}
    buf = io.BytesIO()
    torch.save(payload, buf)
    return buf.getvalue()


def _check_target(path: Path) -> None:
    """Refuse to replace a folder that holds something other than a sharded checkpoint."""
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not (path / MANIFEST).is_file())):
        raise CheckpointError(f"path={str(path)!r} exists and is not a sharded checkpoint (no {MANIFEST}): "
                              "save into a new or empty folder, or into an earlier checkpoint's folder")


def _replace_folder(staging: Path, path: Path) -> None:
    """Put the complete ``staging`` folder at ``path``; the old checkpoint goes only once it has."""
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(staging, path)
    shutil.rmtree(old, ignore_errors=True)


def _gather_errors(error, group) -> list[str]:
    """Every rank's error (None where it succeeded), so that all ranks raise together, none waits."""
    errors = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return [e for e in errors if e]


def save_sharded(path, shards, optimizer, *, group=None, extra: dict | None = None) -> Path:
    """Save this rank's shard of ``shards`` (a ShardedOptimizer or a FullyShardedModule) and of
    ``optimizer``'s state into the folder ``path``; every rank calls it.

    The shards and the manifest are written to a new folder beside ``path``, which replaces
    ``path`` only once complete: a save that fails on any rank raises on every rank and leaves
    an earlier checkpoint at ``path`` as it was. ``extra`` (plain values and tensors) is stored
    with every shard and returned by :func:`load_sharded`: the step count, say.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    path = Path(path)
    _check_target(path)  # the same answer on every rank: they share the folder
    staging = path.with_name(f".{path.name}.saving")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # what an interrupted save left
        staging.mkdir(parents=True)
    dist.barrier(group=group)
    info, error = None, None
    try:
        data = _shard_bytes(shards, optimizer, rank, world_size, extra)
        (staging / shard_filename(rank, world_size)).write_bytes(data)
        info = {"name": shard_filename(rank, world_size), "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest()}
    except Exception as e:  # noqa: BLE001 -- reported on every rank below
        error = f"rank {rank}: {type(e).__name__}: {e}"
    files = [None] * world_size
    dist.all_gather_object(files, info, group=group)
    errors = _gather_errors(error, group)
    if not errors and rank == 0:
        try:
            manifest = {"format": FORMAT, "world_size": world_size,
                        "fingerprint": _fingerprint(shards.shard_entries()), "files": files}
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
            _replace_folder(staging, path)
        except OSError as e:
            error = f"rank 0: {type(e).__name__}: {e}"
    errors = errors or _gather_errors(error, group)
    if errors:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"saving the checkpoint {path} failed; anything saved there before is "
                              "unchanged: " + "; ".join(errors))
    return path


def verify_sharded(path) -> dict:
    """Check a checkpoint's manifest and every shard (size, SHA-256, contents) without a model.

    Returns ``{"world_size", "n_params"}`` (``n_params``: parameter tensors); raises
    :class:`CheckpointError` naming the first problem.
    """
    payloads = _read_all(Path(path))
    return {"world_size": len(payloads), "n_params": len(payloads[0]["fingerprint"])}


def _read_all(path: Path, fingerprint: list | None = None, n_groups: int | None = None) -> list[dict]:
    """Every shard of the checkpoint at ``path``, checked; raises CheckpointError."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path / MANIFEST} is missing: {path} is not a complete sharded checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / MANIFEST} is unreadable: {e}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    fingerprint = manifest["fingerprint"] if fingerprint is None else fingerprint
    if manifest["fingerprint"] != fingerprint:
        theirs = {k: s for k, s in manifest["fingerprint"]}
        ours = {k: s for k, s in fingerprint}
        diff = next((f"{k!r} is not in it" if k not in theirs else f"{k!r} has shape {theirs[k]} in it, {s} here"
                     for k, s in ours.items() if theirs.get(k) != s), None) \
            or f"it has {len(theirs)} parameters, this model {len(ours)}"
        raise CheckpointError(f"{path} was saved from another model ({diff})")
    payloads = []
    for r, info in enumerate(manifest["files"]):
        f = path / info["name"]
        if not f.is_file():
            raise CheckpointError(say("raise.shard_missing", name=f.name, rank=r, world_size=manifest["world_size"],
                                      path=path))
        data = f.read_bytes()
        if len(data) != info["bytes"]:
            raise CheckpointError(say("raise.shard_size", shard=f, size=len(data), expected=info["bytes"]))
        if hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise CheckpointError(say("raise.shard_digest", shard=f))
        try:
            payload = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            raise CheckpointError(say("raise.shard_unreadable", shard=f, error=f"{type(e).__name__}: {e}")) from None
        if payload.get("rank") != r or payload.get("fingerprint") != fingerprint:
            raise CheckpointError(say("raise.shard_foreign", shard=f))
        if n_groups is not None and len(payload["param_groups"]) != n_groups:
            raise CheckpointError(f"{path} has {len(payload['param_groups'])} parameter groups, "
                                  f"the optimizer {n_groups}")
        payloads.append(payload)
    return payloads


def _assemble(key, numel, records, path):
    """Full values and full sliced states of one parameter from every rank's record."""
    parts = sorted((r for r in records if r["stop"] > r["start"]), key=lambda r: r["start"])
    cursor = 0
    for r in parts:
        if r["start"] != cursor:
            raise CheckpointError(f"{path}: the shards of {key!r} leave a gap or overlap at element {cursor}")
        cursor = r["stop"]
    if cursor != numel:
        raise CheckpointError(f"{path}: the shards of {key!r} cover {cursor} of its {numel} elements")
    values = torch.cat([r["param"] for r in parts]) if parts else torch.empty(0)
    with_state = [r for r in parts if r["has_state"]]
    if with_state and len(with_state) != len(parts):
        raise CheckpointError(f"{path}: only some shards of {key!r} have optimizer state")
    states = {k: torch.cat([r["sliced"][k] for r in parts]) for k in (parts[0]["sliced"] if with_state else {})}
    source = next((r for r in records if r["has_state"]), None)
    return values, states, source


def _check_optimizer(path, payload, optimizer) -> None:
    """Refuse the states of one kind of optimizer for another (AdamW's lr and betas into SGD)."""
    saved, ours = payload.get("optimizer"), _optimizer_kind(optimizer)
    saved_keys = sorted({k for g in payload["param_groups"] for k in g})
    our_keys = sorted({k for g in optimizer.param_groups for k in g if k != "params"})
    if (saved is not None and saved != ours) or saved_keys != our_keys:
        raise CheckpointError(f"{path} holds the states of a {saved or 'different'} optimizer "
                              f"(hyperparameters {saved_keys}); this one is {ours} ({our_keys}): "
                              "load it into the kind of optimizer that saved it")


def load_sharded(path, shards, optimizer, *, group=None):
    """Load a checkpoint saved by :func:`save_sharded` at any world size into this rank.

    Raises :class:`CheckpointError` (a ValueError) and changes nothing if a shard is missing,
    truncated, corrupt or from another model. Returns the ``extra`` that was saved.
    """
    path = Path(path)
    entries = shards.shard_entries()
    payloads = _read_all(path, _fingerprint(entries), len(optimizer.param_groups))
    _check_optimizer(path, payloads[0], optimizer)
    values, new_states = {}, {}
    for j, (key, shape, (a, b), s) in enumerate(entries):
        numel = torch.Size(shape).numel()
        full, states, source = _assemble(key, numel, [p["entries"][j] for p in payloads], path)
        values[key] = full
        if source is not None:
            state = {k: v[a:b].to(s.device).clone() for k, v in states.items()}
            for k, v in source["replicated"].items():
                on_device = isinstance(v, torch.Tensor) and k in source["on_param_device"]
                state[k] = v.to(s.device) if on_device else (v.clone() if isinstance(v, torch.Tensor) else v)
            new_states[s] = state
    # every check has passed: change the model and the optimizer
    shards.load_entry_values(values)
    for _, _, _, s in entries:
        optimizer.state.pop(s, None)
        if s in new_states:
            optimizer.state[s] = new_states[s]
    for g, saved in zip(optimizer.param_groups, payloads[0]["param_groups"]):
        g.update(saved)
    return payloads[0]["extra"]
