"""labkit's version (also in pyproject.toml): a module of its own, so that core modules can read
it without importing the ``labkit`` package they are part of."""

__version__ = "0.1.0"
