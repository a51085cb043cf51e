"""Weights & Biases from the collector (no Ray, no network): an offline run read back with
wandb's own reader, and a clear error before workers when the package is missing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ray_titan.config import load_config
from ray_titan.config.schema import ConfigError
from ray_titan.metrics.collector.collector import MetricsCollector
from ray_titan.metrics.collector.sinks.wandb import wandb_settings
from ray_titan.metrics.reading.steps import read_steps
from ray_titan.parallel.dims import ParallelDims
from tests.conftest import REPO
from tests.unit.test_collector import _report


def _records(path: Path) -> list[dict]:
    """Every record of a ``.wandb`` transaction log, as ``wandb leet inspect --json`` prints them."""
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", str(path)], capture_output=True, text=True,
                         timeout=120, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_the_collector_logs_every_step_and_the_config_to_an_offline_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(REPO / "configs" / "debug_llama.toml", [
        "--metrics.wandb=true", "--metrics.wandb_project=rt-test", "--metrics.wandb_run_name=offline-check",
        '--metrics.wandb_tags=["ci", "pp2"]'])
    dims = ParallelDims(pp=2, dp_shard=2)
    c = MetricsCollector(str(tmp_path), dims.world_size, dims.last_stage_ranks(), 3, log_freq=1,
                         enable_tensorboard=False, wandb=wandb_settings(cfg))
    for step in (1, 2, 3):
        reports = [_report(step, r, dims, loss=4.0 - step + r / 10 if r >= 2 else None, rss=(100 + step) << 20)
                   for r in range(4)]
        if step == 3:  # an evaluation at the last step
            for rep in reports[2:]:
                rep.update(val_loss=2.0 + rep["rank"] / 10, val_tokens=100)
        c.report(reports)
    assert c.finish()["errors"] == []

    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = _records(log)
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["project"] == "rt-test" and run["display_name"] == "offline-check" and run["tags"] == ["ci", "pp2"]
    assert run["config"]["update"]["training"]["steps"] == 300
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    assert sorted(history) == [1, 2, 3]  # one entry per step, from the collector alone
    steps = read_steps(tmp_path).sort_by("step")
    losses = dict(zip(steps["step"].to_pylist(), steps["step_loss"].to_pylist()))
    for step, item in history.items():
        assert item["loss"] == pytest.approx(losses[step])
        for rank in range(4):  # every rank's memory series
            assert item[f"memory/rank{rank}/host_rss_mib"] == pytest.approx(100 + step + rank / 2**20)
    assert history[3]["val/loss"] == pytest.approx(2.25) and "val/loss" not in history[2]


def test_wandb_without_the_package_is_refused_before_workers(monkeypatch, corpus_cache):
    import importlib.util

    from ray_titan.preflight import checks as preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = load_config(REPO / "configs" / "debug_llama.toml",
                      ["--metrics.wandb=true", f"--data.cache_dir={corpus_cache}"])
    with pytest.raises(ConfigError, match=r"metrics.wandb = true but the wandb package is not installed"
                                          r".*ray-titan\[wandb\]"):
        preflight.validate_job(cfg)
