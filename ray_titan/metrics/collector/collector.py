"""The metrics collector: one place that sees every rank at every step.

Used as a Ray actor (``ray.remote(MetricsCollector).options(num_cpus=0)``, owned by the driver)
or as a plain object in-process. Workers call :meth:`MetricsCollector.report` with batches of
step reports; when every rank has reported a step, the collector assembles it:

- loss: the token-weighted mean of the losses of the ranks that hold the last pipeline stage
  (given by the stage-to-rank mapping, ``last_stage_ranks``; weighted by their counted labels,
  ``loss_tokens``, under loss masks), and their max, each data-parallel rank counted once: the tp
  ranks of one tensor-parallel group hold the same loss and the same tokens, so only the one at
  ``tp = 0`` is counted (``summary.step_summary``). A last-stage rank without a loss, or a
  non-last-stage rank with one, is recorded as an error, not filled in.
- tokens/s: tokens of the step (summed over the last stage's DP ranks) over the slowest rank's
  step time.
- one row per rank (timings, memory, GC pause) to Parquet, scalars to TensorBoard and W&B (the
  sinks, one interface: ``sinks.base.Sink``), and a console line at the first step, every
  ``log_freq`` steps and at the last step, which the driver drains and prints.
- each rank's measured memory breakdown (``memory.breakdown_step``), kept in
  ``metrics/memory_breakdown.jsonl`` as it arrives and returned by :meth:`MetricsCollector.finish`.
- a memory verdict per rank (``leak``: warming_up / stable / growing, MiB per step, projected
  OOM step) in every row and in TensorBoard, and a console line whenever a rank's verdict
  changes. The leak policy (``leak_policy``, ``on_leak``) decides whether a ``growing`` verdict
  ends the run; the collector then keeps the reason in :attr:`MetricsCollector.stop_reason`,
  which every later :meth:`MetricsCollector.report` call returns to the workers.

Fault tolerance. Every report carries its worker group's ``attempt_start_time``: after a worker
group restart, the replayed steps' reports supersede the lost attempt's (pending ones are
dropped, assembled rows are replaced when the table is consolidated: ``intake``). :meth:`report`
answers with the collector's incarnation and, per attempt, the step up to which rows are on disk
(``durable``); workers hold their reports until then and resend them to a restarted collector.
A collector restarted by Ray (``max_restarts``) resumes from its flushed parts (``resume``): it
knows which steps are on disk and ignores their resent reports.
"""

from __future__ import annotations

import os
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ray_titan import storage
from ray_titan.metrics.collector import ray_metrics, resume
from ray_titan.metrics.collector.breakdowns import BreakdownLog
from ray_titan.metrics.collector.columns import (
    BREAKDOWN,
    NODE,
    Columns,
    StepReports,
    expert_load_of_blocks,
    expert_load_of_objects,
    newest_reports,
)
from ray_titan.metrics.collector.completeness import Completeness, check_complete
from ray_titan.metrics.collector.console import (
    CONSOLE_RANKS,
    Console,
    format_scale_line,
    format_step_line,
    layout_line,
    leak_stop_reason,
    verdict_messages,
)
from ray_titan.metrics.collector.durable import DurableSteps
from ray_titan.metrics.collector.errors import ERRORS_FILE, ErrorLog
from ray_titan.metrics.collector.intake import Intake
from ray_titan.metrics.collector.leak import GROWING, LeakMonitor, leak_settings
from ray_titan.metrics.collector.leak_policy import LeakPolicy
from ray_titan.metrics.collector.sinks.base import Sink, SinkSet, StepRecord
from ray_titan.metrics.collector.sinks.parquet import ParquetSink
from ray_titan.metrics.collector.sinks.step_table import StepColumns
from ray_titan.metrics.collector.sinks.tensorboard import TensorBoardSink
from ray_titan.metrics.collector.sinks.wandb import WandbSink
from ray_titan.metrics.collector.summary import LastStage, Tally, group_size, rank_rows, step_summary
from ray_titan.metrics.fields import MEMORY_FIELDS, VERDICT_CODES, describe_coords
from ray_titan.metrics.packing import pack_reports

__all__ = ["MetricsCollector"]

_STOPPED = "run stopped: "
_GROWING = VERDICT_CODES[GROWING]


@dataclass(frozen=True)
class _Settings:
    """What a collector is told at its start (``MetricsCollector``'s arguments)."""

    world_size: int
    total_steps: int
    log_freq: int
    flush_every: int
    series_max_ranks: int
    first_step: int | None
    kill_at_step: int | None


