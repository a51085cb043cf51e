"""CollectorReporter's bound on held reports (no Ray: the collector's answers are scripted)."""

from __future__ import annotations

import pytest

from ray_titan.metrics.worker.report import CollectorReporter

# CollectorReporter talks to a Ray actor: its calls are patched here, but the module is Ray's.
ray = pytest.importorskip("ray", reason="the compatibility job's venv without Ray")


class _Collector:
    """Answers each call at once: its incarnation and the steps on disk (none: a large
    ``metrics.flush_every_steps``); ``die()`` makes the next call fail, and later ones come from a
    new life that flushed nothing."""

    def __init__(self):
        self.incarnation, self.calls, self.dying = "first", [], False
        self.report = self

    def remote(self, batch, dropped, flush):
        self.calls.append((batch, dropped))
        if self.dying:
            self.dying, self.incarnation = False, "second"
            return RuntimeError("the collector actor died")
        return {"incarnation": self.incarnation, "durable": {0.0: 0}}


def _scripted(monkeypatch):
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (refs, []))

    def get(ref):
        if isinstance(ref, Exception):
            raise ref
        return ref

    monkeypatch.setattr(ray, "get", get)


def _step(step):
    return {"step": step, "rank": 0, "attempt_start_time": 0.0}


def _reported(monkeypatch, max_buffered, steps):
    """A reporter to a scripted collector after reporting ``steps``, each sent as it comes."""
    _scripted(monkeypatch)
    collector = _Collector()
    reporter = CollectorReporter(collector, max_inflight=4, max_buffered=max_buffered)
    for step in steps:
        reporter.hold([_step(step)])
        reporter.send()
    return collector, reporter


def test_reports_let_go_before_they_are_on_disk_are_counted_when_the_collector_dies(monkeypatch):
    """Issue 44, finding 2: with 8 reports held, a worker let go of the oldest sent ones before
    the collector had them on disk, uncounted; the collector killed at step 20 then lost steps
    1-12 with no error. Every one of them is now counted in ``dropped`` (sent with the next batch,
    so the collector ends the run with an error naming the rank and the count)."""
    collector, reporter = _reported(monkeypatch, 8, range(1, 21))
    assert reporter.dropped == 0  # the 12 let go may still reach disk
    collector.dying = True
    reporter.hold([_step(21)])  # lets go of step 13 too
    reporter.send()  # fails: the collector died
    reporter.send()  # sees the failure: everything held is due again, after a back-off
    reporter._retry_at = 0.0
    reporter.hold([_step(22)])  # nine held, none sent to the new life: the oldest (14) dropped, counted
    reporter.send()  # to the new life
    reporter.send()  # its answer: nothing of steps 1-13 is on disk
    assert reporter.dropped == 14
    reporter._retry_at = 0.0
    reporter.send()  # the held reports resent, with the count: the collector ends the run with an error
    assert collector.calls[-1][1] == 14 and [r["step"] for r in collector.calls[-1][0]] == list(range(15, 23))


def test_reports_let_go_and_then_flushed_are_not_counted(monkeypatch):
    """A small buffer on a healthy run: what was let go reaches disk, nothing is counted."""
    collector, reporter = _reported(monkeypatch, 2, range(1, 11))
    collector.remote = lambda batch, dropped, flush: {"incarnation": "first", "durable": {0.0: 10}}
    reporter.close(timeout_s=5)
    assert reporter.dropped == 0


def test_a_long_gap_between_flushes_counts_nothing_early(monkeypatch):
    """Reports let go are remembered as runs of steps, so 3,000 steps between two flushes with 8
    held (the old bound, one entry per step, counted past 1,800 as dropped although they reached
    disk) are one run, counted as nothing, and forgotten once the collector has them on disk."""
    collector, reporter = _reported(monkeypatch, 8, range(1, 3001))
    assert reporter.dropped == 0 and len(reporter._released) == 2992 and reporter._released.runs() == 1
    collector.remote = lambda batch, dropped, flush: {"incarnation": "first", "durable": {0.0: 3000}}
    reporter.close(timeout_s=5)
    assert reporter.dropped == 0 and not reporter._released
