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

import numpy as np

__all__ = [
    "MEMORY_FIELDS",
    "MOE_PAD",
    "PACKED_FIELDS",
    "CollectorReporter",
    "JsonlReporter",
    "LocalReporter",
    "MetricsAggregator",
    "Reporter",
    "StepReport",
    "create_aggregators",
    "pack_reports",
    "rank_reports_path",
    "read_rank_reports",
    "reporting_target",
]

# The memory sample of a StepReport (ray_titan.metrics.memory.MemorySampler fills it). Here, not
# beside the sampler: the collector needs the names, and the sampler module imports torch.
MEMORY_FIELDS = (
    "host_rss_bytes",
    "host_peak_rss_bytes",
    "host_heap_in_use_bytes",
    "host_heap_free_bytes",
    "host_available_bytes",
    "device_allocated_bytes",
    "device_active_bytes",
    "device_reserved_bytes",
    "device_peak_active_bytes",
    "device_peak_reserved_bytes",
    "device_alloc_retries",
    "device_ooms",
    "device_capacity_bytes",
)


# A batch of reports in columns (:func:`pack_reports`): every scalar of a report, coordinates
# and memory flattened, in one float64 matrix. One matrix pickles and crosses a Ray call for a
# fraction of what a dict per report, or an Arrow record batch of 60 columns, costs the collector.
COORD_AXES = ("pp", "dp_replicate", "dp_shard", "tp", "ep")
PACKED_FIELDS = (
    "step", "rank", *COORD_AXES, "is_last_stage", "loss", "tokens", "step_time_s", "data_time_s",
    "fwd_bwd_time_s", "optim_time_s", "grad_norm", "lr", "gc_pause_s", "time", "metrics_time_s", *MEMORY_FIELDS,
    "aux_loss", "gc_generation", "loss_tokens", "val_loss", "val_tokens", "val_time_s", "world_size",
    "skipped_update", "attempt_start_time", "pid", "dropped",
)
"""The columns of :func:`pack_reports`'s ``values`` matrix, in order. ``dropped``: the reports
the sending rank had dropped when it sent this one."""
PACKED_OBJECTS = ("node", "moe_layers", "expert_load", "source_tokens", "memory_breakdown")
"""The per-report fields that are not one number, in ``objects``' tuples, in order."""


MOE_PAD = -1
"""The layer index of a padding row in a ``moe`` block: pipeline stages hold different numbers of
MoE layers (DeepSeek's first dense layers), and the blocks of their ranks are padded to the most
layers of the batch (padding layers count no tokens)."""


def _padded_moe(objects: list[tuple]) -> tuple[np.ndarray, np.ndarray]:
    """``moe_layers`` and ``expert_load`` of packed objects as int64 blocks ``(n, L)`` and ``(n, L,
    E)``, rows with fewer than the most layers ``L`` padded with layer :data:`MOE_PAD` and zero
    load. Raises ValueError where the layers of the reports count different numbers of experts."""
    n, most = len(objects), max((len(o[1]) for o in objects), default=0)
    if all(len(o[1]) == most for o in objects):
        layers = np.asarray([o[1] for o in objects], np.int64).reshape(n, most)
        load = np.asarray([o[2] for o in objects], np.int64) if layers.size else np.zeros((n, 0, 0), np.int64)
        return layers, load
    experts = {len(x) for o in objects for x in o[2]}
    if len(experts) > 1:
        raise ValueError(f"expert counts differ between MoE layers: {sorted(experts)}")
    e = experts.pop() if experts else 0
    layers = np.full((n, most), MOE_PAD, np.int64)
    load = np.zeros((n, most, e), np.int64)
    for i, o in enumerate(objects):
        k = len(o[1])
        if len(o[2]) != k:
            raise ValueError(f"{k} MoE layers but {len(o[2])} rows of expert load")
        if k:
            layers[i, :k], load[i, :k] = o[1], o[2]
    return layers, load


