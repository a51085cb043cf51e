"""The metrics' outputs at scale: one rank's history out of ``steps.parquet`` (``parquet_rank_history``)
and the driver's pre-flight and memory plan of a 16,384-rank job (``preflight_scale``).

:func:`synthetic_steps` makes a steps table with the real schema (``STEP_SCHEMA``) for any number of
ranks and steps, with planted outlier ranks; ``tests/integration/test_run_summary.py`` draws its
report from the same function.
"""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.stats import Row
from ray_titan.config.units import GiB, MiB

# The 16,384-rank job of issue 31 (Llama 3.1 70B on 16 stages × 128 FSDP shards × 8 TP ranks).
JOB_16K = ["--model.name=llama", "--model.flavor=3.1-70B", "--parallelism.pp=16", "--parallelism.dp_shard=128",
           "--parallelism.tp=8", "--parallelism.microbatches=16", "--training.global_batch_size=2048"]


def synthetic_mesh(ranks: int) -> tuple[int, int, int]:
    """``(pp, dp_shard, tp)`` of a synthetic run: 16 stages × 8 TP ranks when ``ranks`` allows
    (the 16K job's shape), else one stage of ``ranks`` data-parallel ranks."""
    if ranks % 128 == 0:
        return 16, ranks // 128, 8
    return 1, ranks, 1


