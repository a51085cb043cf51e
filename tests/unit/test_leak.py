"""The memory verdict on synthetic series (no Ray): warm-up, allocator noise, level shifts and
real leaks; the per-rank monitor and the collector's columns and stop signal."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ray_titan.config.units import MiB
from ray_titan.metrics.collector.collector import MetricsCollector
from ray_titan.metrics.collector.leak import (
    GROWING,
    STABLE,
    WARMING_UP,
    LeakDetector,
    LeakMonitor,
    leak_settings,
    theil_sen_slope,
)
from ray_titan.metrics.fields import MEMORY_FIELDS
from ray_titan.metrics.reading.steps import read_steps
from ray_titan.metrics.worker.report import StepReport
from ray_titan.parallel.dims import ParallelDims
from tests.conftest import REPO


def _detector(**kw):
    """A detector with the default window and warm-up, and the device threshold (0.1 MiB/step),
    the stricter one: the synthetic series below are noisier than device memory ever is."""
    args = {**leak_settings(), **kw}
    del args["host_threshold_mib_per_step"]
    return LeakDetector(**args, source="host")


def _warmup_then(rng, steps, rate_mib=0.0, leak_from=1, creep_kib=8.0):
    """A rank's host RSS: +60 MiB over the first 4 steps (optimizer state, pools), an allocator
    creep of ``creep_kib`` per step, ±0.5 MiB jitter and a few 3 MiB spikes, plus a leak of
    ``rate_mib`` per step from ``leak_from``."""
    s = np.arange(1, steps + 1)
    y = 500 * MiB + np.minimum(s, 4) * 15 * MiB + s * creep_kib * 1024
    y += rng.normal(0, 0.5 * MiB, steps)
    y[rng.choice(steps, steps // 25, replace=False)] += 3 * MiB
    y += np.clip(s - leak_from + 1, 0, None) * rate_mib * MiB
    return s, y


def _run(det, s, y):
    return [det.update(int(a), float(b)) for a, b in zip(s, y)]


def test_theil_sen_ignores_outliers():
    x = np.arange(20.0)
    y = 3 * x + 7
    y[[2, 9, 15]] += [500, -800, 300]  # 15% outliers
    assert theil_sen_slope(x, y) == pytest.approx(3.0)
    with pytest.raises(ValueError):
        theil_sen_slope(np.ones(3), np.arange(3.0))


@pytest.mark.parametrize("seed", range(4))
def test_clean_run_with_allocator_creep_is_stable_after_warm_up(seed):
    s, y = _warmup_then(np.random.default_rng(seed), 300)
    det = _detector()
    vs = [v.verdict for v in _run(det, s, y)]
    window = leak_settings()["window"]
    assert vs[:window - 1] == [WARMING_UP] * (window - 1)  # a verdict needs a full window
    assert det.warmup_end == window  # the rise (steps 1-4) is over long before
    assert set(vs[det.warmup_end - 1:]) == {STABLE}


@pytest.mark.parametrize("seed", range(3))
def test_one_time_level_shift_is_not_growth(seed):
    for at in range(100, 133, 4):  # wherever it falls in the window
        s, y = _warmup_then(np.random.default_rng(seed), 170)
        y[s >= at] += 8 * MiB  # a new allocator pool, once
        vs = [v.verdict for v in _run(_detector(), s, y)]
        assert GROWING not in vs, at


@pytest.mark.parametrize("seed", range(3))
def test_leak_after_warm_up_is_found_within_30_steps_at_its_rate(seed):
    s, y = _warmup_then(np.random.default_rng(seed), 120, rate_mib=1.0, leak_from=50)
    det = _detector()
    verdicts = _run(det, s, y)
    first = next(i + 1 for i, v in enumerate(verdicts) if v.verdict == GROWING)
    assert 50 < first <= 50 + 30
    assert all(v.verdict == GROWING for v in verdicts[first - 1:])
    assert verdicts[-1].slope_mib_per_step == pytest.approx(1.0, rel=0.25)


def test_leak_from_step_one_never_flattens_and_is_growing_when_warm_up_ends():
    s, y = _warmup_then(np.random.default_rng(1), 80, rate_mib=1.0)
    det = _detector()
    verdicts = _run(det, s, y)
    assert det.warmup_end == leak_settings()["warmup_max_steps"]
    assert verdicts[det.warmup_end - 1].verdict == GROWING
    assert all(v.verdict == GROWING for v in verdicts[det.warmup_end - 1:])


def test_small_leak_below_threshold_is_stable_and_hysteresis_holds():
    det = _detector()
    vs = [det.update(i, 500 * MiB + i * 0.05 * MiB).verdict for i in range(1, 100)]
    assert vs[-1] == STABLE and GROWING not in vs
    det = _detector()
    vs = [det.update(i, 500 * MiB + i * 0.2 * MiB).verdict for i in range(1, 60)]
    assert vs[-1] == GROWING
    # The rate falls to 0.07 MiB/step: below the threshold (0.1) but above half of it.
    vs = [det.update(i, 500 * MiB + 59 * 0.2 * MiB + (i - 59) * 0.07 * MiB).verdict for i in range(60, 120)]
    assert vs[-1] == GROWING
    vs = [det.update(i, 600 * MiB).verdict for i in range(120, 160)]
    assert vs[-1] == STABLE


def test_oom_projection_from_free_memory_and_rate():
    det = _detector()
    for i in range(1, 60):
        v = det.update(i, 100 * MiB + 2 * i * MiB, free_bytes=1000 * MiB - 2 * i * MiB)
    assert v.verdict == GROWING and v.slope_mib_per_step == pytest.approx(2.0)
    assert v.oom_step == 500  # free 882 MiB at step 59, 2 MiB per step: 441 more steps


def test_monitor_prefers_the_device_series_and_reports_changes():
    mon = LeakMonitor(**leak_settings())
    coords = {"pp": 1, "dp_shard": 0}
    messages = []
    for i in range(1, 80):
        row = {"rank": 2, "coords": coords, "host_rss_bytes": 900 * MiB,
               "host_available_bytes": 10_000 * MiB, "device_allocated_bytes": 1000 * MiB + i * MiB,
               "device_reserved_bytes": 2000 * MiB + i * MiB, "device_capacity_bytes": 80_000 * MiB}
        v, msg = mon.update(i, row)
        messages += [msg] if msg else []
    assert v.verdict == GROWING and v.source == "device" and v.oom_step is not None
    assert messages[0] == "memory: rank 2 (pp=1, dp_shard=0) warming_up at step 1"
    assert messages[-1].startswith("memory: rank 2 (pp=1, dp_shard=0) growing +1.000 MiB/step (device allocated)")
    assert len(messages) == 2  # warming_up -> growing directly (never flattened), printed once each


def test_host_series_leaves_out_the_free_bytes_malloc_keeps():
    """RSS rising 1 MiB/step because malloc's heap fragments (its free bytes rising as fast) is
    stable; the same RSS with the free bytes flat is a leak, and so is growth of RSS alone where
    the C library reports no free bytes."""
    def run(free_of_step):
        mon = LeakMonitor(**leak_settings())
        for i in range(1, 80):
            row = {"rank": 0, "coords": {}, "host_rss_bytes": 900 * MiB + i * MiB,
                   "host_heap_free_bytes": free_of_step(i), "host_available_bytes": 10_000 * MiB}
            v, _ = mon.update(i, row)
        return v

    fragmenting = run(lambda i: 30 * MiB + i * MiB)
    assert fragmenting.verdict == STABLE and fragmenting.source == "host"
    leaking = run(lambda i: 30 * MiB)
    assert leaking.verdict == GROWING and leaking.slope_mib_per_step == pytest.approx(1.0)
    no_glibc = run(lambda i: None)
    assert no_glibc.verdict == GROWING and no_glibc.source == "host_rss"
    assert LeakMonitor.format(leaking).startswith("growing +1.000 MiB/step (host RSS - malloc free)")


def _rep(step, rank, dims, rss):
    mem = dict.fromkeys(MEMORY_FIELDS)
    mem.update(host_rss_bytes=int(rss), host_peak_rss_bytes=int(rss), host_available_bytes=4000 * MiB)
    return StepReport(
        step=step, rank=rank, coords=dims.coords(rank), is_last_stage=dims.is_last_stage_rank(rank),
        loss=1.0 if dims.is_last_stage_rank(rank) else None, tokens=10, step_time_s=0.1,
        data_time_s=0.0, fwd_bwd_time_s=0.0, optim_time_s=0.0, grad_norm=1.0, lr=1e-3, memory=mem,
        gc_pause_s=0.0, gc_generation=1 if step % 5 == 0 else None,
    ).to_dict()


@pytest.mark.parametrize("on_leak", ["warn", "stop"])
def test_collector_records_verdicts_and_stops_on_request(tmp_path, on_leak):
    dims = ParallelDims(pp=2, dp_shard=2)
    c = MetricsCollector(str(tmp_path), 4, dims.last_stage_ranks(), 80, log_freq=1000, on_leak=on_leak)
    answers = []
    for step in range(1, 81):
        for r in range(4):
            rss = 500 * MiB + (2 * step * MiB if r == 1 else 0)
            answers.append(c.report([_rep(step, r, dims, rss)]))
    summary = c.finish()
    t = read_steps(tmp_path)
    verdicts = {r: t.filter(t["rank"].to_numpy() == r)["memory_verdict"].to_pylist() for r in range(4)}
    assert verdicts[1][-1] == GROWING and all(verdicts[r][-1] == STABLE for r in (0, 2, 3))
    assert all(GROWING not in verdicts[r] for r in (0, 2, 3))
    assert summary["memory_verdicts"][1]["verdict"] == GROWING
    assert summary["memory_verdicts"][1]["slope_mib_per_step"] == pytest.approx(2.0)
    assert t.filter(t["rank"].to_numpy() == 1)["memory_oom_step"].to_pylist()[-1] > 80
    assert t["gc_generation"].to_pylist().count(1) == 16 * 4
    growing_lines = [ln for ln in summary["lines"] if "growing" in ln]
    assert len(growing_lines) == 1 and (
        "rank 1 (pp=0, dp_shard=1) growing +2.000 MiB/step (host RSS)" in growing_lines[0])
    if on_leak == "warn":
        assert summary["stop"] is None and not any(a["stop"] for a in answers)
    else:
        assert "rank 1 (pp=0, dp_shard=1): memory growing +2.000 MiB/step" in summary["stop"]
        assert answers[-1]["stop"] == summary["stop"]


# -- the verdict matrix: recorded healthy ranks with leaks, ramps, releases added ------------------
# Host memory of healthy ranks of the main job (pp=2 × dp_shard=2, 600 steps, every step): RSS and
# malloc's free bytes on each C allocator (tests/data/host_memory_series.json says which runs).
_RECORDED = json.loads((REPO / "tests" / "data" / "host_memory_series.json").read_text())["series"]
RATES = [0.25, 0.5, 1.0, 2.0, 4.0]


def _recorded(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and the verdict's host series (RSS less malloc's free bytes, bytes) of a recorded rank."""
    s = _RECORDED[name]
    y = (np.array(s["rss_mib"]) - np.array(s["free_mib"])) * MiB
    return np.arange(1, len(y) + 1), y


