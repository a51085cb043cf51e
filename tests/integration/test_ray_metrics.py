"""The collector's Ray metrics (ray_titan/metrics/collector/ray_metrics.py), read back from the Prometheus
endpoint of the shared local cluster (started with the dashboard, as `ray-titan train` starts one)."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from ray_titan.parallel.dims import ParallelDims
from tests.unit.test_leak import MiB, _rep

pytestmark = pytest.mark.ray


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _value(text: str, name: str, **labels: str) -> float | None:
    """The value of the series ``name`` whose labels include ``labels`` (None if absent)."""
    for m in re.finditer(rf"^{name}{{([^}}]*)}} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(2))
    return None


def test_collector_exports_step_scalars_and_stage_memory_to_prometheus(ray_cluster, tmp_path):
    import ray

    from ray_titan.metrics.collector.collector import MetricsCollector

    dims = ParallelDims(pp=2, dp_shard=2)
    run_dir = tmp_path / "métricsjob-20261126-130000"  # a non-ASCII job.name: Ray's gauges take ASCII only
    collector = ray.remote(num_cpus=0)(MetricsCollector).remote(
        str(run_dir), 4, dims.last_stage_ranks(), 3, enable_tensorboard=False)
    for step in (1, 2, 3):  # rank 3 (pp=1) holds the most host memory
        ray.get(collector.report.remote(
            [_rep(step, r, dims, (500 + 100 * r) * MiB) for r in range(4)]))
    summary = ray.get(collector.finish.remote())
    ports = {n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]}
    job = "metricsjob-20261126-130000"  # as ray_metrics.label_value makes it
    deadline, text = time.monotonic() + 60, ""  # Ray pushes application metrics every ~10 s
    while time.monotonic() < deadline:
        text = "\n".join(_scrape(p) for p in ports)
        if _value(text, "ray_titan_step", job=job) == 3.0 and _value(
                text, "ray_titan_stage_memory_bytes", job=job, stage="1", stat="max", series="host_rss") is not None:
            break
        time.sleep(2)
    assert _value(text, "ray_titan_step", job=job) == 3.0, text[-3000:]
    assert _value(text, "ray_titan_loss", job=job) == pytest.approx(summary["final_loss"])
    assert _value(text, "ray_titan_tokens_per_s", job=job) > 0
    assert _value(text, "ray_titan_step_time_s", job=job) > 0
    rss = {(s, stat): _value(text, "ray_titan_stage_memory_bytes", job=job, stage=s, series="host_rss", stat=stat)
           for s in "01" for stat in ("min", "median", "max")}
    assert rss[("1", "max")] == 800 * MiB and rss[("1", "min")] == 700 * MiB and rss[("0", "max")] == 600 * MiB
    assert _value(text, "ray_titan_stage_memory_max_rank", job=job, stage="1", series="host_rss") == 3.0
    ray.kill(collector)
