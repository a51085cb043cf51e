"""The metrics collector: one place that sees every rank at every step.

Used as a Ray actor (``ray.remote(MetricsCollector).options(num_cpus=0)``, owned by the driver)
or as a plain object in-process. Workers call :meth:`MetricsCollector.report` with batches of
step reports; when every rank has reported a step, the collector assembles it:

- loss: the token-weighted mean of the losses of the ranks that hold the last pipeline stage
  (given by the stage-to-rank mapping, ``last_stage_ranks``; weighted by their counted labels,
  ``loss_tokens``, under loss masks), and their max, each data-parallel rank counted once: the tp
  ranks of one tensor-parallel group hold the same loss and the same tokens, so only the one at
  ``tp = 0`` is counted (:func:`counted_rows`). A last-stage rank
  without a loss, or a non-last-stage rank with one, is recorded as an error, not filled in.
- tokens/s: tokens of the step (summed over the last stage's DP ranks) over the slowest rank's
  step time.
- one row per rank (timings, memory, GC pause) to Parquet, scalars to TensorBoard, and a console
  line at the first step, every ``log_freq`` steps and at the last step, which the driver drains
  and prints.
- each rank's measured memory breakdown (``memory.breakdown_step``), kept in
  ``metrics/memory_breakdown.jsonl`` as it arrives and returned by :meth:`MetricsCollector.finish`.
- a memory verdict per rank (``ray_titan.metrics.leak``: warming_up / stable / growing, MiB per
  step, projected OOM step) in every row and in TensorBoard, and a console line whenever a rank's
  verdict changes. With ``on_leak = "stop"`` a ``growing`` verdict sets :attr:`stop_reason`,
  which every later :meth:`MetricsCollector.report` call returns to the workers.

Fault tolerance. Every report carries its worker group's ``attempt_start_time``: after a worker
group restart, the replayed steps' reports supersede the lost attempt's (pending ones are
dropped, assembled rows are replaced when the table is consolidated). :meth:`report` answers
with the collector's incarnation and, per attempt, the step up to which rows are on disk; workers
hold their reports until then and resend them to a restarted collector. A collector restarted by
Ray (``max_restarts``) resumes from its flushed parts: it knows which steps are on disk and
ignores their resent reports.
"""

from __future__ import annotations

import json
import math
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute

from ray_titan import storage
from ray_titan.metrics import ray_metrics
from ray_titan.metrics.leak import GROWING, LeakMonitor, describe_coords, leak_settings
from ray_titan.metrics.report import MEMORY_FIELDS
from ray_titan.metrics.sinks import (
    ParquetSink,
    TensorBoardSink,
    WandbSink,
    expert_load_scalars,
    latest_rows,
    read_raw_parts,
    step_scalars,
)

__all__ = [
    "BREAKDOWN_FILE", "MetricsCollector", "counted_rows", "expert_load", "format_step_line", "read_breakdowns",
    "validation_summary",
]

BREAKDOWN_FILE = "memory_breakdown.jsonl"
"""Every rank's measured memory breakdown (``memory.breakdown_step``), one JSON line each, in
``<run_dir>/metrics/``."""