def _host_verdicts(steps, y):
    mon = LeakMonitor(**leak_settings())
    return [mon.update(int(a), {"rank": 0, "coords": {}, "host_rss_bytes": float(b), "host_heap_free_bytes": 0.0})[0]
            for a, b in zip(steps, y)]


@pytest.mark.parametrize("name", sorted(_RECORDED))
def test_recorded_healthy_ranks_are_never_growing(name):
    steps, y = _recorded(name)
    verdicts = _host_verdicts(steps, y)
    assert GROWING not in {v.verdict for v in verdicts}
    assert verdicts[-1].verdict == STABLE and abs(verdicts[-1].slope_mib_per_step) < 0.1


@pytest.mark.parametrize("name", sorted(_RECORDED))
@pytest.mark.parametrize("start", [1, 60, 400])  # from the first step, after warm-up, long after
def test_leaks_from_a_quarter_to_four_mib_per_step_are_found_and_stay_found(name, start):
    steps, base = _recorded(name)
    warmup_max = leak_settings()["warmup_max_steps"]
    for rate in RATES:
        y = base + np.clip(steps - start + 1, 0, None) * rate * MiB
        verdicts = _host_verdicts(steps, y)
        first = next((s for s, v in zip(steps, verdicts) if v.verdict == GROWING), None)
        assert first is not None, rate
        # Seen within 30 steps of the leak's start (or of warm-up's end, for a leak from step 1).
        assert first <= max(start, warmup_max) + 30, (rate, first)
        # ... and never lost again, through the checkpoints' and GC rounds' releases.
        assert all(v.verdict == GROWING for v in verdicts[first - 1:]), rate
        assert verdicts[-1].slope_mib_per_step == pytest.approx(rate, rel=0.25, abs=0.05)


