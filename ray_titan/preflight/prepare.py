"""One way from what the user gave to the job that runs, shared by the Ray driver
(:func:`ray_titan.driver.train`) and the launcher without Ray (:mod:`ray_titan.launch`).

:func:`prepare_job` loads the config (a TOML path or a :class:`JobConfig`, plus dotted overrides),
rewrites it in one order (an in-memory dataset makes ``data.source = "ray_data"``; every path made
absolute; a Hugging Face checkpoint's model settings taken from it), prints the warnings, runs
the pre-flight checks, applies ``memory.fit = "auto"`` (:func:`fit_memory`) and makes the memory
plan (:mod:`ray_titan.preflight.memory_plan`), so that a job both launchers accept is the same
job with the same plan: resolve → validate → fit → plan. The :class:`PreparedJob` writes its plan
once the run directory exists (:meth:`PreparedJob.record_plan`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_titan.checkpoint import resolve_hf_job
from ray_titan.config.schema import ConfigError, JobConfig, load_config
from ray_titan.config.units import format_bytes
from ray_titan.parallel.elastic import fitting_worker_counts, mesh_for_workers
from ray_titan.preflight.checks import job_warnings, validate_job
from ray_titan.preflight.memory_plan import FIT_GROUPS, MemoryPlan, memory_plan, write_memory_plan
from ray_titan.run_dir import resolve_paths

__all__ = ["PreparedJob", "fit_memory", "on_cluster", "prepare_job", "resolve_job", "worker_configs"]


def resolve_job(config: JobConfig | str | Path | None, overrides: list[str] | None = None, *,
                dataset: bool = False) -> tuple[JobConfig, list[str]]:
    """The job's config with every rewrite applied, and the warnings it deserves, before any check.

    ``config``: a :class:`JobConfig`, the path of a TOML job config, or None (the built-in
    defaults); ``overrides``: dotted flags (``["--training.steps=50"]``); ``dataset``: the run
    trains on an in-memory ``ray.data.Dataset`` (``data.source`` becomes ``"ray_data"``, with no
    ``data.path``). Raises :class:`~ray_titan.config.ConfigError` for a config that cannot load.
    """
    if isinstance(config, JobConfig):
        cfg = config.with_overrides(overrides) if overrides else config
    else:
        cfg = load_config(config, overrides)
    warnings = []
    dump = cfg.job.dump_folder
    if "://" not in dump and not Path(dump).expanduser().is_absolute() and "working_dir_files" in Path.cwd().parts:
        warnings.append(
            f"job.dump_folder = {dump!r} is relative and this job runs in Ray's temporary copy of its "
            "working directory, which Ray deletes; pass an absolute --job.dump_folder (shared storage on a "
            "multi-node cluster) to keep the run")
    if dataset:
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"source": "ray_data", "path": None})})
    cfg = resolve_hf_job(resolve_paths(cfg))
    return cfg, warnings + job_warnings(cfg)


@dataclass(frozen=True)
class PreparedJob:
    """A job ready to run: its ``config`` (resolved and checked) and its ``memory_plan`` (every
    rank's predicted memory, on the device kind the workers use, compared with
    ``memory.device_memory``, else the CUDA device the driver sees, if any: the driver may not see
    the workers' devices); None where the plan could not be made (``no_plan`` says why: the
    plan informs, it never stops a run) or was not asked for."""

    config: JobConfig
    memory_plan: MemoryPlan | None = None
    no_plan: str = ""

    def record_plan(self, run_dir: Path | str) -> dict[str, Any] | None:
        """Write the plan to ``<run_dir>/memory_plan.json`` and print each rank group's predicted
        peak (:func:`ray_titan.preflight.memory_plan.write_memory_plan`); returns it as a dict, or None
        with a warning on stderr where there is none."""
        if self.memory_plan is None:
            print(f"ray_titan: warning: no memory plan: {self.no_plan}", file=sys.stderr, flush=True)
            return None
        return write_memory_plan(self.memory_plan, run_dir)


def prepare_job(config: JobConfig | str | Path | None, overrides: list[str] | None = None, *,
                dataset: bool = False, warn: bool = True, plan: bool = True) -> PreparedJob:
    """The job to run: :func:`resolve_job`'s config, its warnings printed on stderr
    (``ray_titan: warning: ...``; ``warn=False``: not printed, for all but one rank of a launch),
    the pre-flight checks passed (:func:`ray_titan.preflight.checks.validate_job`, which also materialises
    the built-in corpus once, before any worker reads it), ``memory.fit = "auto"`` applied
    (:func:`fit_memory`, on every rank of a launch; its line printed on stdout where ``warn``) and
    its memory plan (``plan=False``: none, for all but one rank of a launch). Raises
    :class:`~ray_titan.config.ConfigError` naming the setting, its value and what is valid (a job
    ``memory.fit`` cannot fit among them), before anything starts."""
    cfg, warnings = resolve_job(config, overrides, dataset=dataset)
    for warning in warnings if warn else []:
        print(f"ray_titan: warning: {warning}", file=sys.stderr, flush=True)
    cfg = validate_job(cfg, has_dataset=dataset)
    device = "cuda" if cfg.ray.use_gpu else "cpu"
    cfg, fitted, line = fit_memory(cfg, device, dataset=dataset)  # every rank of a launch: the same job
    if line and warn:
        print(f"ray_titan: {line}", flush=True)
    if not plan:
        return PreparedJob(cfg)
    if fitted is not None:
        return PreparedJob(cfg, fitted)
    try:
        return PreparedJob(cfg, memory_plan(cfg, cfg.memory.device_memory, device, levers=False))
    except Exception as e:  # the plan informs; a job the pre-flight checks passed still runs
        return PreparedJob(cfg, no_plan=f"{type(e).__name__}: {e}")


def fit_memory(cfg: JobConfig, device: str | None, device_memory: int | str | None = None, *,
               dataset: bool = False, margin: float | None = None,
               vocab_size: int | None = None, check_data: bool = True) -> tuple[JobConfig, MemoryPlan | None, str]:
    """``memory.fit = "auto"``: ``cfg`` rewritten with the cheapest microbatches / activation
    offloading / activation checkpointing levers (:data:`~ray_titan.preflight.plan_levers.FIT_GROUPS`) that make its
    memory plan fit, re-validated and re-planned; returns ``(config, its plan, the line to print)``.

    The capacity is ``device_memory`` (bytes or ``"80GiB"``), else ``memory.device_memory``, else
    the CUDA device this process sees; ``device`` and ``margin`` as in
    :func:`~ray_titan.preflight.memory_plan.memory_plan`, and ``vocab_size`` (None: the tokenizer's;
    the dry run's, the flavor's it builds); ``check_data`` as in
    :func:`~ray_titan.preflight.checks.validate_job`, for the rewritten job. ``cfg`` unchanged (with an empty line)
    where ``memory.fit = "off"`` (and no plan) or the job fits; with a note as the line where no
    capacity is known. Raises :class:`~ray_titan.config.ConfigError` naming ``memory.fit`` where
    no such lever fits (saying what would: more devices) or the plan cannot be made.
    """
    if cfg.memory.fit != "auto":
        return cfg, None, ""
    capacity = device_memory if device_memory is not None else cfg.memory.device_memory
    try:
        plan = memory_plan(cfg, capacity, device, vocab_size=vocab_size, lever_groups=FIT_GROUPS, margin=margin)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"memory.fit = 'auto': the memory plan failed ({type(e).__name__}: {e}); "
                          "set memory.fit = 'off' to run the job as given") from e
    if plan.fits is None:
        return cfg, plan, (f"memory.fit = auto: no device capacity ({plan.device_memory_source}); set "
                           "memory.device_memory, e.g. 80GiB; the job runs as given")
    if plan.fits:
        return cfg, plan, ""
    assert plan.device_memory is not None and plan.usable is not None
    head = (f"memory.fit = auto: the plan's peak {format_bytes(plan.max_peak)} does not fit "
            f"{format_bytes(plan.device_memory)}"
            + (f" ({format_bytes(plan.usable)} usable)" if plan.usable != plan.device_memory else ""))
    if plan.recommendation is None:
        every = memory_plan(cfg, capacity, device, vocab_size=vocab_size, margin=margin).recommendation
        would = (f"; what would fit: {' '.join(every)}" if every
                 else "; no lever the plan knows fits, not even more devices (a smaller model, microbatch or sequence)")
        raise ConfigError(f"{head}, and no choice of microbatches, activation offloading and activation "
                          "checkpointing fits (the levers "
                          f"memory.fit = 'auto' may apply){would}; give the job more devices, or set "
                          "memory.fit = 'off'")
    new = cfg.with_overrides(plan.recommendation)
    new = validate_job(new, check_data=check_data, has_dataset=dataset)
    after = memory_plan(new, capacity, device, vocab_size=vocab_size, levers=False, margin=margin)
    chosen = [lv for lv in plan.levers if set(lv.overrides) <= set(plan.recommendation)]
    why = "; ".join(f"{lv.name}: {lv.cost}" for lv in chosen)
    return new, after, (f"{head}; training with {' '.join(plan.recommendation)} (peak {format_bytes(after.max_peak)}), "
                        f"the cheapest that fits ({why})")


def on_cluster(cfg: JobConfig, cpus_per_worker: float) -> JobConfig:
    """The job's rewrite that needs the cluster, made by the Ray driver once it has joined it and
    before any worker starts: ``training.threads_per_worker`` unset becomes the CPUs a worker
    reserves (``cpus_per_worker``, rounded up past a thousandth, at least 1)."""
    if cfg.training.threads_per_worker is not None:
        return cfg
    threads = max(1, int(cpus_per_worker + 0.999))
    return cfg.model_copy(update={"training": cfg.training.model_copy(update={"threads_per_worker": threads})})


def worker_configs(cfg: JobConfig) -> dict[int, JobConfig]:
    """The config the workers of a Ray run train with, by the number of workers Ray Train grants an
    attempt: one entry for a fixed mesh, one per fitting count for an elastic one
    (:func:`ray_titan.parallel.elastic.mesh_for_workers`). Made in the driver before any worker
    starts and sent as these objects, so a worker picks its entry and never rewrites the config."""
    meshes = {n: mesh_for_workers(cfg, n) for n in fitting_worker_counts(cfg)}
    return {n: mesh for n, mesh in meshes.items() if mesh is not None}
