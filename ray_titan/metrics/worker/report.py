"""The worker side of metrics: :class:`StepReport` and the reporters that deliver it.

A report holds host scalars only, never tensors (docs/design.md, Contracts). :class:`CollectorReporter`
sends to the collector actor without waiting and is bounded: at most ``max_inflight`` calls in
flight and at most ``max_buffered`` reports held until the collector has them on disk, so a slow,
stuck or restarting collector can neither stall nor grow a worker, and a killed one loses
nothing (the held reports are resent to its next life, and saved in each checkpoint).
:class:`LocalReporter` hands reports to an in-process collector, for the train loop run without Ray.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray_titan.metrics.outcome import MemoryLeakError
from ray_titan.metrics.packing import pack_reports

__all__ = [
    "CollectorReporter",
    "JsonlReporter",
    "LocalReporter",
    "Reporter",
    "StepReport",
    "rank_reports_path",
    "read_rank_reports",
    "reporting_target",
]


@dataclass
class StepReport:
    """What one rank says about one optimizer step. Times in seconds, memory in bytes.

    ``loss`` is the mean cross-entropy (nats per token) over this rank's tokens on ranks holding
    the last pipeline stage, and ``None`` on every other rank: never a placeholder number.
    ``tokens`` is the number of label tokens this rank's data-parallel slice held in the step.
    ``coords``: the rank's coordinates by mesh axis (``pp``, ``dp_shard``, and ``dp_replicate``,
    ``tp``, ``ep`` where the mesh has them: ``ray_titan.parallel.dims.ParallelDims.coords``);
    ``memory``: the memory sample (:data:`~ray_titan.metrics.fields.MEMORY_FIELDS`).

    What each field means, and its unit, is in :data:`ray_titan.metrics.fields.FIELDS`, the one
    table of per-rank fields; a field added here is added there too (``tests/unit/test_fields.py``
    fails otherwise). ``extra`` travels in the rank's own JSON lines only.
    """

    step: int
    rank: int
    coords: dict[str, int]
    is_last_stage: bool
    loss: float | None
    tokens: int
    step_time_s: float
    data_time_s: float
    fwd_bwd_time_s: float
    optim_time_s: float
    grad_norm: float
    lr: float
    memory: dict[str, int | None]
    gc_pause_s: float
    time: float = 0.0
    """Wall-clock time (Unix seconds) at the end of the step."""
    extra: dict[str, float] = field(default_factory=dict)
    skipped_update: bool = False
    """The update was dropped: non-finite loss or gradient norm under ``on_nonfinite = "skip"``."""
    attempt_start_time: float = 0.0
    """When this rank's worker group started (Unix seconds, the same on every rank of it)."""
    pid: int = field(default_factory=os.getpid)
    aux_loss: float | None = None
    """MoE: the load-balance loss summed over this rank's MoE layers, mean over microbatches."""
    moe_layers: list[int] = field(default_factory=list)
    """MoE: indices of the MoE layers this rank holds."""
    expert_load: list[list[int]] = field(default_factory=list)
    """MoE: per layer in ``moe_layers``, tokens (× top-k) this rank's router sent to each expert in
    the step (host ints). Summed over the ranks of a stage it is the layer's load for the step."""
    gc_generation: int | None = None
    """Generation of the synchronized GC run in this step (``ray_titan.trainer.gc_schedule``), None if none ran."""
    memory_breakdown: dict[str, Any] | None = None
    """At ``memory.breakdown_step``: this rank's memory at the step's peak by category, measured
    with the torch profiler (``ray_titan.metrics.worker.profiling.StepProfiler.stop``); else None."""
    node: str = ""
    """The node this rank runs on (Ray's node id under Ray, the host name otherwise)."""
    world_size: int = 0
    """Ranks of this rank's worker group (an elastic run's differs between attempts; 0: the run's)."""
    metrics_time_s: float | None = None
    """Seconds this rank spent in the previous step sampling memory, building its report and
    handing it to the reporter (the Ray call included when one was made): the metrics path's own
    cost, callbacks excluded. The sample falls inside that step's ``step_time_s``, the report
    after it. None at an attempt's first step."""

    loss_tokens: int | None = None
    """With loss masks (supervised fine-tuning): the labels counted in ``loss`` (its weight in the
    step's mean); None when every label of ``tokens`` counts."""
    mtp_losses: list[float] | None = None
    """Multi-token prediction: each depth's loss (host floats, depth 1 first) on a last-stage
    rank, normalised as ``loss`` (then the main loss alone); None elsewhere."""
    source_tokens: list[int] | None = None
    """With a mixture (``data.sources``): the label tokens of this rank's slice taken from each
    source, in the order of ``data.sources``."""
    val_loss: float | None = None
    """Validation loss (nats per counted token, mean over this rank's validation tokens) at the
    steps that evaluated (``[validation]``), on last-stage ranks; None otherwise."""
    val_tokens: int | None = None
    """Counted label tokens of this rank's validation batches at the steps that evaluated."""
    val_time_s: float | None = None
    """Seconds the evaluation took (not part of ``step_time_s``)."""

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict, sharing the nested dicts and lists (``dataclasses.asdict`` deep
        copies them: ~50 µs a report); a report is not changed after it is handed over."""
        return dict(self.__dict__)


class Reporter:
    """Where a worker's reports go: :meth:`report` must not block on the consumer."""

    def report(self, rep: StepReport) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Deliver everything still held; called once when training ends."""

    def unacknowledged(self) -> list[dict[str, Any]]:
        """Reports not yet known to be on disk at the collector (saved in checkpoints)."""
        return []

    def resend(self, reports: list[dict[str, Any]]) -> None:
        """Deliver again reports of an earlier life of this rank (from its checkpoint)."""


class _Released:
    """The (attempt, step) of reports a worker let go (sent, not yet on disk) as runs of
    consecutive steps: a long run between flushes holds a few entries, not one per step, so no
    bound has to count a report as dropped before it is known to be lost. ``len`` counts steps."""

    def __init__(self) -> None:
        self._runs: deque[list[float]] = deque()  # [attempt start time, first step, last step]

    def __len__(self) -> int:
        return int(sum(last - first + 1 for _, first, last in self._runs))

    def __bool__(self) -> bool:
        return bool(self._runs)

    def add(self, attempt: float, step: int) -> None:
        if self._runs and self._runs[-1][0] == attempt and self._runs[-1][2] + 1 == step:
            self._runs[-1][2] = step
        else:
            self._runs.append([attempt, step, step])

    def runs(self) -> int:
        return len(self._runs)

    def pop_oldest(self) -> int:
        """Forget the oldest run; returns its number of steps."""
        _, first, last = self._runs.popleft()
        return int(last - first + 1)

    def trim(self, durable: dict[float, int]) -> None:
        """Forget the steps on disk: at most ``durable[attempt]``, per attempt."""
        kept: deque[list[float]] = deque()
        for attempt, first, last in self._runs:
            first = max(first, durable.get(attempt, 0) + 1)
            if first <= last:
                kept.append([attempt, first, last])
        self._runs = kept

    def clear(self) -> None:
        self._runs.clear()


class CollectorReporter(Reporter):
    """Fire-and-forget delivery to the collector actor (``handle.report.remote(batch)``), with
    every report held until the collector says it is on disk.

    Reports are sent in batches while fewer than ``max_inflight`` calls are unanswered, at most one
    call per ``interval_s`` seconds (the first report at once): a Ray call costs the worker ~0.6 ms
    and the collector ~0.75 ms of CPU time whether it carries one report or ten, so reports of
    fast steps travel together (0: a call every step). ``pack``: send the batches in columns
    (:func:`~ray_titan.metrics.packing.pack_reports`; a
    :class:`~ray_titan.metrics.collector.aggregator.MetricsAggregator`'s delivery, which drives it
    through :meth:`hold`, :meth:`send` and :meth:`poll`). Each
    answer names the collector's incarnation and, per attempt, the step up to which rows are on
    disk; held reports up to there are forgotten. A failed call (the collector died) or a new
    incarnation (it was restarted) makes every held report due again, sent after a back-off of
    ``retry_s`` (doubling up to 30 s), so training never waits for the collector. Beyond
    ``max_buffered`` held reports the oldest are let go: one never sent is dropped and counted in
    ``dropped`` (sent with the next batch); one sent but not yet on disk is remembered by its
    step (a few bytes) and counted in ``dropped`` if the collector restarts without it on disk, or
    it is not on disk at :meth:`close`. When an answer asks the run to stop (the memory verdict with
    ``memory.on_leak = "stop"``), the next :meth:`report` raises
    :class:`~ray_titan.metrics.outcome.MemoryLeakError` with the collector's reason.
    """

    def __init__(self, handle, max_inflight: int = 16, max_buffered: int = 10_000, retry_s: float = 1.0,
                 interval_s: float = 0.0, pack: bool = False):
        self.handle, self.pack = handle, pack
        self._id = f"{os.getpid()}-{id(self)}"  # names this sender's own dropped count at the collector
        self.durable: dict[float, int] = {}  # the collector's latest answer: steps on disk per attempt
        self.max_inflight, self.max_buffered = max_inflight, max_buffered
        self.interval_s, self._next_call = interval_s, 0.0
        self._pending: list = []
        self._held: deque[dict[str, Any]] = deque()
        self._unsent = 0  # the newest ``_unsent`` held reports have not been sent
        self._incarnation: str | None = None
        self._retry_s, self._backoff, self._retry_at = retry_s, retry_s, 0.0
        self.dropped = 0
        # Reports let go while sent but not on disk: lost if the collector dies first.
        self._released = _Released()
        self.failed_calls = 0
        self.resends = 0
        self.last_error: str | None = None
        self.stop_reason: str | None = None
        self._write_failing = False  # the collector's last answer: its disk writes fail

    @property
    def _queue(self) -> list[dict[str, Any]]:
        """Held reports not yet sent."""
        return list(itertools.islice(self._held, len(self._held) - self._unsent, None))

    @property
    def unsent(self) -> int:
        """Held reports not yet sent."""
        return self._unsent

    @property
    def in_flight(self) -> int:
        """Calls sent and not yet answered."""
        return len(self._pending)

    @property
    def call_due(self) -> bool:
        """``interval_s`` has passed since the last call: the next :meth:`send` may call."""
        return time.monotonic() >= self._next_call

    @property
    def write_failing(self) -> bool:
        """The collector's last answer: its disk writes fail (a full disk), so it holds the rows."""
        return self._write_failing

    def report(self, rep: StepReport) -> None:
        self.hold([rep.to_dict()])
        if self.call_due:
            self.send()
        _raise_if_stopped(self.stop_reason)

    def hold(self, reports: list[dict[str, Any]]) -> None:
        """Keep ``reports`` (dicts, ``StepReport.to_dict()``) until the collector has them on disk;
        they go with the next :meth:`send`. Beyond ``max_buffered`` the oldest are let go."""
        self._held.extend(reports)
        self._unsent += len(reports)
        while len(self._held) > self.max_buffered:
            if len(self._held) == self._unsent:  # never sent: lost
                self.dropped += 1
                self._unsent -= 1
                self._held.popleft()
                continue
            r = self._held.popleft()
            self._released.add(r.get("attempt_start_time", 0.0), r["step"])
        # Its own bound, on runs of steps (one per flush gap at most, normally): counted, maybe early.
        while self._released.runs() > 100 * self.max_buffered + 1000:
            self.dropped += self._released.pop_oldest()

    def unacknowledged(self) -> list[dict[str, Any]]:
        self.poll()
        return list(self._held)

    def resend(self, reports: list[dict[str, Any]]) -> None:
        self.hold(reports)
        self.send()

    def poll(self, timeout: float = 0.0, num_returns: int | None = None) -> None:
        """Read the answers of calls that have finished (waiting up to ``timeout`` seconds for
        ``num_returns`` of them, default all): forget what is on disk, resend after a failure
        or a restart, keep the collector's stop reason."""
        import ray

        if not self._pending:
            return
        ready, self._pending = ray.wait(
            self._pending, num_returns=num_returns or len(self._pending), timeout=timeout
        )
        for ref in ready:  # already finished: ray.get does not wait
            try:
                answer = ray.get(ref)
            except Exception as e:
                self.failed_calls += 1
                self.last_error = f"{type(e).__name__}: {e}"
                self._resend_all()
                continue
            if answer is None:
                continue
            restarted = self._incarnation is not None and answer["incarnation"] != self._incarnation
            if restarted:
                self._resend_all()  # a new life of the collector: what the old one held is gone
            self._incarnation = answer["incarnation"]
            if answer.get("stop"):
                self.stop_reason = answer["stop"]
            self._write_failing = bool(answer.get("write_failing"))
            self._acknowledge(answer["durable"])
            if restarted:  # what the old life had not flushed of the reports let go is gone for good
                self.dropped += len(self._released)
                self._released.clear()

    def _acknowledge(self, durable: dict[float, int]) -> None:
        if not durable:
            return
        self.durable = durable
        kept = deque(r for r in self._held if r["step"] > durable.get(r.get("attempt_start_time", 0.0), 0))
        self._released.trim(durable)
        self._unsent = min(len(kept), self._unsent)
        self._held = kept
        self._backoff = self._retry_s

    def _resend_all(self) -> None:
        self._unsent = len(self._held)
        self.resends += 1
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(30.0, self._backoff * 2)

    def send(self, flush: bool = False) -> None:
        """Send every unsent held report in one call (``flush``: even none, asking the collector to
        write what it has), unless ``max_inflight`` calls are unanswered or a back-off runs."""
        self.poll()
        if time.monotonic() < self._retry_at or len(self._pending) >= self.max_inflight:
            return
        if self._unsent or flush:
            batch = self._queue
            self._unsent = 0
            if self.pack:
                batch = {**pack_reports(batch), "sender": self._id}  # type: ignore[assignment]
            self._pending.append(self.handle.report.remote(batch, self.dropped, flush))
            self._next_call = time.monotonic() + self.interval_s

    def close(self, timeout_s: float = 120.0) -> None:
        """Wait, ``timeout_s`` in all, until every held report is on disk at the collector
        (asking it to flush, resending to a restarted one); never raises, so a collector problem
        cannot fail a finished training. Reports not on disk by then are counted in ``dropped``
        and a warning goes to this worker's stderr; the collector itself records every step it
        lacks a rank's report for. A collector whose disk writes fail (a full disk) holding
        every report ends the wait at once: waiting cannot make room."""
        import sys

        deadline = time.monotonic() + timeout_s
        while (self._held or self._released) and time.monotonic() < deadline:
            self.send(flush=not self._pending)
            self.poll(timeout=min(0.5, max(0.0, deadline - time.monotonic())), num_returns=1)
            if self._write_failing and not self._unsent and not self._pending:
                # The collector holds every report in memory but cannot write (a full disk): no
                # wait here makes room. It writes them at the end, once the driver has removed
                # what a failed checkpoint left.
                print(f"ray_titan: warning: metrics collector: {len(self._held)} report(s) held in its memory, "
                      "not yet on disk (its writes fail; it tries again at the end)", file=sys.stderr, flush=True)
                self._held.clear()
                self._released.clear()
                break
            if not self._pending and (self._held or self._released):
                time.sleep(0.2)  # the other ranks' last reports complete the last steps
        lost = len(self._held) + len(self._released)
        self.dropped += lost
        self._held.clear()
        self._released.clear()
        self._unsent = 0
        self.poll(timeout=max(0.0, deadline - time.monotonic()))
        unanswered = len(self._pending)
        self._pending = []
        if self.failed_calls or unanswered or lost:
            print(
                f"ray_titan: warning: metrics collector: {self.failed_calls} failed and "
                f"{unanswered} unanswered report call(s), {self.resends} resend(s), {lost} report(s) "
                f"not confirmed on disk; last error: {self.last_error}",
                file=sys.stderr, flush=True,
            )


