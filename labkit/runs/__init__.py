"""What ranks run for the labs and benchmarks, one module per chapter: ``zero`` (Chapter 2),
``accumulate`` (Chapter 4), ``tensor_parallel`` (Chapter 5), ``pipeline``, ``parallel3d`` (data x
tensor x pipeline) and ``plan`` (the planner) for Chapter 6, ``context_parallel`` (Chapter 10),
``expert_parallel`` (Chapter 11). These modules run and measure; a
model sharded by several techniques at once comes from :func:`labkit.parallel.parallelize_gpt`.
Pass their rank functions to :func:`labkit.dist.launch`, which needs them importable from a
module."""

__all__: list[str] = []  # import the rank functions from their modules (labkit.runs.zero, ...)
