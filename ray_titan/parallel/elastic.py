"""Elastic meshes: the mesh a job runs with on the worker count Ray Train grants.

An elastic job (``ray.num_workers = [min, max]``) configures its largest mesh (``max`` workers).
On ``n`` workers the mesh keeps ``pp``, ``cp`` and ``tp`` (a stage's layers and a tensor-parallel
group's shards are fixed by the model's split, a sequence's split by the context-parallel degree)
and shrinks the data-parallel degree to ``dp = n / (pp × cp × tp)``: ``dp_shard`` becomes the
largest divisor of ``dp`` not above the configured
``dp_shard`` (and a multiple of ``ep``), ``dp_replicate`` the rest. A count fits when ``pp × cp × tp``
divides it, such a ``dp_shard`` exists and ``microbatches × dp`` divides the global batch.

The global batch and the global data order do not depend on ``dp``: every step reads the same
``global_batch_size`` sequences (``ray_titan.data.loader``) and each data-parallel rank takes its
contiguous slice, so each step trains on the same tokens at any fitting count, and the loss, a
token-weighted mean over the whole batch, changes only by the order of fp32 sums.
"""

from __future__ import annotations

from ray_titan.config.schema import JobConfig

__all__ = ["fitting_worker_counts", "is_elastic", "mesh_for_workers", "worker_range"]


def is_elastic(cfg: JobConfig) -> bool:
    """Whether ``ray.num_workers`` is a ``[min, max]`` range."""
    return isinstance(cfg.ray.num_workers, list)


def worker_range(cfg: JobConfig) -> tuple[int, int]:
    """``(min, max)`` workers: the configured range, or the mesh product twice for a fixed job."""
    n = cfg.ray.num_workers
    if isinstance(n, list):
        return n[0], n[1]
    return cfg.world_size, cfg.world_size


def mesh_for_workers(cfg: JobConfig, n: int) -> JobConfig | None:
    """``cfg`` with the data-parallel axes sized for ``n`` workers (module docstring), or None when
    no mesh with ``cfg``'s ``pp``, ``cp`` and ``tp`` fits ``n`` workers. ``n = cfg.world_size`` gives
    ``cfg`` itself."""
    par = cfg.parallelism
    if n == cfg.world_size:
        return cfg
    kept = par.pp * par.cp * par.tp  # a sequence's cp ranks stay together too
    if n < 1 or n % kept:
        return None
    dp = n // kept
    shard = next((s for s in range(min(par.dp_shard, dp), 0, -1) if dp % s == 0 and s % par.ep == 0), None)
    if shard is None or cfg.training.global_batch_size % (par.microbatches * dp):
        return None
    mesh = par.model_copy(update={"dp_shard": shard, "dp_replicate": dp // shard})
    return cfg.model_copy(update={"parallelism": mesh})


def fitting_worker_counts(cfg: JobConfig) -> list[int]:
    """The worker counts in ``ray.num_workers``' range that a mesh fits, in increasing order."""
    lo, hi = worker_range(cfg)
    return [n for n in range(lo, hi + 1) if mesh_for_workers(cfg, n) is not None]