def pack_reports(reports: list[dict[str, Any]], dropped: list[int] | int = 0) -> dict[str, Any]:
    """Reports (``StepReport.to_dict()``) as columns: ``{"values": float64 (n, len(PACKED_FIELDS)),
    "null": bool (n, len(PACKED_FIELDS)) (the report had None there), "objects": [(node,
    moe_layers, expert_load, source_tokens, memory_breakdown)] * n, "axes": the mesh axes of the
    first report's ``coords``, in order, "moe": None or (int64 (n, layers), int64 (n, layers,
    experts)): ``moe_layers`` and ``expert_load`` of every report, padded where ranks hold
    different numbers of MoE layers (:data:`MOE_PAD`; then None in ``objects``), None where the
    layers count different numbers of experts}``. Counts and bytes are exact in float64 up to 2**53.
    ``dropped``: per report, or one count for all, the reports its rank had dropped (a report's
    own ``dropped`` key wins)."""
    n = len(reports)
    drops = [dropped] * n if isinstance(dropped, int) else dropped
    rows, objects = [], []
    for rep, d in zip(reports, drops):
        d = rep.get("dropped", d)  # set by a MetricsAggregator: the sending rank's count
        c, m = rep["coords"], rep["memory"]
        rows.append((
            rep["step"], rep["rank"], c.get("pp", 0), c.get("dp_replicate", 0), c.get("dp_shard", 0), c.get("tp", 0),
            c.get("ep", 0), rep["is_last_stage"], rep["loss"], rep["tokens"], rep["step_time_s"], rep["data_time_s"],
            rep["fwd_bwd_time_s"], rep["optim_time_s"], rep["grad_norm"], rep["lr"], rep["gc_pause_s"],
            rep.get("time", 0.0), rep.get("metrics_time_s"), *(m.get(k) for k in MEMORY_FIELDS), rep.get("aux_loss"),
            rep.get("gc_generation"), rep.get("loss_tokens"), rep.get("val_loss"), rep.get("val_tokens"),
            rep.get("val_time_s"), rep.get("world_size") or None, rep.get("skipped_update", False),
            rep.get("attempt_start_time", 0.0), rep.get("pid"), d,
        ))
        objects.append((rep.get("node") or None, rep.get("moe_layers") or [], rep.get("expert_load") or [],
                        rep.get("source_tokens"), rep.get("memory_breakdown")))
    raw = np.array(rows, dtype=object).reshape(n, len(PACKED_FIELDS))
    null = raw == None  # noqa: E711 (elementwise)
    raw[null] = np.nan
    packed = {"values": raw.astype(np.float64), "null": null, "objects": objects,
              "axes": tuple(reports[0]["coords"]) if reports else (), "moe": None}
    # MoE: every rank's layers and expert load as two int blocks, (n, layers) and (n, layers,
    # experts), padded to one shape: built here, on the sender's CPU, instead of element by
    # element in the collector.
    try:
        layers, load = _padded_moe(objects)
    except (ValueError, TypeError):  # ragged: expert counts differ between layers
        return packed
    if n and layers.ndim == 2 and load.ndim == 3 and load.shape[1] == layers.shape[1]:
        packed["moe"] = (layers, load)
        packed["objects"] = [(o[0], None, None, o[3], o[4]) for o in objects]
    return packed