class MetricsCollector:
    """Assembles steps from all ranks' reports and writes them to the sinks.

    Args:
        run_dir: the run directory; metrics go to ``metrics/`` and ``tb/`` inside it. A remote URI
            (``s3://...``, see :mod:`ray_titan.storage`) is written through a local staging
            directory that is uploaded at every flush and at the end.
        world_size: number of ranks that report every step (an elastic run's largest; each
            report names its own worker group's size).
        last_stage_ranks: global ranks holding the last pipeline stage, or for an elastic run
            ``{world size: those ranks}`` for every worker count it may run on.
        total_steps: steps of the run (for the console line).
        log_freq: console line every this many steps.
        flush_every_steps: Parquet part and TensorBoard flush every this many assembled steps.
        enable_tensorboard: write TensorBoard event files.
        leak: settings of the memory verdict, keyword arguments of
            :class:`~ray_titan.metrics.collector.leak.LeakMonitor` (default: its defaults in ``[memory]``).
        on_leak: ``"warn"`` or ``"stop"`` (:class:`~ray_titan.metrics.collector.leak_policy.LeakPolicy`).
        kill_at_step: fault injection (``debug.kill_collector_at_step``): SIGKILL this actor when
            it assembles that step, in its first life only.
        nice: lower this process's CPU priority by this much (``os.nice``) first; for the Ray
            actor (``metrics.collector_nice``), not for a collector inside a worker.
        wandb: :class:`~ray_titan.metrics.collector.sinks.wandb.WandbSink`'s arguments
            (``wandb_settings``) to also log every step to Weights & Biases; None: no W&B.
        series_max_ranks: ``metrics.series_max_ranks``: TensorBoard and W&B get every rank's
            memory series (and every expert's share of its MoE layer's load) up to this many
            ranks; beyond, per-stage and overall summaries
            (:func:`~ray_titan.metrics.collector.sinks.scalars.memory_summary_scalars`), the
            ``growing`` ranks' own series and each MoE layer's max / mean load.
        first_step: the run's first step (1 for a run that does not resume from a checkpoint):
            the completeness check counts steps missing from there, not only from the first one
            recorded; None: unknown (from the first recorded).
    """

    VERDICT_RANKS = 256
    """Theil–Sen slopes refitted per step at most: a larger job's ranks each get theirs every
    ``ceil(ranks / this)`` steps, in turn (:meth:`LeakMonitor.update_many`'s ``every``), so the
    verdict costs about the same at every step; the verdict itself is exact at every step."""

    def __init__(
        self,
        run_dir: str,
        world_size: int,
        last_stage_ranks: list[int] | dict[int, list[int]],
        total_steps: int,
        log_freq: int = 10,
        flush_every_steps: int = 20,
        enable_tensorboard: bool = True,
        leak: dict[str, Any] | None = None,
        on_leak: str = "warn",
        kill_at_step: int | None = None,
        nice: int = 0,
        wandb: dict[str, Any] | None = None,
        series_max_ranks: int = 64,
        first_step: int | None = None,
    ):
        if nice:
            os.nice(nice)
        self.mirror = None
        if storage.is_remote(run_dir):
            self.mirror = storage.Mirror(storage.staging_dir(run_dir), run_dir)
            run_dir = str(self.mirror.local_dir)
        self.run_dir = Path(run_dir)
        self.settings = _Settings(world_size, total_steps, log_freq, flush_every_steps, series_max_ranks, first_step,
                                  kill_at_step)
        self.last_stage = LastStage({n: sorted(r) for n, r in last_stage_ranks.items()} if isinstance(
            last_stage_ranks, dict) else {world_size: sorted(last_stage_ranks)}, world_size)
        # Parquet apart from the others: whether its flush worked decides what is durable.
        self.parquet = ParquetSink(self.run_dir / "metrics")
        scalar_sinks: list[Sink] = [TensorBoardSink(self.run_dir / "tb")] if enable_tensorboard else []
        scalar_sinks += [WandbSink(self.run_dir, **wandb)] if wandb else []
        self.sinks = SinkSet(scalar_sinks, on_give_up=self._write_failed)
        self.errors = ErrorLog(self.run_dir / "metrics" / ERRORS_FILE)
        self.breakdowns = BreakdownLog(self.run_dir)
        self.durable = DurableSteps()
        self.intake = Intake(world_size, self.durable)
        self.leak = LeakMonitor(**(leak or leak_settings()))
        self.leak_policy = LeakPolicy(on_leak)
        self.stop_reason: str | None = None
        self.tally = Tally(total_steps)
        self.incarnation = uuid.uuid4().hex
        self.restarted = resume.reconstructed()
        self.console = Console(self.restarted)
        self._since_flush = 0
        self._write_failing = False  # the last Parquet flush failed (a full disk)
        self._end: tuple[str, Completeness] | None = None  # finish(): the steps' path, what the check found
        self._resume()

    # -- worker-facing -------------------------------------------------------------------------
    def report(self, batch: list[dict[str, Any]] | dict[str, Any], dropped: int = 0,
               flush: bool = False) -> dict[str, Any]:
        """Accept a batch of step reports: a list of ``StepReport.to_dict()`` from one rank, or a
        group's reports in columns (:func:`~ray_titan.metrics.packing.pack_reports`, from a
        :class:`~ray_titan.metrics.collector.aggregator.MetricsAggregator`, whose own dropped
        reports are ``dropped``); ``flush`` writes what is assembled to disk now.

        Returns ``{"incarnation": id of this collector life, "durable": {attempt_start_time:
        step}, "stop": reason or None}``: every step up to ``step`` of that attempt is on disk;
        ``stop`` is set once the run must stop (the leak policy under ``on_leak = "stop"``);
        ``write_failing``: the last flush failed, so rows wait in memory for room on disk.
        """
        packed: dict[str, Any] | None
        if isinstance(batch, dict):
            packed = batch
            if dropped:  # the aggregator's own count so far
                self.intake.aggregator_dropped[packed.get("sender", "")] = dropped
        else:
            packed = pack_reports(batch, dropped) if batch else None
        if packed is not None and len(packed["objects"]):
            for _, step in self.intake.accept(packed):
                self._worker_group_restarted(step)
        for step, parts in self.intake.complete():
            self._assemble(step, parts)
        if flush:
            self.flush()
        return {"incarnation": self.incarnation, "durable": self.durable.watermarks, "stop": self.stop_reason,
                "write_failing": self._write_failing}

    def stop_run(self, reason: str) -> None:
        """A worker ended the run on purpose (a non-finite loss under ``on_nonfinite = "stop"``):
        recorded, and returned by :meth:`finish` as ``stop_reason`` for the driver to raise."""
        self.errors.add(f"{_STOPPED}{reason}")

    # -- driver-facing -------------------------------------------------------------------------
    def drain_lines(self, shown_step: int = 0) -> list[str]:
        """Console lines produced since the last call. ``shown_step``: the newest step the
        caller has shown; a collector restarted by Ray re-assembles the steps its previous life
        had not flushed, and their lines (and verdict messages) were shown then, so they are
        dropped."""
        return self.console.drain(shown_step)

    def poll(self, shown_step: int = 0) -> dict[str, Any]:
        """``{"lines": drain_lines(shown_step), "latest": the newest assembled step's progress}``
        (see :mod:`ray_titan.driver.progress`), one call per driver refresh."""
        return {"lines": self.drain_lines(shown_step), "latest": self.tally.latest}

    def finish(self, shown_step: int = 0) -> dict[str, Any]:
        """Record incomplete steps as errors, flush and close the sinks, and summarise
        (``shown_step``: as for :meth:`drain_lines`).

        Returns ``{"steps": n, "last_step", "final_loss", "errors": [...], "lines": [...],
        "steps_path", "skipped_steps", "steps_run", "restarts", "memory_verdicts", "memory_breakdown"}``
        (``steps_run``: the distinct steps in the table, each one optimizer update;
        ``skipped_steps``: those whose update was dropped, by their newest attempt; ``restarts``:
        worker-group restarts seen in the table; ``memory_breakdown``: ``{rank: breakdown}``).
        Idempotent.
        """
        if self._end is None:
            self._end = self._close()
        steps_path, found = self._end
        errors = self.errors.messages
        return {
            "steps": self.tally.assembled,
            "last_step": self.tally.last_step,
            "final_loss": self.tally.final_loss,
            "errors": list(errors),
            "lines": self.drain_lines(shown_step),
            "latest": self.tally.latest,
            "steps_path": steps_path,
            "memory_verdicts": self.leak.summary(),
            "memory_breakdown": dict(sorted(self.breakdowns.by_rank.items())),
            "stop": self.stop_reason,
            "skipped_steps": found.skipped_steps,
            "steps_run": found.steps_run,
            "restarts": found.restarts,
            "collector_restarted": self.restarted,
            "stop_reason": next((e[len(_STOPPED):] for e in errors if e.startswith(_STOPPED)), None),
        }

    def flush(self) -> None:
        """Write a Parquet part of the assembled rows and flush TensorBoard. A write error (a
        full disk) is recorded once, naming the file and the cause; the rows stay in memory and
        the next flush tries again, so nothing that fits on disk later is lost."""
        self._since_flush = 0
        try:
            self.parquet.flush()
        except OSError as e:
            self._write_failing = True
            self._write_failed(e.strerror or str(e))
            return  # nothing new is durable: the workers keep (and resend) these reports
        self._write_failing = False
        self.sinks.flush()
        self.durable.flushed()
        self._sync("after a flush")

    # -- internals -----------------------------------------------------------------------------
    def _close(self) -> tuple[str, Completeness]:
        """The end of the run: the steps never completed and the reports dropped as errors,
        ``steps.parquet`` consolidated and checked, the sinks closed, what failed to be written
        written again, the staged copy uploaded."""
        for error in self.intake.close():
            self.errors.add(error)
        found = Completeness()
        steps_path: Path
        try:
            self.parquet.close()
            steps_path = self.parquet.steps_path  # type: ignore[assignment]
            s = self.settings
            found = check_complete(steps_path, s.world_size, s.first_step)
            for error in found.errors():
                self.errors.add(error)
        except OSError as e:  # the flushed parts stay readable (read_steps)
            lost = self.parquet.unflushed_steps()
            self._write_failed(e.strerror or str(e))
            if lost:
                self.errors.add(f"metrics of steps {lost[0]}..{lost[-1]} could not be written; the steps "
                                f"flushed before are in {self.parquet.parts}")
            steps_path = self.parquet.parts
        self.sinks.close()
        self.breakdowns.rewrite()
        self.errors.rewrite()
        self._sync("at the end")
        return str(steps_path), found

    def _resume(self) -> None:
        """After a restart by Ray: what the previous life flushed is on disk; carry on from it."""
        self.breakdowns.resume()
        self.errors.resume()
        flushed = resume.read_flushed(self.parquet.parts)
        if flushed is None:
            return
        self.intake.newest_attempt = self.durable.restore(flushed.attempts, flushed.steps)
        self.tally.restore(flushed.assembled, flushed.last_step, flushed.final_loss)
        self.console.add(None, f"ray_titan: metrics collector restarted; {self.tally.assembled} steps were on disk "
                               f"(up to step {self.tally.last_step})")
        resume.replay_verdicts(self.leak, flushed.rows)
        # Events after the last flush may be torn or partial: the resent reports redo them.
        self.sinks.replay_from(self.tally.last_step + 1)

    def _worker_group_restarted(self, step: int) -> None:
        """A worker group restarted at ``step``: replayed steps replace the old ones in TensorBoard."""
        self.console.add(None, f"ray_titan: worker group restarted; resuming at step {step}")
        if step <= self.tally.last_step:
            self.sinks.replay_from(step)

    def _assemble(self, step: int, parts: list[dict[str, Any]]) -> None:
        """A step whose every rank has reported, in columns: the step's figures, each rank's
        verdict and what the leak policy makes of it, one Parquet row per rank, the sinks'
        scalars and the console lines."""
        reports = newest_reports(parts)
        c, objects = reports.columns, reports.objects
        ranks = c.int("rank")
        n, size = len(ranks), group_size(c, self.settings.world_size)
        summary = step_summary(step, c, objects, self.last_stage.mask(size, ranks))
        for error in summary.errors:
            self.errors.add(error)
        figures = summary.figures
        load = self._moe_figures(reports, figures, summary.last, summary.counted)
        for o in objects:
            if o[BREAKDOWN] and (failure := self.breakdowns.add(o[BREAKDOWN])):
                self._write_failed(failure)
        attempt = float(c.get("attempt_start_time")[0])
        coords = self._new_coords(c, ranks, reports.axes, attempt)
        mem = {k: c.get(k) for k in MEMORY_FIELDS}
        code, slope, oom, changes = self.leak.update_many(step, ranks, mem, every=max(1, -(-n // self.VERDICT_RANKS)))
        table = StepColumns(c.values, c.nulls, objects, reports.moe, figures, code, slope, oom, size)
        ray_metrics.export_step(self.run_dir.name, step, figures, c.int("pp"), ranks, mem)  # Prometheus / Grafana
        stop = self.leak_policy.decide(step, changes) if self.stop_reason is None else None
        if stop is not None:
            self.stop_reason = leak_stop_reason(stop.step, stop.rank, stop.verdict, self.leak)
        messages = verdict_messages(step, changes, self.leak, stopping=None if stop is None else stop.rank)
        small = n <= max(CONSOLE_RANKS, self.settings.series_max_ranks)
        rows = rank_rows(c, code, slope, np.arange(n) if small else np.nonzero(code == _GROWING)[0])
        record = StepRecord(step, table, figures, c, code, rows, load, per_rank=n <= self.settings.series_max_ranks,
                            texts=[("memory/verdict", m) for m in messages])
        self.parquet.log(record)
        if self.sinks:
            if coords is not None:  # what ``rank{r}`` in the tags is
                record.mesh = "\n".join(f"- {describe_coords(r, co)}" for r, co in zip(ranks.tolist(), coords))
            self.sinks.log(record)
        self._console_lines(step, figures, rows, c, code, messages)
        # Where each worker group runs, once per attempt (reports that name their node).
        if objects[0][NODE] and attempt not in self.console.layouts_shown and coords is not None:
            self.console.layouts_shown.add(attempt)
            self.console.add(step, layout_line(ranks, [o[NODE] for o in objects], coords))
        self._step_done(step, attempt, figures, c)

    def _moe_figures(self, reports: StepReports, figures: dict[str, Any], last: np.ndarray,
                     counted: np.ndarray) -> dict[int, list[int]]:
        """The step's expert load per MoE layer (over the counted ranks), with its balance loss
        (``moe/aux_loss``) and imbalance (``moe_imbalance``) added to ``figures``."""
        c, moe = reports.columns, reports.moe
        load = (expert_load_of_blocks(moe[0][counted], moe[1][counted]) if moe is not None
                else expert_load_of_objects([reports.objects[i] for i in np.nonzero(counted)[0].tolist()]))
        aux = c.get("aux_loss")[counted & ~c.null("aux_loss")]
        # Each DP replica's layers sum to its balance loss; average the replicas.
        figures["moe/aux_loss"] = float(aux.sum() / max(1, int(last.sum()))) if len(aux) else None
        figures["moe_imbalance"] = max(
            (max(x) * len(x) / sum(x) for x in load.values() if sum(x)), default=None
        )
        return load

    def _console_lines(self, step: int, figures: dict[str, Any], rows: list[dict[str, Any]], c: Columns,
                       code: np.ndarray, messages: list[str]) -> None:
        """The step's console line when one is due (the first, every ``log_freq``-th, the last and
        any step that evaluated), then its verdict messages."""
        s = self.settings
        if step % s.log_freq == 0 or step == s.total_steps or step == 1 or figures["val/loss"] is not None:
            line = (format_step_line(step, s.total_steps, figures, rows) if len(code) <= CONSOLE_RANKS
                    else format_scale_line(step, s.total_steps, figures, c, code))
            self.console.add(step, line)
        for m in messages:
            self.console.add(step, m)

    def _new_coords(self, c: Columns, ranks: np.ndarray, axes: tuple[str, ...],
                    attempt: float) -> list[dict[str, int]] | None:
        """Each rank's mesh coordinates when the verdicts or the layout line need them (new ranks,
        a new attempt), else None: building them per rank is the cost worth skipping per step."""
        if len(self.leak.coords) >= len(ranks) and attempt in self.console.layouts_shown:
            return None
        coords = ([dict(zip(axes, map(int, row))) for row in np.column_stack([c.get(a) for a in axes]).tolist()]
                  if axes else [{} for _ in range(len(ranks))])
        self.leak.coords.update(zip(ranks.tolist(), coords))
        return coords

    def _step_done(self, step: int, attempt: float, figures: dict[str, Any], c: Columns) -> None:
        """Bookkeeping after a step is assembled: the run's progress, what is unflushed, a flush
        every ``flush_every_steps`` steps, and the injected collector kill."""
        self.tally.record(step, figures, c)
        self.durable.assembled(step, attempt)
        self._since_flush += 1
        if self._since_flush >= self.settings.flush_every:
            self.flush()
        if step == self.settings.kill_at_step and not self.restarted:
            os.kill(os.getpid(), signal.SIGKILL)

    def _write_failed(self, message: str) -> None:
        """Record a failed write once per message (a full disk fails every flush alike), and say it."""
        if self.errors.write_failed(message):
            self.console.add(None, f"ray_titan: metrics: {message}")

    def _sync(self, when: str) -> None:
        if self.mirror is None:
            return
        try:
            self.mirror.sync()
        except Exception as e:  # the staged copy is complete; the next sync retries
            self.errors.add(f"upload of metrics to {self.mirror.destination} failed {when}: {e}")
