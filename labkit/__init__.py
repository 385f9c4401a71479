"""labkit: the from-scratch implementations behind the course *Breaking the GPU Memory Wall*.

Modules: ``device`` (seeding, device choice), ``model`` (the tiny GPT and published presets),
``data`` (the shipped corpus), ``precision`` (fp32, mixed and bf16 training), ``memory``
(analytic and measured memory), ``dist`` (the process launcher and the communication counter),
``zero`` (Chapter 2), ``checkpoint`` (Chapter 3), ``accumulate`` (Chapter 4).
"""

__version__ = "0.1.0"

from .device import pick_device, seed_everything, setup  # noqa: E402

__all__ = ["__version__", "pick_device", "seed_everything", "setup"]
