"""Where a checkpoint is written: straight to ``<run_dir>/checkpoints`` (no Ray), or staged per
rank on local disk and handed to ``ray.train.report`` (Ray Train copies it into storage)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from ray_titan.checkpoint.manifest import MANIFEST, _is_complete, step_dir_name


class LocalCheckpointStorage:
    """Checkpoints written straight to ``directory`` (shared by the ranks; no Ray). Rank 0 keeps
    the latest ``keep`` complete ones (0: all)."""

    shared = True

    def __init__(self, directory: str | Path, keep: int):
        self.directory, self.keep = Path(directory), keep

    def resume_from(self) -> Path | None:
        return None  # each launch is a new run; checkpoint.load_path continues an old one

    def begin(self, step: int, rank: int) -> Path:
        return self.directory / step_dir_name(step)

    def commit(self, step: int, write_dir: Path, rank: int, metrics: dict[str, Any]) -> None:
        if rank == 0 and self.keep:
            complete = [p for p in sorted(self.directory.glob("step-*")) if (p / MANIFEST).exists()]
            newest = complete[-1] if complete else write_dir
            for p in sorted(self.directory.glob("step-*")):
                if p < newest and p not in complete[-self.keep:]:
                    shutil.rmtree(p, ignore_errors=True)


class RayTrainCheckpointStorage:
    """Checkpoints handed to Ray Train: each rank writes to a local staging directory, then
    ``ray.train.report(checkpoint=...)`` copies every rank's files into
    ``<storage_path>/<name>/step-NNNNNNNN`` (Ray keeps ``CheckpointConfig.num_to_keep``)."""

    shared = False

    def __init__(self, run_dir: str | Path | None = None):
        self.run_dir = run_dir

    def resume_from(self):
        """The checkpoint a restarted worker group resumes from: Ray Train's latest, or a newer
        complete one in ``<run_dir>/checkpoints``. Ray's controller learns of a checkpoint only
        when it next polls the workers (every ~2 s), so a worker that dies right after a save
        can leave Ray one checkpoint behind what is safely on disk."""
        import ray.train

        ckpt = ray.train.get_checkpoint()
        local = _local_dir(self.run_dir)
        if local is None or not (local / "checkpoints").is_dir():
            return ckpt
        known = _step_of(Path(ckpt.path).name) if ckpt is not None else 0
        for p in sorted((local / "checkpoints").glob("step-*"), reverse=True):
            if _step_of(p.name) <= known:
                break
            if _is_complete(p):  # sizes here; rank 0 checks the CRC-32s when it loads
                return ray.train.Checkpoint.from_directory(str(p))
        return ckpt

    def begin(self, step: int, rank: int) -> Path:
        """A fresh staging directory for this rank's share of ``step``, under the run directory
        (:func:`staging_root`), after removing what a worker killed while saving left there."""
        root = staging_root(self.run_dir)
        for old in root.glob(f"*-rank{rank}"):
            shutil.rmtree(old, ignore_errors=True)
        write_dir = root / f"{step_dir_name(step)}-rank{rank}"
        write_dir.mkdir(parents=True, exist_ok=True)
        return write_dir

    def commit(self, step: int, write_dir: Path, rank: int, metrics: dict[str, Any]) -> None:
        import ray.train

        quiet_ray_train_checkpoint_logs()
        try:
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(write_dir)),
                             checkpoint_dir_name=step_dir_name(step))
        finally:
            shutil.rmtree(write_dir, ignore_errors=True)



def quiet_ray_train_checkpoint_logs() -> None:
    """Keep Ray Train's two INFO lines of each save on a worker ("Checkpoint successfully created
    at", "Reporting training result": Ray 2.60's ``execution/storage.py`` and ``execution/context.py``,
    the only INFO lines of either logger) off the console: every rank printed both, four copies per
    checkpoint on the main job. The driver's side prints one line instead
    (:class:`ray_titan.driver.torch_trainer.CheckpointLine`); these loggers' warnings and errors
    still show."""
    import logging

    from ray.train.v2._internal.execution import context, storage

    # context.py names its logger by its file, not its module.
    for name in (storage.__name__, context.__file__):
        logging.getLogger(name).setLevel(logging.WARNING)


STAGING = ".checkpoint_staging"


def staging_root(run_dir: str | Path | None) -> Path:
    """Where ranks stage a checkpoint before Ray Train copies it into ``checkpoints/``:
    ``<run_dir>/.checkpoint_staging`` (a remote run directory: the same under this node's local
    staging directory, :func:`ray_titan.storage.staging_dir`; no run directory: the system's temp
    directory). Removed by the driver however the run ends (:func:`remove_staging`)."""
    from ray_titan import storage

    if run_dir is None:
        return Path(tempfile.gettempdir()) / "ray_titan" / STAGING
    local = storage.local_path(run_dir)
    return (local if local is not None else storage.staging_dir(str(run_dir))) / STAGING


def remove_staging(run_dir: str | Path) -> None:
    """Remove every rank's checkpoint staging of the run (what a save interrupted by Ctrl-C, a
    SIGTERM or a crash left behind; model-sized on a real run)."""
    shutil.rmtree(staging_root(run_dir), ignore_errors=True)


def _step_of(name: str) -> int:
    try:
        return int(name.removeprefix("step-"))
    except ValueError:
        return -1


def _local_dir(run_dir: str | Path | None) -> Path | None:
    if run_dir is None:
        return None
    from ray_titan import storage

    return storage.local_path(run_dir)
