"""The metrics collector actor, seen from the driver: start it, poll it for the console, give it
the reports a checkpoint kept, and read its summary as a :class:`~ray_titan.metrics.outcome.RunOutcome`.

The collector itself is :class:`ray_titan.metrics.collector.collector.MetricsCollector`; here it runs as a Ray
actor owned by the driver (``num_cpus=0``), so it outlives the worker group and Ray restarts it up to
``metrics.collector_max_restarts`` times.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ray_titan.config.schema import JobConfig
from ray_titan.metrics.outcome import RunOutcome

__all__ = ["Poller", "deliver_checkpoint_reports", "end_collector", "finish_collector", "start_collector"]


def start_collector(cfg: JobConfig, run_dir: Path | str, counts: list[int]) -> Any:
    """The collector actor of a run on ``counts`` workers (the counts an elastic run may use), on
    the head node; None with ``metrics.enabled = false``. Restarted by Ray if it dies; it resumes
    from its flushed parts and workers resend the rest."""
    if not cfg.metrics.enabled:
        return None
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ray_titan.metrics.collector.collector import MetricsCollector
    from ray_titan.metrics.collector.leak import leak_settings
    from ray_titan.metrics.collector.sinks.wandb import wandb_settings
    from ray_titan.parallel.elastic import is_elastic, mesh_for_workers
    from ray_titan.trainer.build import parallel_dims

    dims = parallel_dims(cfg)
    # An elastic run's last-stage ranks depend on the mesh of each attempt's worker count.
    last_stage_ranks: list[int] | dict[int, list[int]] = dims.last_stage_ranks() if not is_elastic(cfg) else {
        n: parallel_dims(m).last_stage_ranks() for n in counts if (m := mesh_for_workers(cfg, n)) is not None}
    # No task events: each report call would be one more entry the GCS keeps (up to 100k) and
    # the dashboard lists, and their bookkeeping costs the GCS and the actor CPU every call.
    # Any: Ray types an actor handle's `method.remote()` only for @ray.method-decorated methods.
    # On the head node (the one whose loss ends the cluster anyway): a collector on a worker
    # node would die with that node, and with it reports the lost workers cannot resend.
    head = next((n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]),
                ray.get_runtime_context().get_node_id())
    collector: Any = ray.remote(MetricsCollector).options(
        num_cpus=0, max_restarts=cfg.metrics.collector_max_restarts, enable_task_events=False,
        scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=True),
    ).remote(
        str(run_dir), dims.world_size, last_stage_ranks, cfg.training.steps,
        cfg.metrics.log_freq, cfg.metrics.flush_every_steps, cfg.metrics.enable_tensorboard,
        leak=leak_settings(cfg.memory), on_leak=cfg.memory.on_leak,
        kill_at_step=cfg.debug.kill_collector_at_step, nice=cfg.metrics.collector_nice, wandb=wandb_settings(cfg),
        series_max_ranks=cfg.metrics.series_max_ranks,
        # A run that loads no checkpoint (or its weights only) starts at step 1; one that resumes, at its step.
        first_step=1 if cfg.checkpoint.load_path is None or cfg.checkpoint.load_model_only else None,
    )
    return collector


def start_aggregators(cfg: JobConfig, collector: Any, counts: list[int]) -> list | None:
    """The metrics aggregators between the ranks and the collector: one per
    ``metrics.ranks_per_aggregator`` ranks of the largest worker count, forwarding a group's
    reports as one columnar batch (:func:`ray_titan.metrics.collector.aggregator.create_aggregators`); None
    without a collector or for a job no larger than one group."""
    if collector is None:
        return None
    from ray_titan.metrics.collector.aggregator import create_aggregators

    return create_aggregators(collector, max(counts), cfg.metrics.ranks_per_aggregator)


def finish_collector(collector: Any, shown_step: int) -> RunOutcome:
    """Have the collector flush and summarise the run (``shown_step``: the newest step the console
    showed), then end the actor. A collector that cannot finish gives an outcome with no loss and
    the error recorded: the parts it flushed are on disk, and a training error is never hidden.
    The actor lives on until :func:`end_collector`."""
    import ray

    try:
        return RunOutcome.from_summary(ray.get(collector.finish.remote(shown_step), timeout=120))
    except Exception as e:
        return RunOutcome.collector_failed(e)


def end_collector(collector: Any) -> None:
    """End the collector actor (after the console's last poll); one already gone is fine."""
    import ray

    try:
        ray.kill(collector)
    except Exception:  # already gone
        pass


def deliver_checkpoint_reports(collector: Any, run_dir: str | Path) -> None:
    """Give the collector the latest checkpoint's unacknowledged reports (``reports/rank<r>.json``):
    a run stopped (Ctrl-C, SIGTERM, a failure) after a checkpoint but before its steps' reports
    reached the collector keeps them, so its metrics reach the checkpoint's step. Reports the
    collector already has are ignored by it; best effort (``finish`` records what is missing)."""
    import ray

    from ray_titan.checkpoint import find_latest, saved_reports

    if not isinstance(run_dir, Path):
        return
    latest = find_latest(run_dir / "checkpoints")
    if latest is None:
        return
    try:
        for reports in saved_reports(latest).values():
            if reports:
                ray.get(collector.report.remote(reports), timeout=30)
    except Exception as e:  # a dead collector, an unreadable file: the flushed metrics stand
        print(f"ray_titan: warning: could not deliver the reports of {latest}: {e}", file=sys.stderr, flush=True)




class Poller:
    """The console thread's call to the collector; remembers the newest step shown, so that a
    collector restarted by Ray does not show again the steps it re-assembles."""

    def __init__(self, collector: Any):
        self.collector, self.shown_step = collector, 0

    def __call__(self) -> dict[str, Any]:
        import ray

        if not ray.is_initialized():  # never let a late poll start a new local cluster
            raise RuntimeError("Ray is shut down")
        payload = ray.get(self.collector.poll.remote(self.shown_step), timeout=30)
        if payload.get("latest"):
            self.shown_step = max(self.shown_step, payload["latest"]["step"])
        return payload
