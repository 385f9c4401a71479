"""labkit: the from-scratch implementations behind the course *Breaking the GPU Memory Wall*.

The core: ``device`` (seeding, device choice), ``model`` (the tiny GPT and published presets),
``data`` (the shipped corpus), ``precision`` (fp32, mixed and bf16 training), ``memory``
(analytic and measured memory), ``dist`` (the process launcher and the communication counter),
``collectives``, ``validate`` (argument checks), ``hardware`` (GPUs and their peaks) and ``book``
(``glue`` for the labs). Above it, one package per technique: ``zero`` (Chapter 2),
``checkpoint`` (Chapter 3), ``accumulate`` (Chapter 4), ``tensor_parallel``, ``pipeline``,
``flash_attention``, ``paged_attention``; what composes them for the labs is in ``runs``.
labkit/README.md draws the map.

``import labkit`` imports no torch: ``setup``, ``seed_everything`` and ``pick_device`` (and any
submodule, ``labkit.memory``) are loaded on first use, so torch-free modules such as
``labkit.hardware`` run where torch is not installed.
"""

from __future__ import annotations

import importlib

from .version import __version__

__all__ = ["__version__", "pick_device", "seed_everything", "setup"]

_FROM_DEVICE = ("pick_device", "seed_everything", "setup")


def __getattr__(name: str):
    """Load ``labkit.setup`` (and the other exports of ``device``) or a submodule on first use."""
    if name in _FROM_DEVICE:
        from . import device
        return getattr(device, name)
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise  # the submodule exists but something it imports is missing
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
