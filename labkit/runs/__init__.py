"""What ranks run for the labs and benchmarks, one module per chapter: ``zero`` (Chapter 2),
``accumulate`` (Chapter 4). These modules compose techniques with the core; pass their rank
functions to :func:`labkit.dist.launch`, which needs them importable from a module."""