def read_breakdowns(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """``{rank: breakdown}`` from ``<run_dir>/metrics/memory_breakdown.jsonl`` (the newest line of
    a rank wins: a replayed step after a restart); empty if there is none."""
    path = Path(run_dir) / "metrics" / BREAKDOWN_FILE
    out: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                b = json.loads(line)
                out[b["rank"]] = b
    return dict(sorted(out.items()))

MiB = 2**20
_STOPPED = "run stopped: "


def counted_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that speak for their data-parallel rank: under tensor parallel the ranks of one
    tp group (same coordinates but ``tp``) compute the same loss, route the same tokens and read
    the same batch, so only ``tp = 0`` is kept; without TP, every row."""
    return [r for r in rows if r["coords"].get("tp", 0) == 0]


def expert_load(rows: list[dict[str, Any]]) -> dict[int, list[int]]:
    """A step's expert load per MoE layer: tokens (× top-k) routed to each expert, summed over
    the ranks holding the layer (every data-parallel rank routes its own tokens). ``rows`` are the
    step's rows (dicts with ``moe_layers`` and ``expert_load``); empty for a dense model."""
    out: dict[int, list[int]] = {}
    for r in rows:
        for layer, counts in zip(r.get("moe_layers") or [], r.get("expert_load") or []):
            acc = out.setdefault(layer, [0] * len(counts))
            for e, c in enumerate(counts):
                acc[e] += c
    return dict(sorted(out.items()))


def validation_summary(last: list[dict[str, Any]]) -> dict[str, float | None]:
    """``{"val/loss", "val/perplexity"}`` of a step from its last-stage ranks' reports: the
    token-weighted mean of their validation losses and its exponential; None at steps without
    an evaluation."""
    with_val = [r for r in last if r.get("val_loss") is not None and r.get("val_tokens")]
    tokens = sum(r["val_tokens"] for r in with_val)
    if not tokens:
        return {"val/loss": None, "val/perplexity": None}
    loss = sum(r["val_loss"] * r["val_tokens"] for r in with_val) / tokens
    return {"val/loss": loss, "val/perplexity": math.exp(min(loss, 700.0))}


def format_step_line(step: int, total: int, s: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The console line of a step: loss of the last stage, throughput, times, and every rank's
    memory (host RSS, and device allocated / peak reserved where there is a device)."""
    loss = "loss     n/a" if s["loss"] is None else f"loss {s['loss']:8.4f}"
    mem = " ".join(f"r{r['rank']}:{r['host_rss_bytes'] / MiB:.0f}" for r in rows)
    line = (
        f"step {step:>{len(str(total))}}/{total} | {loss} | {s['tokens_per_s']:9.0f} tok/s | "
        f"step {s['step_time_s']:.3f}s | lr {s['lr']:.2e} | gnorm {s['grad_norm']:.3f} | "
        f"rss MiB {mem}"
    )
    if s.get("moe_imbalance") is not None:
        line += f" | moe load max/mean {s['moe_imbalance']:.2f}"
    if s.get("val/loss") is not None:
        line += f" | val loss {s['val/loss']:.4f} (ppl {s['val/perplexity']:.2f})"
    if s.get("skipped"):
        line += " | update skipped (non-finite)"
    if rows[0].get("device_allocated_bytes") is not None:
        dev = " ".join(
            f"r{r['rank']}:{r['device_allocated_bytes'] / MiB:.0f}/{r['device_peak_reserved_bytes'] / MiB:.0f}"
            for r in rows
        )
        line += f" | dev alloc/peak MiB {dev}"
    return line


def _max_memory(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rank with the most memory: device peak reserved where there is a device, else host RSS."""
    if rows[0].get("device_peak_reserved_bytes") is not None:
        key, kind = "device_peak_reserved_bytes", "dev peak"
    else:
        key, kind = "host_rss_bytes", "rss"
    best = max((r for r in rows if r.get(key) is not None), key=lambda r: r[key], default=None)
    return None if best is None else {"rank": best["rank"], "bytes": best[key], "kind": kind}


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
            :class:`~ray_titan.metrics.leak.LeakMonitor` (default: its defaults in ``[memory]``).
        on_leak: ``"warn"`` or ``"stop"`` (see the module docstring).
        kill_at_step: fault injection (``debug.kill_collector_at_step``): SIGKILL this actor when
            it assembles that step, in its first life only.
        nice: lower this process's CPU priority by this much (``os.nice``) first; for the Ray
            actor (``metrics.collector_nice``), not for a collector inside a worker.
        wandb: :class:`~ray_titan.metrics.sinks.WandbSink`'s arguments (``wandb_settings``) to
            also log every step to Weights & Biases; None: no W&B.
    """

    MAX_ERRORS = 1000

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
    ):
        if nice:
            os.nice(nice)
        self.mirror = None
        if storage.is_remote(run_dir):
            self.mirror = storage.Mirror(storage.staging_dir(run_dir), run_dir)
            run_dir = str(self.mirror.local_dir)
        self.run_dir = Path(run_dir)
        self.last_by_size = ({n: sorted(r) for n, r in last_stage_ranks.items()} if isinstance(last_stage_ranks, dict)
                             else {world_size: sorted(last_stage_ranks)})
        self.world_size, self.last = world_size, self.last_by_size[world_size]
        self._layout_shown: set[float] = set()
        self.total_steps, self.log_freq, self.flush_every = total_steps, log_freq, flush_every_steps
        self.parquet = ParquetSink(self.run_dir / "metrics")
        self.tb = TensorBoardSink(self.run_dir / "tb") if enable_tensorboard else None
        self.wandb = WandbSink(self.run_dir, **wandb) if wandb else None
        self._pending: dict[int, dict[int, dict[str, Any]]] = {}
        self._lines: list[tuple[int | None, str]] = []  # (step it belongs to, text)
        self.errors: list[str] = []
        self.errors_total = 0
        self.assembled = 0
        self.last_step = 0
        self.final_loss: float | None = None
        self.latest: dict[str, Any] | None = None
        self.dropped: dict[int, int] = {}
        self._since_flush = 0
        self._closed = False
        self._mesh_written = False
        self.leak = LeakMonitor(**(leak or leak_settings()))
        self.on_leak = on_leak
        self.stop_reason: str | None = None

        self.incarnation = uuid.uuid4().hex
        self.kill_at_step = kill_at_step
        self._pending_attempt: dict[int, float] = {}  # step -> attempt of its pending reports
        self._done: dict[int, float] = {}  # step -> newest attempt assembled for it
        self._unflushed: list[tuple[float, int]] = []
        self._flushed: dict[float, set[int]] = {}
        self._durable: dict[float, int] = {}  # attempt -> every step from _first[attempt] to this is on disk
        self._first: dict[float, int] = {}
        self._errors_path = self.run_dir / "metrics" / "errors.jsonl"
        self._write_errors: set[str] = set()
        self._errors_unwritten = False
        self._breakdowns_unwritten = False
        self._write_failing = False  # the last Parquet flush failed (a full disk)
        self._breakdown_path = self.run_dir / "metrics" / BREAKDOWN_FILE
        self.breakdowns: dict[int, dict[str, Any]] = {}
        self.restarted = _reconstructed()
        self._newest_attempt = float("-inf")
        self._resume()

    # -- worker-facing -------------------------------------------------------------------------
    def report(self, batch: list[dict[str, Any]], dropped: int = 0, flush: bool = False) -> dict[str, Any]:
        """Accept a batch of step reports (``StepReport.to_dict()``) from one rank; ``flush``
        writes what is assembled to disk now.

        Returns ``{"incarnation": id of this collector life, "durable": {attempt_start_time:
        step}, "stop": reason or None}``: every step up to ``step`` of that attempt is on disk;
        ``stop`` is set once the run must stop (the memory verdict under ``on_leak = "stop"``);
        ``write_failing``: the last flush failed, so rows wait in memory for room on disk.
        """
        for rep in batch:
            step, attempt = rep["step"], rep.get("attempt_start_time", 0.0)
            if attempt > self._newest_attempt:
                self._new_attempt(attempt, step)
            if self._assembled_by(step) >= attempt:
                continue  # a resent or superseded report of a step already assembled
            if self._pending_attempt.get(step, attempt) < attempt:
                self._pending.pop(step, None)  # a restarted worker group replays this step
            elif self._pending_attempt.get(step, attempt) > attempt:
                continue
            self._pending_attempt[step] = attempt
            self._pending.setdefault(step, {})[rep["rank"]] = rep
            if dropped:
                self.dropped[rep["rank"]] = dropped
        for step in sorted(s for s, reps in self._pending.items() if len(reps) == self._size(reps)):
            self._pending_attempt.pop(step)
            self._assemble(step, self._pending.pop(step))
        if flush:
            self.flush()
        return {"incarnation": self.incarnation, "durable": dict(self._durable), "stop": self.stop_reason,
                "write_failing": self._write_failing}

    def stop_run(self, reason: str) -> None:
        """A worker ended the run on purpose (a non-finite loss under ``on_nonfinite = "stop"``):
        recorded, and returned by :meth:`finish` as ``stop_reason`` for the driver to raise."""
        self._error(f"{_STOPPED}{reason}")

    # -- driver-facing -------------------------------------------------------------------------
    def drain_lines(self, shown_step: int = 0) -> list[str]:
        """Console lines produced since the last call. ``shown_step``: the newest step the
        caller has shown; a collector restarted by Ray re-assembles the steps its previous life
        had not flushed, and their lines (and verdict messages) were shown then, so they are
        dropped."""
        lines, self._lines = self._lines, []
        hide = shown_step if self.restarted else 0
        return [text for step, text in lines if step is None or step > hide]

    def poll(self, shown_step: int = 0) -> dict[str, Any]:
        """``{"lines": drain_lines(shown_step), "latest": the newest assembled step's progress}``
        (see :mod:`ray_titan.progress`), one call per driver refresh."""
        return {"lines": self.drain_lines(shown_step), "latest": self.latest}

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
        if not self._closed:
            for step in sorted(self._pending):
                missing = sorted(set(range(self._size(self._pending[step]))) - set(self._pending[step]))
                self._error(f"step {step}: no report from rank(s) {missing}")
            self._pending.clear()
            for rank, n in sorted(self.dropped.items()):
                self._error(f"rank {rank} dropped {n} report(s): the collector was too slow")
            self._skipped_steps = self._restarts = self._steps_run = 0
            try:
                steps_path: Path = self.parquet.close()
                self._check_complete(steps_path)
            except OSError as e:  # the flushed parts stay readable (read_steps)
                lost = sorted({r["step"] for r in self.parquet._rows})
                self._write_failed(e.strerror or str(e))
                if lost:
                    self._error(f"metrics of steps {lost[0]}..{lost[-1]} could not be written; the steps "
                                f"flushed before are in {self.parquet.parts}")
                steps_path = self.parquet.parts
            if self.tb:
                self._tensorboard(self.tb.close)
            if self.wandb:
                self.wandb.close()
            if self._breakdowns_unwritten:
                try:
                    self._breakdown_path.write_text(
                        "".join(json.dumps(b) + "\n" for b in self.breakdowns.values()), encoding="utf-8")
                except OSError:
                    pass
            if self._errors_unwritten:
                try:
                    self._errors_path.write_text("".join(json.dumps(e) + "\n" for e in self.errors), encoding="utf-8")
                except OSError:
                    pass
            self._sync("at the end")
            self._closed = True
            self._steps_path = str(steps_path)
        return {
            "steps": self.assembled,
            "last_step": self.last_step,
            "final_loss": self.final_loss,
            "errors": list(self.errors),
            "lines": self.drain_lines(shown_step),
            "latest": self.latest,
            "steps_path": self._steps_path,
            "memory_verdicts": self.leak.summary(),
            "memory_breakdown": dict(sorted(self.breakdowns.items())),
            "stop": self.stop_reason,
            "skipped_steps": self._skipped_steps,
            "steps_run": self._steps_run,
            "restarts": self._restarts,
            "collector_restarted": self.restarted,
            "stop_reason": next((e[len(_STOPPED):] for e in self.errors if e.startswith(_STOPPED)), None),
        }

    # -- internals -----------------------------------------------------------------------------
    def _resume(self) -> None:
        """After a restart by Ray: what the previous life flushed is on disk; carry on from it."""
        raw = read_raw_parts(self.parquet.parts)
        self.breakdowns = read_breakdowns(self.run_dir)
        if self._errors_path.is_file():
            self.errors = [json.loads(line) for line in self._errors_path.read_text().splitlines()]
            self.errors_total = len(self.errors)
        if raw.num_rows == 0:
            return
        for attempt, step in zip(raw["attempt_start_time"].to_pylist(), raw["step"].to_pylist()):
            self._done[step] = max(self._done.get(step, float("-inf")), attempt)
            self._flushed.setdefault(attempt, set()).add(step)
        for attempt in self._flushed:
            self._advance_durable(attempt)
        self._newest_attempt = max(self._flushed)
        rows = latest_rows(raw)
        self.assembled = len(set(rows["step"].to_pylist()))
        self.last_step = max(rows["step"].to_pylist())
        self.final_loss = rows.filter(pa.compute.equal(rows["step"], self.last_step))["step_loss"][0].as_py()
        self._lines.append((None, f"ray_titan: metrics collector restarted; {self.assembled} steps were on disk "
                                  f"(up to step {self.last_step})"))
        # The memory verdicts carry on from the flushed rows, instead of warming up again.
        for r in rows.select(["step", "rank", "pp", "dp_shard", "ep", *MEMORY_FIELDS]).to_pylist():
            self.leak.update(r["step"], {**r, "coords": {a: r[a] for a in ("pp", "dp_shard", "ep")}})
        if self.tb:  # events after the last flush may be torn or partial: the resent reports redo them
            self.tb.close()
            self.tb = TensorBoardSink(self.run_dir / "tb", purge_step=self.last_step + 1)

    def _new_attempt(self, attempt: float, step: int) -> None:
        """A worker group (re)started at ``step``: replayed steps replace the old ones in TensorBoard."""
        if self._newest_attempt > float("-inf"):
            self._lines.append((None, f"ray_titan: worker group restarted; resuming at step {step}"))
            if self.tb and step <= self.last_step:
                self.tb.close()
                self.tb = TensorBoardSink(self.tb.tb_dir, purge_step=step)
        self._newest_attempt = attempt

    def _advance_durable(self, attempt: float) -> None:
        """Move ``attempt``'s watermark over its newly flushed steps, and forget the per-step
        records it now covers (steps ``_first[attempt] .. _durable[attempt]``), so the
        bookkeeping stays as small as the unflushed part of the run."""
        done = self._flushed[attempt]
        if attempt not in self._durable:
            self._durable[attempt] = min(done) - 1
            self._first[attempt] = min(done)
        wm = self._durable[attempt]
        while wm + 1 in done:
            wm += 1
            done.discard(wm)
            if self._done.get(wm) == attempt:
                del self._done[wm]
        self._durable[attempt] = wm

    def _assembled_by(self, step: int) -> float:
        """The newest attempt whose report of ``step`` was assembled (-inf: none)."""
        newest = self._done.get(step, float("-inf"))
        for attempt, wm in self._durable.items():
            if attempt > newest and self._first[attempt] <= step <= wm:
                newest = attempt
        return newest

    def _check_complete(self, steps_path: Path) -> None:
        """Every rank has a row at every step from the first to the last recorded."""
        import pyarrow.parquet as pq

        t = pq.read_table(steps_path, columns=["step", "rank", "skipped_update", "attempt", "world_size"])
        # One row per step and rank, the newest attempt's: a step a restart ran again counts once.
        self._skipped_steps = len({s for s, k in zip(t["step"].to_pylist(), t["skipped_update"].to_pylist()) if k})
        self._steps_run = len(set(t["step"].to_pylist()))
        self._restarts = max(t["attempt"].to_pylist(), default=0)
        if t.num_rows == 0:
            return
        have = set(zip(t["step"].to_pylist(), t["rank"].to_pylist()))
        steps = t["step"].to_pylist()
        size = {s: n or self.world_size for s, n in zip(steps, t["world_size"].to_pylist())}
        for step in range(min(steps), max(steps) + 1):
            missing = [r for r in range(size.get(step, self.world_size)) if (step, r) not in have]
            if missing:
                self._error(f"step {step}: the metrics table has no row for rank(s) {missing}")

    def _size(self, reps: dict[int, dict[str, Any]]) -> int:
        """The worker group size of a step's reports (the run's for reports that do not say)."""
        return next(iter(reps.values())).get("world_size") or self.world_size

    def _layout(self, rows: list[dict[str, Any]]) -> str:
        """``"ray_titan: layout of 4 ranks: node 1a2b3c4d: ranks 0-1 (pp=0 × dp_shard=0-1); ..."``."""
        by_node: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            by_node.setdefault(r.get("node") or "?", []).append(r)
        parts = []
        for node, rs in by_node.items():
            axes = " × ".join(f"{a}={_span(sorted({r['coords'][a] for r in rs}))}" for a in rs[0]["coords"])
            parts.append(f"node {node[:8]}: ranks {_span([r['rank'] for r in rs])} ({axes})")
        return f"ray_titan: layout of {len(rows)} ranks on {len(by_node)} node(s): " + "; ".join(parts)

    def _assemble(self, step: int, reps: dict[int, dict[str, Any]]) -> None:
        rows = [reps[r] for r in sorted(reps)]
        last_ranks = self.last_by_size.get(self._size(reps), self.last)
        last = [reps[r] for r in last_ranks if r in reps]
        for r in rows:
            if r["rank"] in last_ranks and r["loss"] is None:
                self._error(f"step {step}: last-stage rank {r['rank']} reported no loss")
            if r["rank"] not in last_ranks and r["loss"] is not None:
                self._error(f"step {step}: rank {r['rank']} is not on the last stage but reported a loss")
        last = counted_rows(last)
        with_loss = [r for r in last if r["loss"] is not None]
        weights = [r["tokens"] if r.get("loss_tokens") is None else r["loss_tokens"] for r in with_loss]
        tokens = sum(weights)
        loss = sum(r["loss"] * w for r, w in zip(with_loss, weights)) / tokens if tokens else None
        step_time = max(r["step_time_s"] for r in rows)
        summary = {
            "loss": loss,
            "loss_max": max((r["loss"] for r in with_loss), default=None),
            "tokens": sum(r["tokens"] for r in last),
            "step_time_s": step_time,
            "lr": rows[0]["lr"],
            "grad_norm": rows[0]["grad_norm"],
            "skipped": rows[0].get("skipped_update", False),
        }
        summary["tokens_per_s"] = summary["tokens"] / step_time if step_time > 0 else 0.0
        summary.update(validation_summary(last))
        mixed = [r["source_tokens"] for r in last if r.get("source_tokens")]  # one per data-parallel group
        summary["source_tokens"] = [sum(c) for c in zip(*mixed)] if mixed else None
        load = expert_load(counted_rows(rows))
        aux = [r["aux_loss"] for r in counted_rows(rows) if r.get("aux_loss") is not None]
        # Each DP replica's layers sum to its balance loss; average the replicas.
        summary["moe/aux_loss"] = sum(aux) / max(1, len(last)) if aux else None
        summary["moe_imbalance"] = max(
            (max(c) * len(c) / sum(c) for c in load.values() if sum(c)), default=None
        )
        for r in rows:
            if r.get("memory_breakdown"):
                self._breakdown(r["memory_breakdown"])
        flat = [self._row(r, summary) for r in rows]
        changes = [self._verdict(step, r, row) for r, row in zip(rows, flat)]
        self.parquet.add(flat)
        ray_metrics.export_step(self.run_dir.name, step, summary, flat)  # Prometheus / Grafana (no-op without Ray)
        scalars = {k: summary[k] for k in ("loss", "loss_max", "tokens_per_s", "lr", "grad_norm", "step_time_s",
                                           "moe/aux_loss", "val/loss", "val/perplexity")}
        if self.wandb:
            self.wandb.log(step, step_scalars(scalars, flat) + expert_load_scalars(load))
        if self.tb:
            self._tensorboard(self.tb.add_step, step, scalars, flat)
            if load and self.tb:
                self._tensorboard(self.tb.add_expert_load, step, load)
            if not self._mesh_written and self.tb:  # what ``rank{r}`` in the tags is on the mesh
                self._tensorboard(self.tb.add_text, "mesh/ranks", "\n".join(
                    f"- {describe_coords(r['rank'], r['coords'])}" for r in rows), step)
                self._mesh_written = True
            for message in filter(None, changes):
                if self.tb:
                    self._tensorboard(self.tb.add_text, "memory/verdict", message, step)
        if step % self.log_freq == 0 or step == self.total_steps or step == 1 or summary["val/loss"] is not None:
            self._lines.append((step, format_step_line(step, self.total_steps, summary, flat)))
        self._lines += [(step, c) for c in changes if c]
        # Where each worker group runs, once per attempt (reports that name their node).
        if rows[0].get("node") and rows[0].get("attempt_start_time", 0.0) not in self._layout_shown:
            self._layout_shown.add(rows[0].get("attempt_start_time", 0.0))
            self._lines.append((step, self._layout(rows)))
        self.assembled += 1
        if step >= self.last_step:  # the newest step's loss, None (and an error) if it had none
            self.last_step, self.final_loss = step, loss
            self.latest = {"step": step, "total": self.total_steps, "loss": loss,
                           "tokens_per_s": summary["tokens_per_s"], "max_memory": _max_memory(flat)}
        attempt = rows[0].get("attempt_start_time", 0.0)
        self._done[step] = attempt
        self._unflushed.append((attempt, step))
        self._since_flush += 1
        if self._since_flush >= self.flush_every:
            self.flush()
        if step == self.kill_at_step:
            if not self.restarted:
                os.kill(os.getpid(), signal.SIGKILL)

    def _verdict(self, step: int, rep: dict[str, Any], row: dict[str, Any]) -> str | None:
        """Put the rank's memory verdict into its row; the console message if it changed."""
        v, message = self.leak.update(step, {**rep["memory"], "rank": rep["rank"], "coords": rep["coords"]})
        row.update(memory_verdict=v.verdict, memory_slope_mib_per_step=v.slope_mib_per_step,
                   memory_oom_step=v.oom_step)
        if v.verdict == GROWING and self.on_leak == "stop" and self.stop_reason is None:
            self.stop_reason = (
                f"{self.leak.describe(rep['rank'])}: memory {self.leak.format(v)} since step {step}; "
                "memory.on_leak = 'stop' ended the run"
            )
            message = (f"memory: {self.leak.describe(rep['rank'])} {self.leak.format(v)} at step {step}; "
                       "memory.on_leak = 'stop' ends the run")
        return message

    def _breakdown(self, breakdown: dict[str, Any]) -> None:
        """Keep a rank's measured memory breakdown, on disk at once (it survives a restart). A
        full disk must not cost the step its row: the failure is recorded and the breakdowns are
        written again at the end."""
        self.breakdowns[breakdown["rank"]] = breakdown
        try:
            with open(self._breakdown_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(breakdown) + "\n")
        except OSError as e:
            self._breakdowns_unwritten = True
            self._write_failed(f"memory breakdown {self._breakdown_path}: {e.strerror or e}")

    def _error(self, message: str) -> None:
        # Bounded: a systematic error would otherwise add one message per step.
        self.errors_total += 1
        if len(self.errors) > self.MAX_ERRORS:
            return
        if len(self.errors) == self.MAX_ERRORS:
            message = "... further errors are counted in errors_total only"
        self.errors.append(message)
        try:
            with open(self._errors_path, "a", encoding="utf-8") as f:  # survives a collector restart
                f.write(json.dumps(message) + "\n")
        except OSError:  # a full disk: written again at the end, and the driver gets it in finish()
            self._errors_unwritten = True

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
        if self.tb:
            self._tensorboard(self.tb.flush)
        for attempt, step in self._unflushed:
            self._flushed.setdefault(attempt, set()).add(step)
        for attempt in {a for a, _ in self._unflushed}:
            self._advance_durable(attempt)
        self._unflushed = []
        self._sync("after a flush")

    def _write_failed(self, message: str) -> None:
        """Record a failed write once per message (a full disk fails every flush alike)."""
        if message not in self._write_errors:
            self._write_errors.add(message)
            self._error(f"metrics: {message}")
            self._lines.append((None, f"ray_titan: metrics: {message}"))

    def _tensorboard(self, write, *args: Any) -> None:
        """A TensorBoard write; on an error TensorBoard is given up for this life of the
        collector (the Parquet rows hold the same figures) and the error recorded."""
        try:
            write(*args)
        except OSError as e:
            self._write_failed(f"TensorBoard events in {self.run_dir / 'tb'}: {e}; TensorBoard stops here")
            tb, self.tb = self.tb, None
            try:
                tb.close()  # type: ignore[union-attr]
            except OSError:
                pass

    def _sync(self, when: str) -> None:
        if self.mirror is None:
            return
        try:
            self.mirror.sync()
        except Exception as e:  # the staged copy is complete; the next sync retries
            self._error(f"upload of metrics to {self.mirror.destination} failed {when}: {e}")

    @staticmethod
    def _row(r: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
        row = {k: r[k] for k in ("step", "rank", "is_last_stage", "loss", "tokens", "step_time_s",
                                  "data_time_s", "fwd_bwd_time_s", "optim_time_s", "grad_norm",
                                  "lr", "gc_pause_s", "time")}
        row.update({axis: r["coords"].get(axis, 0) for axis in ("pp", "dp_replicate", "dp_shard", "tp", "ep")})
        row.update(aux_loss=r.get("aux_loss"), moe_layers=r.get("moe_layers") or [],
                   expert_load=r.get("expert_load") or [])
        row["gc_generation"] = r.get("gc_generation")
        row["metrics_time_s"] = r.get("metrics_time_s")
        row["loss_tokens"] = r.get("loss_tokens")
        row.update(source_tokens=r.get("source_tokens"), step_source_tokens=s["source_tokens"])
        row.update(val_loss=r.get("val_loss"), val_tokens=r.get("val_tokens"), val_time_s=r.get("val_time_s"),
                   step_val_loss=s["val/loss"])
        row.update(node=r.get("node") or None, world_size=r.get("world_size") or None)
        row.update(skipped_update=r.get("skipped_update", False), attempt=0,
                   attempt_start_time=r.get("attempt_start_time", 0.0), pid=r.get("pid"))
        row.update({k: r["memory"].get(k) for k in MEMORY_FIELDS})
        row.update(step_loss=s["loss"], step_loss_max=s["loss_max"], step_tokens=s["tokens"],
                   step_tokens_per_s=s["tokens_per_s"])
        return row


def _span(values: list[int]) -> str:
    """``[0, 1, 2]`` → ``"0-2"``; ``[3]`` → ``"3"``; ``[0, 2]`` → ``"0,2"``."""
    if len(values) > 1 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def _reconstructed() -> bool:
    """Whether this is a Ray actor restarted after its process died (False outside Ray)."""
    try:
        import ray

        return ray.is_initialized() and bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # not in an actor
        return False