def synthetic_steps(ranks: int, steps: int, *, memory_outliers: tuple[int, ...] = (),
                    time_outliers: tuple[int, ...] = (), first_step: int = 1, seed: int = 0) -> pa.Table:
    """A steps table (``ray_titan.metrics.schema.STEP_SCHEMA``, one row per step and rank, sorted
    by step then rank, as the collector's parts are) of a dense model on :func:`synthetic_mesh`:
    device memory that grows with the number of microbatches a stage holds under 1F1B (earlier
    stages more), warms up over 5 steps and then stays within ±0.2 %; step times of 1 s ± 1 %.
    ``memory_outliers`` hold 15 % more device memory than their stage, ``time_outliers`` take
    1.5× the step time: :func:`ray_titan.metrics.reading.run_summary.outlier_ranks` must name them."""
    rng = np.random.default_rng(seed)
    pp, dp_shard, tp = synthetic_mesh(ranks)
    n = ranks * steps
    rank = np.tile(np.arange(ranks, dtype=np.int64), steps)
    step = np.repeat(np.arange(first_step, first_step + steps, dtype=np.int64), ranks)
    stage = rank // (dp_shard * tp)
    warm = np.minimum(1.0, step / 5)
    dev = (30 * GiB + (pp - stage) * 1.5 * GiB * warm) * (1 + 0.002 * rng.standard_normal(n))
    dev[np.isin(rank, memory_outliers)] *= 1.15
    host = 6 * GiB * (1 + 0.002 * rng.standard_normal(n))
    step_time = 1.0 + 0.01 * rng.standard_normal(n)
    step_time[np.isin(rank, time_outliers)] *= 1.5
    last = stage == pp - 1
    loss = np.where(last, 2.0 + 8.0 / np.sqrt(step), np.nan)
    i64 = pa.int64()

    def ints(a: np.ndarray) -> pa.Array:
        return pa.array(a.astype(np.int64), i64)

    cols: dict[str, Any] = {
        "step": ints(step), "rank": ints(rank), "pp": ints(stage), "dp_replicate": ints(np.zeros(n)),
        "dp_shard": ints(rank // tp % dp_shard), "tp": ints(rank % tp), "ep": ints(np.zeros(n)),
        "is_last_stage": pa.array(last), "loss": pa.array(loss, from_pandas=True),
        "tokens": ints(np.where(last, 8192, 0)), "step_time_s": pa.array(step_time),
        "data_time_s": pa.array(0.01 * step_time), "fwd_bwd_time_s": pa.array(0.8 * step_time),
        "optim_time_s": pa.array(0.1 * step_time), "grad_norm": pa.array(np.full(n, 1.0)),
        "lr": pa.array(np.full(n, 3e-4)), "gc_pause_s": pa.array(np.zeros(n)),
        "time": pa.array(1.8e9 + step.astype(float)), "metrics_time_s": pa.array(np.full(n, 2e-4)),
        "host_rss_bytes": ints(host), "host_peak_rss_bytes": ints(host * 1.01),
        "host_heap_in_use_bytes": ints(host * 0.5), "host_heap_free_bytes": ints(host * 0.05),
        "host_available_bytes": ints(np.full(n, 1500 * GiB)),
        "device_allocated_bytes": ints(dev), "device_active_bytes": ints(dev),
        "device_reserved_bytes": ints(dev * 1.05), "device_peak_active_bytes": ints(dev * 1.2),
        "device_peak_reserved_bytes": ints(dev * 1.25), "device_alloc_retries": ints(np.zeros(n)),
        "device_ooms": ints(np.zeros(n)), "device_capacity_bytes": ints(np.full(n, 80 * GiB)),
        "memory_verdict": pa.array(np.where(step < 5, "warming_up", "stable")),
        "memory_slope_mib_per_step": pa.array(np.zeros(n)),
        "step_loss": pa.array(2.0 + 8.0 / np.sqrt(step)), "step_loss_max": pa.array(2.1 + 8.0 / np.sqrt(step)),
        "step_tokens": ints(np.full(n, 2048 * 8192)), "step_tokens_per_s": pa.array(2048 * 8192 / step_time),
        "skipped_update": pa.array(np.zeros(n, bool)), "attempt": ints(np.zeros(n)),
        "attempt_start_time": pa.array(np.full(n, 1.8e9)), "pid": ints(1000 + rank % 8),
        "node": pa.array(np.char.add("node-", (rank // 8).astype(str))), "world_size": ints(np.full(n, ranks)),
    }
    from ray_titan.metrics.schema import STEP_SCHEMA

    return pa.table([cols[f.name] if f.name in cols else pa.nulls(n, f.type) for f in STEP_SCHEMA],
                    schema=STEP_SCHEMA)


def write_synthetic_run(run_dir: Path, ranks: int, steps: int, steps_per_part: int = 50, **kw: Any) -> float:
    """Write :func:`synthetic_steps` as the collector does (a Parquet part every
    ``steps_per_part`` steps) and consolidate it with ``ParquetSink.close``; returns the seconds
    the consolidation took."""
    from ray_titan.metrics.collector.sinks.parquet import ParquetSink, _write_atomically

    sink = ParquetSink(run_dir / "metrics")
    for i, first in enumerate(range(1, steps + 1, steps_per_part)):
        part = synthetic_steps(ranks, min(steps_per_part, steps + 1 - first), first_step=first, seed=i, **kw)
        _write_atomically(part, sink.parts / f"part-{i:05d}.parquet")
    t0 = time.perf_counter()
    sink.close()
    return time.perf_counter() - t0


class _CountingFile(io.FileIO):
    """A file that counts the bytes read from it (what a reader really pulls from storage)."""

    bytes_read = 0

    def read(self, size: int = -1) -> bytes:  # type: ignore[override]
        data = super().read(size)
        self.bytes_read += len(data)
        return data

    def readinto(self, buffer: Any) -> int:  # type: ignore[override]
        n = super().readinto(buffer) or 0
        self.bytes_read += n
        return n


def measure_rank_read(path: Path, rank: int) -> dict[str, float]:
    """Bytes read, row groups touched and seconds for one rank's history (``rank_row_groups``,
    as ``read_rank_history`` reads it) and for the whole table, from one ``steps.parquet``."""
    from ray_titan.metrics.reading.steps import rank_row_groups

    out: dict[str, float] = {"file_bytes": path.stat().st_size}
    t0 = time.perf_counter()
    with _CountingFile(path) as f:
        pf = pq.ParquetFile(f)
        groups = rank_row_groups(pf.metadata, rank)
        t = pf.read_row_groups(groups)
        rows = int(np.count_nonzero(t["rank"].to_numpy() == rank))
        out.update(rank_s=time.perf_counter() - t0, rank_bytes=f.bytes_read, rank_groups=len(groups),
                   row_groups=pf.metadata.num_row_groups, rank_rows=rows)
    t0 = time.perf_counter()
    pq.read_table(path, filters=[("rank", "=", rank)])  # pyarrow's own pushdown, for comparison
    out["pushdown_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with _CountingFile(path) as f:
        pq.ParquetFile(f).read()
        out.update(all_s=time.perf_counter() - t0, all_bytes=f.bytes_read)
    return out


def bench_parquet_rank_history(work: Path, quick: bool) -> list[Row]:
    """One rank's history vs the whole table, at a few (ranks, steps) of about the same rows and
    at the largest this 2-core, 23 GiB machine holds comfortably (16,384 ranks × 500 steps)."""
    sizes = [(1024, 200), (16384, 20)] if quick else [(1024, 2000), (4096, 500), (16384, 125), (16384, 500)]
    rows = []
    for ranks, steps in sizes:
        run = work / f"rank_history_{ranks}x{steps}"
        consolidate_s = write_synthetic_run(run, ranks, steps)
        path = run / "metrics" / "steps.parquet"
        m = measure_rank_read(path, rank=ranks // 2 + 3)
        assert m["rank_rows"] == steps, m
        line = (f"parquet_rank_history ranks={ranks} steps={steps} file_mib={m['file_bytes'] / MiB:.0f} "
                f"consolidate_s={consolidate_s:.1f} one_rank: groups={m['rank_groups']:.0f}/{m['row_groups']:.0f} "
                f"read_mib={m['rank_bytes'] / MiB:.2f} s={m['rank_s']:.3f} (pushdown s={m['pushdown_s']:.3f}) "
                f"whole: read_mib={m['all_bytes'] / MiB:.0f} s={m['all_s']:.2f}")
        print(line, flush=True)
        rows.append(Row(f"steps.parquet, {ranks} ranks × {steps} steps", "one rank's history",
                        f"{m['rank_bytes'] / MiB:.2f} MiB, {m['rank_s'] * 1e3:.0f} ms", "whole table",
                        f"{m['all_bytes'] / MiB:.0f} MiB, {m['all_s']:.2f} s",
                        note=f"{m['rank_groups']:.0f} of {m['row_groups']:.0f} row groups", data=m))
        import shutil

        shutil.rmtree(run)
    return rows


def bench_preflight_scale(work: Path, quick: bool) -> list[Row]:
    """``ray-titan memory plan`` of :data:`JOB_16K` (a fresh process: imports included, as a user
    runs it), and in one process the pre-flight checks ``ray-titan train`` runs before Ray starts
    and the elastic range computation over ``ray.num_workers = [1, 16384]``."""
    import resource

    repeats = 1 if quick else 3
    plan_s, plan_cpu = [], []  # wall, and the process's CPU seconds (what a loaded machine inflates less)
    for _ in range(repeats):
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-m", "ray_titan", "memory", "plan", *JOB_16K], check=False,
                       capture_output=True)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        plan_s.append(time.perf_counter() - t0)
        plan_cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
    code = f"""
import time
t0 = time.perf_counter()
from ray_titan.config import load_config, merge_overrides
from ray_titan.preflight.checks import validate_job
from ray_titan.parallel.elastic import fitting_worker_counts
from ray_titan.preflight.memory_plan import memory_plan
t1 = time.perf_counter()
cfg = load_config(None, merge_overrides({JOB_16K!r} + ["--job.dump_folder={work / 'runs'}"]))
t2 = time.perf_counter(); cfg = validate_job(cfg, check_data=False); t3 = time.perf_counter()
memory_plan(cfg); t4 = time.perf_counter()
el = load_config(None, merge_overrides({JOB_16K!r} + ["--ray.num_workers=[1,16384]"]))
t5 = time.perf_counter(); counts = fitting_worker_counts(el); t6 = time.perf_counter()
print(t1 - t0, t3 - t2, t4 - t3, t6 - t5, len(counts))
"""
    runs = [subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
            for _ in range(repeats)]
    imports, pre, plan, elastic = (min(float(r[i]) for r in runs) for i in range(4))
    line = (f"preflight_scale ranks=16384 memory_plan_cli_s={min(plan_s):.2f} (max {max(plan_s):.2f}) "
            f"cpu_s={min(plan_cpu):.2f} "
            f"imports_s={imports:.2f} preflight_s={pre:.2f} plan_s={plan:.2f} "
            f"elastic_range_s={elastic:.4f} (fitting counts {runs[0][4]} of 1..16384)")
    print(line, flush=True)
    return [Row("ray-titan memory plan, 16,384 ranks", "wall (CPU), fresh process",
                f"{min(plan_s):.2f} s ({min(plan_cpu):.2f} s)", target="≤ 5 s",
                note=f"best of {repeats}; in-process: imports {imports:.2f} s, pre-flight {pre:.2f} s, "
                     f"plan {plan:.2f} s, elastic range {elastic * 1e3:.1f} ms")]
