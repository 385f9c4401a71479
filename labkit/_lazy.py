"""A package's ``__getattr__`` and ``__dir__`` (PEP 562) that import each export on first use.

A package whose formulas must load without torch (``labkit.estimate`` reads ``memory.analytic``,
``zero.analytic``, ``pipeline.schedules``) imports them at once and names the rest in a table,
module by module, as its imports would: ``{".meter": ("MemoryMeter", ...)}``. Standard library
only: the calculators run the torch-free packages in the browser.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["lazy_exports"]


def _absolute(relative: str, package: str) -> str:
    """'.meter' in 'labkit.memory' -> 'labkit.memory.meter'; '..collectives' -> 'labkit.collectives'."""
    name = relative.lstrip(".")
    level = len(relative) - len(name)
    if not level or not name:
        raise ValueError(f"module {relative!r} must be relative to {package!r}, as in from .meter import ...")
    return f"{package.rsplit('.', level - 1)[0]}.{name}"


def lazy_exports(package: str, table: dict, submodules: tuple = ()):
    """``(__getattr__, __dir__)`` for ``package`` (its ``__name__``), whose ``table`` maps a module,
    relative as in an import (``".meter"``, ``"..collectives"``), to the names it exports.

    A name is imported from its module when first read, then kept as the package's attribute;
    the package's own modules named in the table, and ``submodules``, load as attributes too. An
    export named like a submodule (``pipeline.simulate``) wins over it, as an eager import did.
    """
    where = {name: _absolute(module, package) for module, names in table.items() for name in names}
    own = {m.rpartition(".")[2] for m in where.values() if m.rpartition(".")[0] == package} | set(submodules)
    shadowing = [name for name in where if name in own]

    def __getattr__(name: str):
        if name in where:
            value = getattr(importlib.import_module(where[name]), name)
        elif name in own:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = sys.modules[package]
        setattr(module, name, value)
        for export in shadowing:  # a submodule's import made it the package's attribute: the export wins
            loaded = sys.modules.get(where[export])
            if loaded is not None and hasattr(loaded, export):
                setattr(module, export, getattr(loaded, export))
        return value

    def __dir__() -> list[str]:
        module = sys.modules[package]
        return sorted(set(vars(module)) | set(module.__all__))

    return __getattr__, __dir__
