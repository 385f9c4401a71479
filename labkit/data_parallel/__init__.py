"""Plain data parallelism (Chapter 2's baseline; Li et al. 2020): every rank holds the whole model
and the gradients are averaged over the ranks after backward.

``DataParallelNaive`` all-reduces each gradient on its own as backward produces it;
``DataParallelBucketed`` all-reduces buckets of gradients asynchronously, overlapping the rest of
backward, as torch's DistributedDataParallel does. Both finish by themselves at the end of
backward and skip the reduction inside ``no_sync()`` (gradient accumulation, Chapter 4). ZeRO
(:mod:`labkit.zero`) removes their redundancy; :mod:`labkit.parallel` composes them with the
other techniques.
"""

from .ddp import DataParallelBucketed, DataParallelNaive

__all__ = ["DataParallelNaive", "DataParallelBucketed"]
