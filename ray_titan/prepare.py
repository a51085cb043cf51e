"""One way from what the user gave to the job that runs, shared by the Ray driver
(:func:`ray_titan.driver.train`) and the launcher without Ray (:mod:`ray_titan.launch`).

:func:`prepare_job` loads the config (a TOML path or a :class:`JobConfig`, plus dotted overrides),
rewrites it in one order (an in-memory dataset makes ``data.source = "ray_data"``; every path made
absolute; a Hugging Face checkpoint's model settings taken from it), prints the warnings, and runs
the pre-flight checks, so that a job both launchers accept is the same job. The memory plan is made
from the prepared config once the run directory exists
(:func:`ray_titan.memory_planner.record_memory_plan`, called by both).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ray_titan.checkpoint.huggingface import resolve_hf_job
from ray_titan.config.schema import JobConfig, apply_overrides, load_config
from ray_titan.preflight import job_warnings, validate_job
from ray_titan.run_dir import resolve_paths

__all__ = ["prepare_job", "resolve_job"]


def resolve_job(config: JobConfig | str | Path | None, overrides: list[str] | None = None, *,
                dataset: bool = False) -> tuple[JobConfig, list[str]]:
    """The job's config with every rewrite applied, and the warnings it deserves, before any check.

    ``config``: a :class:`JobConfig`, the path of a TOML job config, or None (the built-in
    defaults); ``overrides``: dotted flags (``["--training.steps=50"]``); ``dataset``: the run
    trains on an in-memory ``ray.data.Dataset`` (``data.source`` becomes ``"ray_data"``, with no
    ``data.path``). Raises :class:`~ray_titan.config.ConfigError` for a config that cannot load.
    """
    if isinstance(config, JobConfig):
        cfg = JobConfig.from_dict(apply_overrides(config.model_dump(), overrides)) if overrides else config
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


def prepare_job(config: JobConfig | str | Path | None, overrides: list[str] | None = None, *,
                dataset: bool = False, warn: bool = True) -> JobConfig:
    """The job to run: :func:`resolve_job`'s config, its warnings printed on stderr
    (``ray_titan: warning: ...``; ``warn=False``: not printed, for all but one rank of a launch), and
    the pre-flight checks passed (:func:`ray_titan.preflight.validate_job`, which also materialises
    the built-in corpus once, before any worker reads it). Raises
    :class:`~ray_titan.config.ConfigError` naming the setting, its value and what is valid, before
    anything starts."""
    cfg, warnings = resolve_job(config, overrides, dataset=dataset)
    for warning in warnings if warn else []:
        print(f"ray_titan: warning: {warning}", file=sys.stderr, flush=True)
    return validate_job(cfg, has_dataset=dataset)