@pytest.mark.parametrize("name", sorted(_RECORDED))
@pytest.mark.parametrize("ramp_steps,total_mib", [(10, 60), (20, 200), (25, 30)])
def test_a_ramp_in_the_first_steps_is_warm_up_never_a_leak(name, ramp_steps, total_mib):
    """Memory allocated over the first steps and then kept (optimizer state, allocator pools,
    caches filling) ends warm-up; it is never ``growing``."""
    steps, base = _recorded(name)
    y = base + np.minimum(steps, ramp_steps) * (total_mib / ramp_steps) * MiB
    assert GROWING not in {v.verdict for v in _host_verdicts(steps, y)}


@pytest.mark.parametrize("name", sorted(_RECORDED))
def test_a_release_is_not_growth_and_does_not_hide_a_leak(name):
    """A one-time drop (a GC round freeing a profiler's garbage, a checkpoint's buffers freed)
    neither reads as a leak on a healthy rank nor ends the verdict of a leaking one."""
    steps, base = _recorded(name)
    drop = np.where(steps >= 150, -60 * MiB, 0)
    assert GROWING not in {v.verdict for v in _host_verdicts(steps, base + drop)}
    leak = base + drop + steps * 1.0 * MiB
    verdicts = _host_verdicts(steps, leak)
    assert all(v.verdict == GROWING for v in verdicts[leak_settings()["warmup_max_steps"] - 1:])


