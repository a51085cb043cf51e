"""A slow or stuck collector never blocks or grows a worker (CollectorReporter on Ray)."""

from __future__ import annotations

import threading

import pytest

from ray_titan.metrics.fields import MEMORY_FIELDS
from ray_titan.metrics.worker.report import CollectorReporter, StepReport

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


def _rank_report(step: int, rank: int, dims) -> StepReport:
    mem = dict.fromkeys(MEMORY_FIELDS)
    mem.update(host_rss_bytes=(1000 + rank) * 2**20 + step * 4096, host_heap_free_bytes=0)
    last = dims.is_last_stage_rank(rank)
    return StepReport(step=step, rank=rank, coords=dims.coords(rank), is_last_stage=last, loss=2.0 if last else None,
                      tokens=10, step_time_s=0.1, data_time_s=0.0, fwd_bwd_time_s=0.0, optim_time_s=0.0,
                      grad_norm=1.0, lr=1e-3, memory=mem, gc_pause_s=0.0, attempt_start_time=1.0)


def test_killing_the_collector_and_an_aggregator_loses_no_report_of_256_ranks(ray_cluster, tmp_path):
    """256 simulated ranks report through 4 metrics aggregators (64 ranks each); the collector is
    killed at step 4 and an aggregator at step 7, both restarted by Ray. Every rank's report of
    every step ends up on disk exactly once, as the rank sent it, and no report was dropped."""
    import time

    import numpy as np
    import ray

    from ray_titan.metrics.collector.aggregator import create_aggregators
    from ray_titan.metrics.collector.collector import MetricsCollector
    from ray_titan.metrics.reading.steps import read_steps
    from ray_titan.metrics.worker.report import reporting_target
    from ray_titan.parallel.dims import ParallelDims

    dims, steps = ParallelDims(pp=4, dp_shard=64), 10
    collector = ray.remote(MetricsCollector).options(num_cpus=0, max_restarts=1).remote(
        str(tmp_path), dims.world_size, dims.last_stage_ranks(), steps, flush_every_steps=2,
        enable_tensorboard=False)
    aggregators = create_aggregators(collector, dims.world_size, 64)
    assert aggregators is not None and len(aggregators) == 4
    reporters = [CollectorReporter(reporting_target(collector, aggregators, r, 64), interval_s=0.0, retry_s=0.2)
                 for r in range(dims.world_size)]
    try:
        for step in range(1, steps + 1):
            if step == 4:
                ray.kill(collector, no_restart=False)
            if step == 7:
                ray.kill(aggregators[1], no_restart=False)
            for r, reporter in enumerate(reporters):
                reporter.report(_rank_report(step, r, dims))
        # Every rank closes at once (as workers do), each resending what it holds until it is on disk.
        deadline = time.monotonic() + 60
        while any(rep._held for rep in reporters) and time.monotonic() < deadline:
            for rep in reporters:
                rep.send(flush=not rep.in_flight)
                rep.poll()
            time.sleep(0.2)
        assert not any(rep._held for rep in reporters)
        assert sum(rep.dropped for rep in reporters) == 0
        assert sum(rep.resends for rep in reporters) > 0  # the kills were felt
        summary = ray.get(collector.finish.remote())
    finally:
        for a in aggregators:
            ray.kill(a)
    assert summary["errors"] == [] and summary["collector_restarted"]
    t = read_steps(tmp_path)
    assert t.num_rows == steps * dims.world_size
    step_col, rank_col = t["step"].to_numpy(), t["rank"].to_numpy()
    assert len(set(zip(step_col.tolist(), rank_col.tolist()))) == t.num_rows
    expected = (1000 + rank_col) * 2**20 + step_col * 4096
    assert np.array_equal(t["host_rss_bytes"].to_numpy(), expected)
    assert set(t["step_loss"].to_pylist()) == {2.0}