@dataclass
class StepReport:
    """What one rank says about one optimizer step. Times in seconds, memory in bytes.

    ``loss`` is the mean cross-entropy (nats per token) over this rank's tokens on ranks holding
    the last pipeline stage, and ``None`` on every other rank: never a placeholder number.
    ``tokens`` is the number of label tokens this rank's data-parallel slice held in the step.
    ``coords``: the rank's coordinates by mesh axis (``pp``, ``dp_shard``, and ``dp_replicate``,
    ``tp``, ``ep`` where the mesh has them: ``ray_titan.parallel.dims.ParallelDims.coords``).
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
    with the torch profiler (``ray_titan.metrics.profiling.StepProfiler.stop``); else None."""
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
    (:func:`pack_reports`; a :class:`MetricsAggregator`'s delivery). Each
    answer names the collector's incarnation and, per attempt, the step up to which rows are on
    disk; held reports up to there are forgotten. A failed call (the collector died) or a new
    incarnation (it was restarted) makes every held report due again, sent after a back-off of
    ``retry_s`` (doubling up to 30 s), so training never waits for the collector. Beyond
    ``max_buffered`` held reports the oldest are let go: one never sent is dropped and counted in
    ``dropped`` (sent with the next batch); one sent but not yet on disk is remembered by its
    step (a few bytes) and counted in ``dropped`` if the collector restarts without it on disk, or
    it is not on disk at :meth:`close`. When an answer asks the run to stop (the memory verdict with
    ``memory.on_leak = "stop"``), the next :meth:`report` raises
    :class:`~ray_titan.metrics.leak.MemoryLeakError` with the collector's reason.
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

    def report(self, rep: StepReport) -> None:
        self._hold([rep.to_dict()])
        if time.monotonic() >= self._next_call:
            self._send()
        _raise_if_stopped(self.stop_reason)

    def _hold(self, reports: list[dict[str, Any]]) -> None:
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
        self._poll()
        return list(self._held)

    def resend(self, reports: list[dict[str, Any]]) -> None:
        self._hold(reports)
        self._send()

    def _poll(self, timeout: float = 0.0, num_returns: int | None = None) -> None:
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

    def _send(self, flush: bool = False) -> None:
        self._poll()
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
            self._send(flush=not self._pending)
            self._poll(timeout=min(0.5, max(0.0, deadline - time.monotonic())), num_returns=1)
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
        self._poll(timeout=max(0.0, deadline - time.monotonic()))
        unanswered = len(self._pending)
        self._pending = []
        if self.failed_calls or unanswered or lost:
            print(
                f"ray_titan: warning: metrics collector: {self.failed_calls} failed and "
                f"{unanswered} unanswered report call(s), {self.resends} resend(s), {lost} report(s) "
                f"not confirmed on disk; last error: {self.last_error}",
                file=sys.stderr, flush=True,
            )


class MetricsAggregator:
    """Between a group of ranks and the collector: the ranks' :class:`CollectorReporter` call it
    as they would the collector (same :meth:`report` and answers), and it forwards the group's
    reports to the collector as one columnar batch (:func:`pack_reports`), so the collector takes
    ranks / ``expected`` calls a step instead of one per rank (a Ray call costs the collector
    ~0.25 ms of CPU whatever it carries, measured on this project's 2-core machine).

    Its own delivery to the collector is a :class:`CollectorReporter` (packing its batches): it
    holds what it forwarded until the collector has it on disk and resends it to a restarted
    collector. Its answers carry its own incarnation and the collector's ``durable`` steps, so the
    ranks forget a report only once it is on disk, and resend all they hold when this aggregator
    was restarted (a new incarnation) or a call to it failed: a killed aggregator loses nothing.
    Bounded: ``max_inflight`` forwards unanswered, ``max_buffered`` reports held (beyond, the
    oldest unsent are dropped and counted, and the collector records them as errors).

    Args:
        collector: the collector actor's handle.
        expected: reports that make a full batch (the group's ranks): forwarded as soon as this
            many wait, ``interval_s`` seconds after the last forward, or on a ``flush``.
    """

    def __init__(self, collector, expected: int, max_inflight: int = 4, max_buffered: int = 100_000,
                 interval_s: float = 1.0):
        import uuid

        self.expected = expected
        self.incarnation = uuid.uuid4().hex
        self.out = CollectorReporter(collector, max_inflight, max_buffered, interval_s=interval_s, pack=True)

    @property
    def dropped(self) -> int:
        return self.out.dropped

    def report(self, batch: list[dict[str, Any]], dropped: int = 0, flush: bool = False) -> dict[str, Any]:
        """Take one rank's call (see :meth:`MetricsCollector.report`); answer as the collector would."""
        out = self.out
        out._hold([{**r, "dropped": dropped} for r in batch] if dropped else batch)
        if flush or out._unsent >= self.expected or time.monotonic() >= out._next_call:
            out._send(flush)
        else:
            out._poll()
        return {"incarnation": self.incarnation, "durable": out.durable, "stop": out.stop_reason,
                "write_failing": out._write_failing}

    def forward(self, flush: bool = False) -> None:
        """Send what waits now (unless ``max_inflight`` forwards are unanswered)."""
        self.out._send(flush)


def create_aggregators(collector, world_size: int, ranks_per_aggregator: int, max_inflight: int = 4,
                       max_buffered: int = 100_000) -> list | None:
    """One :class:`MetricsAggregator` actor per ``ranks_per_aggregator`` ranks (``metrics.ranks_per_aggregator``),
    owned by the caller (the driver), restarted by Ray whenever it dies; None when the job is no
    larger than one group (or ``ranks_per_aggregator`` is 0): its ranks call the collector."""
    import ray

    if not ranks_per_aggregator or world_size <= ranks_per_aggregator:
        return None
    actor = ray.remote(MetricsAggregator).options(num_cpus=0, max_restarts=-1, enable_task_events=False)
    return [actor.remote(collector, ranks_per_aggregator, max_inflight, max_buffered)
            for _ in range(-(-world_size // ranks_per_aggregator))]


def reporting_target(collector, aggregators: list | None, rank: int, ranks_per_aggregator: int):
    """Whom ``rank``'s :class:`CollectorReporter` calls: its group's aggregator, else the collector."""
    return aggregators[rank // ranks_per_aggregator] if aggregators else collector


def _raise_if_stopped(reason: str | None) -> None:
    if reason:
        from ray_titan.metrics.leak import MemoryLeakError

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