def test_a_leak_on_one_rank_of_a_pipeline_stage_only_is_that_ranks():
    """pp=2 × dp_shard=2: rank 2 (pp=1, dp_shard=0) leaks 0.5 MiB/step from step 200, its stage
    partner rank 3 and the other stage do not; each rank's recorded series underneath."""
    dims = ParallelDims(pp=2, dp_shard=2)
    mon = LeakMonitor(**leak_settings())
    names = sorted(_RECORDED)
    series = {r: _recorded(names[r % len(names)])[1] for r in range(4)}
    messages = []
    for i in range(600):
        step = i + 1
        for r in range(4):
            y = series[r][i] + (max(0, step - 199) * 0.5 * MiB if r == 2 else 0)
            row = {"rank": r, "coords": dims.coords(r), "host_rss_bytes": y, "host_heap_free_bytes": 0.0}
            _, msg = mon.update(step, row)
            messages += [msg] if msg and "growing" in msg else []
    summary = mon.summary()
    assert [v["verdict"] for _, v in sorted(summary.items())] == [STABLE, STABLE, GROWING, STABLE]
    assert summary[2]["slope_mib_per_step"] == pytest.approx(0.5, rel=0.25)
    assert len(messages) == 1 and messages[0].startswith("memory: rank 2 (pp=1, dp_shard=0) growing +0.")