def reporting_target(collector, aggregators: list | None, rank: int, ranks_per_aggregator: int):
    """Whom ``rank``'s :class:`CollectorReporter` calls: its group's aggregator, else the collector."""
    return aggregators[rank // ranks_per_aggregator] if aggregators else collector


def _raise_if_stopped(reason: str | None) -> None:
    if reason:
        raise MemoryLeakError(reason)


class LocalReporter(Reporter):
    """Synchronous delivery to a collector object in this process (no Ray)."""

    def __init__(self, collector):
        self.collector = collector

    def report(self, rep: StepReport) -> None:
        answer = self.collector.report([rep.to_dict()])
        _raise_if_stopped(answer.get("stop") if isinstance(answer, dict) else None)


class JsonlReporter(Reporter):
    """Writes every report of this rank as one JSON line to ``path`` (flushed each step), then
    passes it on to ``inner``. The rank's own record: it survives a collector crash and lets a
    test compare what the collector assembled with what each rank computed."""

    def __init__(self, path: str | Path, inner: Reporter | None = None):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")
        self.inner = inner

    def report(self, rep: StepReport) -> None:
        self._file.write(json.dumps(rep.to_dict()) + "\n")
        self._file.flush()
        if self.inner is not None:
            self.inner.report(rep)

    def close(self) -> None:
        self._file.close()
        if self.inner is not None:
            self.inner.close()

    def unacknowledged(self) -> list[dict[str, Any]]:
        return self.inner.unacknowledged() if self.inner is not None else []

    def resend(self, reports: list[dict[str, Any]]) -> None:
        if self.inner is not None:
            self.inner.resend(reports)


def rank_reports_path(run_dir: str | Path, rank: int) -> Path:
    """Where :class:`JsonlReporter` keeps ``rank``'s own reports: ``metrics/ranks/rank{r}.jsonl``."""
    return Path(run_dir) / "metrics" / "ranks" / f"rank{rank}.jsonl"


def read_rank_reports(run_dir: str | Path, rank: int) -> list[dict[str, Any]]:
    """The reports ``rank`` wrote with :class:`JsonlReporter`, in step order as written."""
    return [json.loads(line) for line in rank_reports_path(run_dir, rank).read_text().splitlines()]
