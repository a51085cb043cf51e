"""Weights & Biases: the step's scalars to a W&B run (``metrics.wandb``), from the collector, the
one place that sees every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray_titan.metrics.collector.sinks.base import Sink, StepRecord

__all__ = ["WandbSink", "wandb_settings"]


def wandb_settings(cfg: Any) -> dict[str, Any] | None:
    """The :class:`WandbSink` arguments of a job (``metrics.wandb``; its config included), or None."""
    m = cfg.metrics
    if not m.wandb:
        return None
    return {"project": m.wandb_project, "name": m.wandb_run_name, "tags": list(m.wandb_tags),
            "config": cfg.model_dump(mode="json")}


class WandbSink(Sink):
    """The same scalars as the TensorBoard sink to a Weights & Biases run, one ``log`` call per
    step, with the job's config. Opened by the collector, the one place that sees every rank.

    The run id is derived from the run directory's name, so a restarted collector continues the
    same W&B run (``resume="allow"``); W&B steps only increase, so steps replayed after a worker
    restart are not logged again there (Parquet has them). Raises ``ImportError`` without the
    ``wandb`` package (the pre-flight checks refuse that first).
    """

    def __init__(self, run_dir: str | Path, project: str, name: str | None, tags: list[str],
                 config: dict[str, Any] | None):
        import wandb

        run_dir = Path(run_dir)
        run_id = "".join(c if c.isalnum() or c in "-_" else "-" for c in run_dir.name)[-64:]
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=name or run_dir.name, tags=tags or None, config=config,
                              dir=str(run_dir), id=run_id, resume="allow", reinit="create_new")
        self.last_step = -1

    def log(self, record: StepRecord) -> None:
        """The step's scalars and its MoE layers' load, unless W&B has the step already (a replay)."""
        values = record.scalars() + record.expert_load_scalars()
        if record.step > self.last_step and values:
            self.run.log(dict(values), step=record.step)
            self.last_step = record.step

    def close(self) -> None:
        self.run.finish()
