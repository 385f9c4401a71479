"""labkit: the from-scratch implementations behind the course *Breaking the GPU Memory Wall*.

The core: ``device`` (seeding, device choice), ``model`` (the tiny GPT and published presets),
``data`` (the shipped corpus), ``precision`` (fp32, mixed and bf16 training), ``memory``
(analytic and measured memory), ``dist`` (the process launcher and the communication counter),
``collectives``, ``validate`` (argument checks) and ``book`` (``glue`` for the labs). Above it,
one package per technique: ``zero`` (Chapter 2), ``checkpoint`` (Chapter 3), ``accumulate``
(Chapter 4), ``tensor_parallel``, ``pipeline``, ``flash_attention``, ``paged_attention``; what
composes them for the labs is in ``runs``. labkit/README.md draws the map.
"""

from .device import pick_device, seed_everything, setup
from .version import __version__

__all__ = ["__version__", "pick_device", "seed_everything", "setup"]
