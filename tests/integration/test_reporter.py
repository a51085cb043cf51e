"""A slow or stuck collector never blocks or grows a worker (CollectorReporter on Ray)."""

from __future__ import annotations

import threading

import pytest

from ray_titan.metrics.memory import MEMORY_FIELDS
from ray_titan.metrics.report import CollectorReporter, StepReport

pytestmark = pytest.mark.ray


def _rep(step: int) -> StepReport:
    return StepReport(step=step, rank=0, coords={"pp": 0, "dp_shard": 0}, is_last_stage=True, loss=1.0,
                      tokens=1, step_time_s=0.1, data_time_s=0.0, fwd_bwd_time_s=0.0, optim_time_s=0.0,
                      grad_norm=0.0, lr=0.0, memory=dict.fromkeys(MEMORY_FIELDS), gc_pause_s=0.0)


@pytest.fixture
def stuck_collector(ray_cluster):
    import ray

    @ray.remote(num_cpus=0, max_concurrency=16)  # > max_inflight, so release() gets a thread
    class Stuck:
        """Every report() waits until release(): a collector that has stopped answering."""

        def __init__(self):
            self.gate = threading.Event()
            self.steps: list[int] = []
            self.dropped = 0
            self.calls = 0

        def report(self, batch, dropped=0, flush=False):
            self.calls += 1
            self.gate.wait()
            self.steps.extend(r["step"] for r in batch)
            self.dropped = max(self.dropped, dropped)
            return {"incarnation": "one", "durable": {0.0: max(self.steps, default=0)}}

        def release(self):
            self.gate.set()

        def received(self):
            return sorted(self.steps), self.dropped

        def count(self):
            return self.calls

    actor = Stuck.remote()
    yield actor
    ray.kill(actor)


def _report_all(reporter, steps):
    done = threading.Event()

    def work():
        for s in steps:
            reporter.report(_rep(s))
            assert len(reporter._pending) <= reporter.max_inflight
            assert len(reporter._queue) <= reporter.max_buffered
        done.set()

    threading.Thread(target=work, daemon=True).start()
    return done.wait(timeout=60)


def test_stuck_collector_does_not_block_and_nothing_is_lost(stuck_collector):
    import ray

    reporter = CollectorReporter(stuck_collector, max_inflight=4, max_buffered=1000)
    assert _report_all(reporter, range(1, 301)), "report() blocked on a stuck collector"
    assert len(reporter._pending) == 4 and len(reporter._queue) == 300 - 4
    ray.get(stuck_collector.release.remote())
    reporter.close()
    assert ray.get(stuck_collector.received.remote()) == (list(range(1, 301)), 0)


def test_stuck_collector_cannot_grow_a_worker(stuck_collector):
    import ray

    reporter = CollectorReporter(stuck_collector, max_inflight=2, max_buffered=50)
    assert _report_all(reporter, range(1, 501))
    assert len(reporter._queue) == 50 and reporter.dropped == 500 - 2 - 50
    ray.get(stuck_collector.release.remote())
    reporter.close()
    steps, dropped = ray.get(stuck_collector.received.remote())
    assert steps == [1, 2, *range(451, 501)] and dropped == reporter.dropped  # the collector is told


def test_close_gives_up_after_its_deadline(stuck_collector):
    reporter = CollectorReporter(stuck_collector, max_inflight=2, max_buffered=100)
    assert _report_all(reporter, range(1, 11))
    reporter.close(timeout_s=1.0)  # the collector never answers: returns, counting the unconfirmed
    assert reporter.dropped == 10 and reporter._pending == [] and len(reporter._queue) == 0


def test_reports_between_calls_travel_together(stuck_collector):
    import ray

    ray.get(stuck_collector.release.remote())
    reporter = CollectorReporter(stuck_collector, interval_s=3600.0)
    for s in range(1, 51):
        reporter.report(_rep(s))
    # Step 1 went at once, the rest wait. The actor is threaded (max_concurrency), so count()
    # could run before the report call it should see: wait for that call first.
    assert len(reporter._pending) == 1
    ray.get(reporter._pending)
    assert ray.get(stuck_collector.count.remote()) == 1
    assert [r["step"] for r in reporter._queue] == list(range(2, 51))
    reporter.close()  # delivers what is held, whatever the interval
    assert ray.get(stuck_collector.received.remote()) == (list(range(1, 51)), 0)
    assert ray.get(stuck_collector.count.remote()) == 2


def test_close_does_not_wait_on_a_collector_whose_disk_is_full(ray_cluster):
    """A collector that holds every report but cannot write (``write_failing``): close() returns
    at once (waiting cannot make room; the driver frees it after the run) and nothing was
    withheld from it."""
    import time

    import ray

    @ray.remote(num_cpus=0)
    class Full:
        def __init__(self):
            self.steps: list[int] = []

        def report(self, batch, dropped=0, flush=False):
            self.steps.extend(r["step"] for r in batch)
            return {"incarnation": "one", "durable": {}, "write_failing": len(self.steps) >= 5}

        def received(self):
            return sorted(set(self.steps))

    actor = Full.remote()
    try:
        reporter = CollectorReporter(actor, interval_s=0.0)
        for s in range(1, 11):
            reporter.report(_rep(s))
        start = time.monotonic()
        reporter.close(timeout_s=60.0)
        assert time.monotonic() - start < 10
        assert ray.get(actor.received.remote()) == list(range(1, 11)) and reporter.dropped == 0
    finally:
        ray.kill(actor)