@pytest.mark.parametrize("rate", RATES)
def test_device_leaks_are_found_on_the_device_series_while_the_host_is_flat(rate):
    """A GPU rank: device allocated memory is exact (flat after warm-up but for a new pool of the
    caching allocator now and then); a device leak is ``growing`` on the device series, a host
    leak on the host series, each at its rate."""
    rng = np.random.default_rng(int(rate * 4))
    steps = np.arange(1, 301)
    pool = np.where(steps >= 120, 64 * MiB, 0)  # one new 64 MiB pool
    device = 20_000 * MiB + np.minimum(steps, 3) * 2_000 * MiB + pool
    host = 3_000 * MiB + rng.normal(0, 0.3 * MiB, len(steps))

    def run(dev_leak, host_leak):
        mon = LeakMonitor(**leak_settings())
        for i, step in enumerate(steps):
            leak = max(0, step - 100)
            row = {"rank": 0, "coords": {"pp": 0}, "device_allocated_bytes": device[i] + dev_leak * leak * MiB,
                   "device_reserved_bytes": device[i] + 512 * MiB, "device_capacity_bytes": 80 * 1024 * MiB,
                   "host_rss_bytes": host[i] + host_leak * leak * MiB, "host_heap_free_bytes": 0.0,
                   "host_available_bytes": 100_000 * MiB}
            v, _ = mon.update(int(step), row)
        return v

    assert run(0, 0).verdict == STABLE
    dev = run(rate, 0)
    assert dev.verdict == GROWING and dev.source == "device" and dev.oom_step is not None
    assert dev.slope_mib_per_step == pytest.approx(rate, rel=0.05)
    host = run(0, rate)
    assert host.verdict == GROWING and host.source == "host"
    assert host.slope_mib_per_step == pytest.approx(rate, rel=0.25)


def test_the_verdict_of_many_ranks_at_once_is_each_ranks_own():
    """:meth:`LeakMonitor.update_many` over ranks with a leak, a ramp, a release, a flat line and
    a release gives each rank the verdicts and slopes a detector of its own gives; with slopes
    refitted every 3 steps only (a large job's cadence) the verdicts are the same at every step."""
    rng = np.random.default_rng(0)
    steps = np.arange(1, 121)
    series = np.stack([
        500 * MiB + rng.normal(0, 0.3 * MiB, 120),
        500 * MiB + np.clip(steps - 50, 0, None) * 1.0 * MiB,
        500 * MiB + np.minimum(steps, 20) * 3 * MiB,
        500 * MiB + np.where(steps >= 70, -60 * MiB, 0) + steps * 0.5 * MiB,
    ])
    settings = leak_settings()
    mon, every3 = LeakMonitor(**settings), LeakMonitor(**settings)
    dets = [LeakDetector(settings["window"], settings["host_threshold_mib_per_step"], settings["warmup_max_steps"],
                         "host") for _ in series]
    first_growing: dict[int, int] = {}
    ranks = np.arange(len(series))
    for i, step in enumerate(steps.tolist()):
        mem = {"host_rss_bytes": series[:, i], "host_heap_free_bytes": np.zeros(len(series))}
        code, slope, _, _ = mon.update_many(step, ranks, mem)
        code3, _, _, _ = every3.update_many(step, ranks, mem, every=3)
        assert np.array_equal(code3, code), step
        for r, det in enumerate(dets):
            v = det.update(step, series[r, i])
            assert v.verdict == ("warming_up", "stable", "growing")[code[r]], (r, step)
            assert (v.slope_mib_per_step is None) == np.isnan(slope[r])
            if v.slope_mib_per_step is not None:
                assert slope[r] == pytest.approx(v.slope_mib_per_step)
            if v.verdict == GROWING:
                first_growing.setdefault(r, step)
    assert sorted(first_growing) == [1, 3] and 50 < first_growing[1] <= 80
