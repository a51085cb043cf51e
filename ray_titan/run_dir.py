"""The run directory: ``<job.dump_folder>/<job.name>-<UTC timestamp>``, on a local path or a URI.

Both launchers (the Ray driver and the launcher without Ray) make it the same way, after
:func:`resolve_paths` has made the job's paths absolute (Ray Train changes a worker's working
directory). What lives in it: ``config.json``, ``metrics/``, ``tb/``, ``checkpoints/``,
``timings/``, ``memory/`` and, when the workers stopped a run without a collector,
:data:`STOP_REASON_FILE`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from ray_titan import storage
from ray_titan.config.schema import JobConfig

__all__ = ["STOP_REASON_FILE", "make_run_dir", "resolve_paths", "under"]

_S = TypeVar("_S", bound=BaseModel)

STOP_REASON_FILE = "stop_reason.txt"
"""Without a collector, why the workers ended the run early (``training.on_nonfinite = "stop"``)."""


def under(run_dir: Path | str, *parts: str) -> Path | str:
    """``run_dir / parts``: a :class:`~pathlib.Path` for a local run directory, a URI string for
    a remote one."""
    return run_dir.joinpath(*parts) if isinstance(run_dir, Path) else storage.join(run_dir, *parts)


def make_run_dir(cfg: JobConfig) -> Path | str:
    """``<dump_folder>/<job.name>-<UTC timestamp>``, created: an absolute local path (also for a
    ``file://`` dump folder), or a URI string for remote storage (:mod:`ray_titan.storage`)."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S-%f")
    name = f"{cfg.job.name}-{stamp}"
    local = storage.local_path(cfg.job.dump_folder)
    if local is None:
        uri = storage.join(cfg.job.dump_folder, name)
        storage.makedirs(uri)
        return uri
    run_dir = local / name
    run_dir.mkdir(parents=True, exist_ok=False)
    return run_dir


def resolve_paths(cfg: JobConfig) -> JobConfig:
    """A copy with every user path made absolute: Ray Train changes a worker's working directory,
    where a relative path would mean another place. ``data.path``, ``data.tokenizer_path``,
    ``data.cache_dir``, ``data.chat_template_path``, ``data.sources``' paths,
    ``validation.path``, ``checkpoint.load_path``, ``checkpoint.initial_load_hf`` and
    ``job.dump_folder``; a URI stays as it is (``file://`` becomes its local path)."""

    def absolute(section: _S, keys: tuple[str, ...]) -> _S:
        return section.model_copy(update={k: str(storage.local_path(v) or v) for k in keys
                                          if (v := getattr(section, k))})

    data = absolute(cfg.data, ("path", "tokenizer_path", "cache_dir", "chat_template_path"))
    if data.sources:
        data = data.model_copy(update={"sources": [absolute(s, ("path",)) for s in data.sources]})
    return cfg.model_copy(update={
        "data": data, "job": absolute(cfg.job, ("dump_folder",)),
        "validation": absolute(cfg.validation, ("path",)),
        "checkpoint": absolute(cfg.checkpoint, ("load_path", "initial_load_hf")),
    })
