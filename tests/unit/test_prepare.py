"""One ``prepare_job`` for both launchers: the Ray driver and ``python -m ray_titan.launch`` run the
same resolved, validated config for the same input (no Ray: each is stopped where it makes its run
directory)."""

from __future__ import annotations

import pytest

import ray_titan.driver.run as driver
import ray_titan.launch as launch
from ray_titan.config.schema import JobConfig


class _Made(Exception):
    """Raised in place of making the run directory: carries the config it was given."""

    def __init__(self, cfg: JobConfig):
        super().__init__("run directory")
        self.cfg = cfg


def _stop_at_run_dir(cfg: JobConfig):
    raise _Made(cfg)


def test_driver_and_launcher_prepare_the_same_job(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # A relative path to resolve, a warning to print, a mesh of one process.
    (tmp_path / "job.toml").write_text(
        '[job]\ndump_folder = "runs"\n[training]\nsteps = 3\nthreads_per_worker = 1\n'
        '[lr_scheduler]\nwarmup_steps = 5\n[parallelism]\npp = 1\ndp_shard = 1\n')
    overrides = ["--data.cache_dir=cache", "--training.seed=7"]
    monkeypatch.setattr(driver, "connect", lambda cfg: None)
    monkeypatch.setattr(driver, "cpus_per_worker", lambda cfg: 1.0)
    monkeypatch.setattr(driver, "make_run_dir", _stop_at_run_dir)
    monkeypatch.setattr(launch, "make_run_dir", _stop_at_run_dir)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(_Made) as by_ray:
        driver.train(str(tmp_path / "job.toml"), overrides)
    ray_warnings = capsys.readouterr().err
    with pytest.raises(_Made) as by_launch:
        launch.main(["--config", str(tmp_path / "job.toml"), *overrides])
    assert by_ray.value.cfg.model_dump() == by_launch.value.cfg.model_dump()
    assert by_ray.value.cfg.job.dump_folder == str(tmp_path / "runs")  # resolved, not merely copied
    assert by_ray.value.cfg.data.cache_dir == str(tmp_path / "cache")
    assert "lr_scheduler.warmup_steps = 5" in ray_warnings
    assert capsys.readouterr().err == ray_warnings  # the same warnings, once each
