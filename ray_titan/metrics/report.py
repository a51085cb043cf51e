"""The worker side of metrics: :class:`StepReport` and the reporters that deliver it.

A report holds host scalars only, never tensors (DESIGN.md, Contracts). :class:`CollectorReporter`
sends to the collector actor without waiting and is bounded: at most ``max_inflight`` calls in
flight and at most ``max_buffered`` reports held while the collector is slow, so a slow or stuck
collector can neither stall nor grow a worker. :class:`LocalReporter` hands reports to an
in-process collector, for the train loop run without Ray.
"""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "StepReport", "Reporter", "CollectorReporter", "LocalReporter", "JsonlReporter",
    "rank_reports_path", "read_rank_reports",
]


@dataclass
class StepReport:
    """What one rank says about one optimizer step. Times in seconds, memory in bytes.

    ``loss`` is the mean cross-entropy (nats per token) over this rank's tokens on ranks holding
    the last pipeline stage, and ``None`` on every other rank: never a placeholder number.
    ``tokens`` is the number of label tokens this rank's data-parallel slice held in the step.
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
    aux_loss: float | None = None
    """MoE: the load-balance loss summed over this rank's MoE layers, mean over microbatches."""
    moe_layers: list[int] = field(default_factory=list)
    """MoE: indices of the MoE layers this rank holds."""
    expert_load: list[list[int]] = field(default_factory=list)
    """MoE: per layer in ``moe_layers``, tokens (× top-k) this rank's router sent to each expert in
    the step (host ints). Summed over the ranks of a stage it is the layer's load for the step."""
    gc_generation: int | None = None
    """Generation of the synchronized GC run in this step (``ray_titan.gc``), None if none ran."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Reporter:
    """Where a worker's reports go: :meth:`report` must not block on the consumer."""

    def report(self, rep: StepReport) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Deliver everything still held; called once when training ends."""


class CollectorReporter(Reporter):
    """Fire-and-forget delivery to the collector actor (``handle.report.remote(batch)``).

    Reports queue locally while ``max_inflight`` calls are unanswered and are sent as one batch
    when a slot frees; beyond ``max_buffered`` queued reports the oldest are dropped and counted
    in ``dropped`` (sent with the next batch), so memory stays bounded. A call the collector
    failed is counted in ``failed_calls`` (its message in ``last_error``) and never stops
    training. When an answer asks the run to stop (the memory verdict with
    ``memory.on_leak = "stop"``), the next :meth:`report` raises
    :class:`~ray_titan.metrics.leak.MemoryLeakError` with the collector's reason.
    """

    def __init__(self, handle, max_inflight: int = 16, max_buffered: int = 10_000):
        self.handle = handle
        self.max_inflight, self.max_buffered = max_inflight, max_buffered
        self._pending: list = []
        self._queue: deque[dict[str, Any]] = deque()
        self.dropped = 0
        self.failed_calls = 0
        self.last_error: str | None = None
        self.stop_reason: str | None = None

    def report(self, rep: StepReport) -> None:
        self._queue.append(rep.to_dict())
        while len(self._queue) > self.max_buffered:
            self._queue.popleft()
            self.dropped += 1
        self._send()
        _raise_if_stopped(self.stop_reason)

    def _send(self) -> None:
        import ray

        if self._pending:
            ready, self._pending = ray.wait(
                self._pending, num_returns=len(self._pending), timeout=0, fetch_local=False
            )
            self._check(ready)
        if self._queue and len(self._pending) < self.max_inflight:
            batch = list(self._queue)
            self._queue.clear()
            self._pending.append(self.handle.report.remote(batch, self.dropped))

    def _check(self, ready: list) -> None:
        import ray

        for ref in ready:  # already finished: ray.get does not wait
            try:
                answer = ray.get(ref)
            except Exception as e:
                self.failed_calls += 1
                self.last_error = f"{type(e).__name__}: {e}"
                continue
            if isinstance(answer, dict) and answer.get("stop"):
                self.stop_reason = answer["stop"]

    def close(self, timeout_s: float = 120.0) -> None:
        """Send what is queued and wait for every call, ``timeout_s`` in all; never raises, so a
        collector problem cannot fail a finished training. Reports not sent by then are counted
        in ``dropped`` and a warning goes to this worker's stderr; the collector itself records
        every step it lacks a rank's report for."""
        import sys
        import time

        import ray

        deadline = time.monotonic() + timeout_s
        while self._queue and time.monotonic() < deadline:
            if len(self._pending) >= self.max_inflight:
                ready, self._pending = ray.wait(
                    self._pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
                )
                self._check(ready)
            self._send()
        self.dropped += len(self._queue)
        self._queue.clear()
        ready, unanswered = ray.wait(
            self._pending, num_returns=len(self._pending),
            timeout=max(0.0, deadline - time.monotonic()),
        ) if self._pending else ([], [])
        self._check(ready)
        self._pending = []
        if self.failed_calls or unanswered or self.dropped:
            print(
                f"ray_titan: warning: metrics collector: {self.failed_calls} failed and "
                f"{len(unanswered)} unanswered report call(s), {self.dropped} report(s) dropped; "
                f"last error: {self.last_error}",
                file=sys.stderr, flush=True,
            )


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


def rank_reports_path(run_dir: str | Path, rank: int) -> Path:
    """Where :class:`JsonlReporter` keeps ``rank``'s own reports: ``metrics/ranks/rank{r}.jsonl``."""
    return Path(run_dir) / "metrics" / "ranks" / f"rank{rank}.jsonl"


def read_rank_reports(run_dir: str | Path, rank: int) -> list[dict[str, Any]]:
    """The reports ``rank`` wrote with :class:`JsonlReporter`, in step order as written."""
    return [json.loads(line) for line in rank_reports_path(run_dir, rank).read_text().splitlines()]
