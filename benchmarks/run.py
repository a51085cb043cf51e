"""Benchmark runner: ``python -m benchmarks.run [names] [--repeats N] [--quick] [--json PATH]``.

Names (default: every CPU benchmark, in this order):

- ``collector``: ray_titan with the metrics collector and per-step memory sampling vs the same
  run with ``metrics.enabled = false`` (main job mesh, pp=2 × dp_shard=2, 1F1B).
- ``bare``: ray_titan with one worker vs a bare single-process PyTorch loop; host RSS of both.
- ``torchrun``: the same train loop under Ray vs under ``torchrun`` (dp_shard=2, 2 workers).
- ``ray_train``: ray_titan vs the loop of Ray Train's FSDP2 guide with ``ray.train.report``
  every step (dp_shard=4, 4 workers), and what each gets out.
- ``memory``: every rank's host RSS, malloc in-use and leak-series slopes after warm-up over a
  600-step main job, on each C allocator (glibc's and jemalloc), and each rank's memory verdict.
- ``startup``: seconds from ``ray-titan train`` to the first step's console line, and the split
  (imports, cluster start, worker group, data + model build, first step, console).
- ``compile``: ``training.compile = true`` vs eager on the main job's mesh under torchrun:
  tokens/s, and the first step's seconds (which hold the compile). Not in the default set.
- ``torchtitan``: ray_titan's main job vs torchtitan 0.3.0 on the same model shape, optimizer,
  LR schedule, batch, microbatches and mesh (pp=2 × dp_shard=2, 1F1B), and on one process
  (``benchmarks/torchtitan_cpu.py``; needs the ``bench`` extra). Not in the default set.
- ``parquet_rank_history``: bytes, row groups and seconds to read one rank's history out of
  ``steps.parquet`` vs the whole table, up to 16,384 ranks (``benchmarks/metrics_scale.py``).
- ``preflight_scale``: ``ray-titan memory plan``, the pre-flight checks and the elastic range of a
  16,384-rank job (``benchmarks/metrics_scale.py``).
- ``collector_scale``: the metrics path at 1,024 / 4,096 / 16,384 simulated ranks through real Ray
  calls: collector CPU per rank report, p99 lag to disk, RSS, dropped reports
  (``benchmarks/collector_scale.py``, which also runs alone with its own flags). Not in the default set.
- ``gpu``: the first-contact run on one CUDA GPU, alone and without Ray:
  ``python -m benchmarks.run gpu --out DIR [--deadline SECONDS] [--device cuda|cpu] [--small]``
  (``benchmarks/gpu.py``: staged processes under one deadline, every fact streamed to
  ``DIR/facts.jsonl``). Not in the default set, nor in ``all``.

Every comparison runs both sides alternately in this one invocation (A B, B A, ...) and reports
the median of the paired ratios with min and max (``benchmarks/stats.py``). Tokens/s is measured
on the workers over the steps after :data:`ray_titan.metrics.worker.timing.WARMUP_STEPS`, so process
and cluster start-up are excluded (they are the ``startup`` benchmark). Every baseline process
and plain Ray Train's workers run the C allocator ray_titan gives its workers
(``memory.allocator``, jemalloc by default; :func:`baseline_env`), so no ratio credits or
charges ray_titan for malloc. MFU uses
``ray_titan/metrics/flops.py``; on CPU the peak is the measured single-thread matmul FLOP/s ×
the CPU threads the job can use (workers × threads each, at most the machine's cores).

Prints a Markdown table and writes everything measured as JSON (default
``outputs/benchmarks/benchmarks-<UTC time>.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.cpu import CPUSampler
from benchmarks.harness import (
    MEMORY_WARMUP,
    REPO,
    baseline_env,
    flops_per_token,
    job_config,
    run_torchtitan,
    tokens_per_s,
)
from benchmarks.harness import subprocess_flags as _flags
from benchmarks.stats import Row, alternate, fmt_si, format_table, ratio_stats

CPU_NAMES = ["collector", "bare", "torchrun", "ray_train", "memory", "startup"]
ALL_NAMES = [*CPU_NAMES, "compile", "torchtitan", "collector_scale", "parquet_rank_history",
             "preflight_scale", "dry_run_matrix", "dry_run_flavors"]
MiB = 2**20

# Steps per run, (full, --quick). Long enough that the steady part dwarfs timer noise.
STEPS = {
    "collector": (120, 12), "ray_train": (10, 8), "bare": (50, 12), "torchrun": (40, 12),
    "memory": (600, 40), "startup": (2, 2),
    "compile": (40, 8), "torchtitan": (40, 8), "collector_scale": (200, 20),
    "parquet_rank_history": (500, 20), "preflight_scale": (0, 0),  # steps of the 16,384-rank table; none
    "dry_run_matrix": (2, 2),  # simulated steps per rank
    "dry_run_flavors": (2, 2),
}


# -- plumbing ------------------------------------------------------------------------------------
class Bench:
    """Shared state of one invocation: the work directory, the Ray cluster, the job template."""

    def __init__(self, work: Path, repeats: int, quick: bool):
        self.work, self.repeats, self.quick = work, repeats, quick
        self.user_env = dict(os.environ)
        self._ray = False

    def steps(self, name: str) -> int:
        return STEPS[name][1 if self.quick else 0]

    def job(self, name: str, *overrides: str):
        """The README's main job with ``overrides`` (:func:`benchmarks.harness.job_config`)."""
        return job_config(self.work, name, self.steps(name), *overrides)

    def ray(self) -> None:
        """One local Ray cluster for the whole invocation (started on first use)."""
        from ray_titan.driver import init_local_cluster

        if not self._ray:  # as `ray-titan train` starts it (the dashboard included)
            init_local_cluster(os.cpu_count() or 1, log_to_driver=False, _temp_dir=str(self.work / "ray"))
            self._ray = True

    def shutdown_ray(self) -> None:
        import ray

        if self._ray:
            ray.shutdown()
            self._ray = False


def rank_summaries(timings: dict[str, dict]) -> list[dict[str, Any]]:
    return [v for k, v in sorted(timings.items()) if k.startswith("rank")]


def run_ray_titan(bench: Bench, cfg, cpu: bool = False) -> dict[str, Any]:
    """``ray_titan.train(cfg)`` on the shared cluster; its console output is kept, not printed.
    ``cpu``: also ``cpu_cores``, each process role's CPU cores (CPU seconds per wall second) over
    the steady window (``benchmarks.cpu``; a thread reading ``/proc`` in this process, so only
    where both sides of a comparison run it)."""
    import ray_titan

    bench.ray()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.ExitStack() as stack:
        sampler = stack.enter_context(CPUSampler()) if cpu else None
        result = ray_titan.train(cfg)
    ranks = rank_summaries(result.timings)
    run = {
        "tokens_per_s": tokens_per_s(cfg, ranks),
        "rss_bytes": [r["host_rss_bytes"] for r in ranks],
        "peak_rss_bytes": [r["host_peak_rss_bytes"] for r in ranks],
        "metric_rows": result.steps.num_rows,
        "metric_columns": result.steps.num_columns,
        "run_dir": str(result.run_dir),
        "result": result,
    }
    if sampler is not None:
        # From a second after the first step (the steady window starts after step 2) to the last.
        t0 = max(r["marks"]["step1_end"] for r in ranks) + 1.0
        t1 = min(r["marks"]["last_step_end"] for r in ranks)
        try:
            secs, wall = sampler.cpu_by_role(t0, t1)
        except ValueError:  # a run too short for two samples (--quick)
            secs, wall = {}, 1.0
        run["cpu_cores"] = {role: v / wall for role, v in secs.items()}
    return run


def run_torchrun(bench: Bench, cfg) -> dict[str, Any]:
    """The train loop under ``torchrun --nproc-per-node=<mesh>`` (no Ray). With
    ``training.compile`` each run gets an empty inductor cache, so every run pays the compile."""
    from ray_titan.config import merge_overrides
    from ray_titan.metrics.worker.timing import read_timings

    dump = bench.work / "runs" / f"torchrun-{time.time_ns()}"
    env = {**baseline_env(cfg), "TORCHINDUCTOR_CACHE_DIR": str(dump.with_name(dump.name + "-inductor"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.world_size}",
           "-m", "ray_titan.launch", "--config", str(REPO / "configs" / "debug_llama.toml"),
           *merge_overrides(_flags(cfg), [f"--job.dump_folder={dump}"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"torchrun failed: {proc.stderr[-3000:]}")
    (run_dir,) = dump.glob("*")
    ranks = rank_summaries(read_timings(run_dir))
    return {"tokens_per_s": tokens_per_s(cfg, ranks), "rss_bytes": [r["host_rss_bytes"] for r in ranks],
            "first_step_s": max(r["marks"]["step1_end"] - r["marks"]["model_built"] for r in ranks)}


def run_bare(bench: Bench, cfg) -> dict[str, Any]:
    """The bare PyTorch loop in a process of its own."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.baselines", "--config-json", cfg.model_dump_json()],
        capture_output=True, text=True, cwd=REPO, env=baseline_env(cfg),
    )
    if proc.returncode:
        raise RuntimeError(f"bare PyTorch loop failed: {proc.stderr[-3000:]}")
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"tokens_per_s": tokens_per_s(cfg, [s]), "rss_bytes": [s["host_rss_bytes"]],
            "peak_rss_bytes": [s["host_peak_rss_bytes"]]}


def run_plain_ray_train(bench: Bench, cfg) -> dict[str, Any]:
    """The Ray Train guide's FSDP2 loop on ``cfg.world_size`` workers (same CPU share each as
    ray_titan gives its workers)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from benchmarks.baselines import plain_ray_train_loop
    from ray_titan.allocator import worker_env_vars

    bench.ray()
    n = cfg.world_size
    cpus = min(1.0, round(ray.cluster_resources().get("CPU", 1) / n, 3))
    out_dir = bench.work / "runs" / f"plain_ray_train-{time.time_ns()}"
    trainer = TorchTrainer(
        plain_ray_train_loop,
        train_loop_config={"job": cfg.model_dump(), "out_dir": str(out_dir / "ranks")},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=n, resources_per_worker={"CPU": cpus}),
        run_config=RunConfig(name=out_dir.name, storage_path=str(out_dir / "ray_train"),
                             failure_config=FailureConfig(controller_failure_limit=0),
                             worker_runtime_env={"env_vars": worker_env_vars(cfg.memory.allocator)}),
    )
    with contextlib.redirect_stdout(io.StringIO()):
        result = trainer.fit()
    ranks = [json.loads(p.read_text()) for p in sorted((out_dir / "ranks").glob("rank*.json"))]
    return {
        "tokens_per_s": tokens_per_s(cfg, ranks),
        "rss_bytes": [r["host_rss_bytes"] for r in ranks],
        # Ray Train V2 keeps rank 0's metrics, and only those reported with a checkpoint.
        "metrics_seen_by_driver": result.metrics,
        "metrics_dataframe_rows": 0 if result.metrics_dataframe is None else len(result.metrics_dataframe),
    }


_PEAK_PER_THREAD: list[float] = []


def measure_cpu_peak() -> float:
    """Measure the single-thread fp32 matmul peak again; the best measurement so far is used."""
    from ray_titan.metrics.flops import measure_matmul_peak_flops

    _PEAK_PER_THREAD.append(measure_matmul_peak_flops("cpu", n=1024, repeats=10, threads=1))
    return max(_PEAK_PER_THREAD)


def peak_flops_cpu(threads: int) -> float:
    """Best measured single-thread fp32 matmul peak × ``threads`` (at most the machine's cores)."""
    per_thread = max(_PEAK_PER_THREAD) if _PEAK_PER_THREAD else measure_cpu_peak()
    return per_thread * min(threads, os.cpu_count() or 1)


def add_mfu(rows: list[Row]) -> None:
    """Append MFU to the tokens/s of comparison rows, with the best CPU peak measured in the
    whole invocation (so a peak measured at a busy moment does not inflate MFU)."""
    for r in rows:
        m = r.data.get("mfu_inputs")
        if not m:
            continue
        peak = peak_flops_cpu(m["threads"])
        r.data["mfu"] = {"a": m["tps_a"] * m["flops_per_token"] / peak, "b": m["tps_b"] * m["flops_per_token"] / peak,
                         "peak_flops": peak}
        r.a_value += f" (MFU {100 * r.data['mfu']['a']:.1f}%)"
        r.b_value += f" (MFU {100 * r.data['mfu']['b']:.1f}%)"


def _timed(fn):
    def run():
        t0 = time.time()
        out = fn()
        out["wall_s"] = time.time() - t0
        return out
    return run


def compare(bench: Bench, name: str, a_label: str, run_a, b_label: str, run_b, target: str,
            note: str, workers: int, cfg) -> tuple[Row, list, list]:
    a, b = alternate(_timed(run_a), _timed(run_b), bench.repeats)
    st = ratio_stats([x["tokens_per_s"] for x in a], [x["tokens_per_s"] for x in b])
    row = Row(name, a_label, fmt_si(st.median_a, "tok/s"), b_label, fmt_si(st.median_b, "tok/s"), st,
              target, note, data={"a": _jsonable(a), "b": _jsonable(b), "stats": st.as_dict(), "mfu_inputs": {
                  "tps_a": st.median_a, "tps_b": st.median_b, "flops_per_token": flops_per_token(cfg),
                  "threads": workers * (cfg.training.threads_per_worker or 1)}})
    return row, a, b


def _jsonable(runs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "result"} for r in runs]


# -- the benchmarks ------------------------------------------------------------------------------
def bench_collector(bench: Bench) -> list[Row]:
    on = bench.job("collector")
    off = bench.job("collector", "--metrics.enabled=false")
    row, a, b = compare(
        bench, "collector overhead (pp=2 × dp_shard=2, 1F1B, 4 workers)",
        "collector + memory sampling", lambda: run_ray_titan(bench, on, cpu=True),
        "metrics.enabled=false", lambda: run_ray_titan(bench, off, cpu=True),
        "A/B ≥ 0.99", "ratio of tokens/s; 1 − ratio is the overhead", 4, on,
    )
    # The worker-side cost, as the runs recorded it: every step's metrics_time_s on every rank.
    c = row.data["per_step_cost"] = worker_side_cost(a)
    row.note += (f"; worker-side cost per step (the runs' metrics_time_s: mean {c['per_step_us']:.0f} µs, "
                 f"median {c['median_us']:.0f} µs) = "
                 f"{100 * c['fraction_of_step']:.2f}% of the median step")
    # The CPU the other processes take, per role, median over repetitions: steadier than tokens/s.
    roles = sorted({r for x in a + b for r in x["cpu_cores"]} | {"collector actor", "driver", "ray system"})
    med = {side: {r: statistics.median(x["cpu_cores"].get(r, 0.0) for x in runs) for r in roles}
           for side, runs in (("a", a), ("b", b))}
    extra = {r: med["a"][r] - med["b"][r] for r in ("collector actor", "driver", "ray system")}
    row.data["cpu_cores"] = {**med, "a_minus_b": extra}
    cores = os.cpu_count() or 1
    row.note += ("; CPU beside the workers, A − B (median cores): " +
                 ", ".join(f"{r} {v:+.4f}" for r, v in extra.items()) +
                 f" = {100 * sum(extra.values()) / cores:.2f}% of the machine's {cores} cores")
    return [row]


def worker_side_cost(runs: list[dict[str, Any]]) -> dict[str, float]:
    """What sampling memory and reporting cost the workers, from the runs' own ``metrics_time_s``
    column (each step's figure is the previous step's cost, wall seconds on the worker): the mean
    over every step and rank of every run (a cost adds up: the steps that make the Ray call, one a
    second, cost ~30 × the others) and its fraction of the median ``step_time_s``."""
    costs, steps = [], []
    for run in runs:
        t = run["result"].steps
        costs += [c for c in t["metrics_time_s"].to_pylist() if c is not None]
        steps.append(statistics.median(t["step_time_s"].to_pylist()))
    per, step = statistics.fmean(costs), statistics.median(steps)
    return {"per_step_us": per * 1e6, "median_us": statistics.median(costs) * 1e6,
            "median_step_s": step, "fraction_of_step": per / step}


def bench_ray_train(bench: Bench) -> list[Row]:
    cfg = bench.job("ray_train", "--parallelism.pp=1", "--parallelism.dp_shard=4",
                    "--parallelism.microbatches=1")
    row, a, b = compare(
        bench, "vs plain Ray Train (FSDP2, dp_shard=4, 4 workers)",
        "ray_titan", lambda: run_ray_titan(bench, cfg),
        "Ray Train guide loop, report() every step", lambda: run_plain_ray_train(bench, cfg),
        "", "", 4, cfg,
    )
    row.note = (
        f"out of the run: ray_titan {a[0]['metric_rows']} rows (steps × ranks) × {a[0]['metric_columns']} "
        f"columns (every step's last-stage loss, every rank's timings and memory) in Parquet and "
        f"TensorBoard; the plain loop's Result.metrics = {b[0]['metrics_seen_by_driver']}, "
        f"metrics_dataframe rows = {b[0]['metrics_dataframe_rows']} (Ray Train V2 keeps only rank 0's "
        "metrics reported with a checkpoint, so per-step metrics without checkpoints are dropped)"
    )
    return [row]


def bench_bare(bench: Bench) -> list[Row]:
    cfg = bench.job("bare", "--parallelism.pp=1", "--parallelism.dp_shard=1", "--parallelism.microbatches=1")
    row, a, b = compare(
        bench, "vs bare PyTorch (1 worker, 1 thread)",
        "ray_titan, 1 Ray worker", lambda: run_ray_titan(bench, cfg),
        "single-process PyTorch loop", lambda: run_bare(bench, cfg),
        "A/B ≥ 0.97", "", 1, cfg,
    )
    rss = ratio_stats([x["rss_bytes"][0] for x in a], [x["rss_bytes"][0] for x in b])
    mem = Row("host RSS at the end (1 worker vs bare process)", "ray_titan worker",
              f"{rss.median_a / MiB:.0f} MiB", "bare PyTorch process", f"{rss.median_b / MiB:.0f} MiB",
              rss, "", "the worker also holds Ray's core worker and the driver-side imports",
              data={"stats": rss.as_dict()})
    return [row, mem]


def bench_torchrun(bench: Bench) -> list[Row]:
    cfg = bench.job("torchrun", "--parallelism.pp=1", "--parallelism.dp_shard=2")
    row, _, _ = compare(
        bench, "Ray overhead (same train loop, dp_shard=2, 2 workers)",
        "under Ray (ray_titan.train)", lambda: run_ray_titan(bench, cfg),
        "under torchrun (python -m ray_titan.launch)", lambda: run_torchrun(bench, cfg),
        "A/B ≥ 0.98", "both with the collector (torchrun: per-rank JSONL, assembled at the end)", 2, cfg,
    )
    # The cause found: Ray starts its workers at niceness 15, torchrun's run at 0.
    ray_nice = bench.job("torchrun", "--parallelism.pp=1", "--parallelism.dp_shard=2", "--ray.worker_nice=15")
    nice_row, _, _ = compare(
        bench, "worker niceness under Ray (same loop, dp_shard=2, 2 workers)",
        "ray.worker_nice = 0 (default)", lambda: run_ray_titan(bench, cfg),
        "Ray's niceness (ray.worker_nice = 15)", lambda: run_ray_titan(bench, ray_nice),
        "", "what resetting the niceness Ray starts workers at gains", 2, cfg,
    )
    return [row, nice_row]


def bench_torchtitan(bench: Bench) -> list[Row]:
    """ray_titan (under Ray, collector and per-step memory on) vs torchtitan 0.3.0 on the main
    job's model shape, optimizer, LR schedule, batch, microbatches and mesh, and on one process."""
    rows = []
    for label, workers, flags in (
        ("pp=2 × dp_shard=2, 1F1B, 4 microbatches, 4 workers", 4, []),
        ("one process", 1, ["--parallelism.pp=1", "--parallelism.dp_shard=1", "--parallelism.microbatches=1"]),
    ):
        cfg = bench.job("torchtitan", *flags)
        row, a, b = compare(
            bench, f"vs torchtitan 0.3.0 ({label}, fp32, no AC)",
            "ray_titan (Ray, collector + memory)", lambda cfg=cfg: run_ray_titan(bench, cfg),
            "torchtitan Trainer (torchrun, CPU shims)", lambda cfg=cfg: run_torchtitan(bench.work, cfg),
            "A/B ≥ 1.0", "", workers, cfg,
        )
        losses = {r: [round(x, 4) for x in v] for r, v in b[0]["logged_losses"].items()}
        steps = a[0]["result"].steps.sort_by("step")
        ours = [round(x, 4) for x in steps["step_loss"].drop_null().to_pylist()[:1]]
        row.note = (f"out of the run: ray_titan {a[0]['metric_rows']} rows (steps × ranks) × "
                    f"{a[0]['metric_columns']} columns in Parquet and TensorBoard, step-1 loss {ours}; "
                    f"torchtitan logs at step 1 and every {cfg.metrics.log_freq} steps per rank: rank 0 "
                    f"{losses[0]}, last rank {losses[max(losses)]}"
                    + (" (rank 0 holds the first stage: a placeholder loss)" if cfg.parallelism.pp > 1 else "")
                    + "; weights initialised differently (each trainer its own init), same data")
        rows.append(row)
    return rows


def bench_compile(bench: Bench) -> list[Row]:
    """``training.compile`` vs eager on the main job's mesh under torchrun (no Ray: the compile
    is the subject): steady tokens/s, and the first step's seconds, which hold the compile."""
    eager = bench.job("compile", "--job.name=eager")
    compiled = bench.job("compile", "--training.compile=true")
    row, a, b = compare(
        bench, "torch.compile (pp=2 × dp_shard=2, 1F1B, 4 workers, torchrun)",
        "training.compile = true", lambda: run_torchrun(bench, compiled),
        "eager", lambda: run_torchrun(bench, eager),
        "", "", 4, eager,
    )
    first = ratio_stats([x["first_step_s"] for x in a], [x["first_step_s"] for x in b])
    extra = first.median_a - first.median_b
    # Seconds saved per step at the steady rates; the compile is paid back after extra / saved steps.
    tokens_per_step = eager.training.global_batch_size * eager.training.seq_len
    assert row.stats is not None
    saved = tokens_per_step * (1 / row.stats.median_b - 1 / row.stats.median_a)
    pays = f"pays after ~{extra / saved:.0f} steps" if saved > 0 else "never pays at this size (not faster)"
    rows = [row, Row("  first step (holds the compile), compiled vs eager", "compiled",
                     f"{first.median_a:.1f} s", "eager", f"{first.median_b:.2f} s", first,
                     note=f"compile costs ~{extra:.0f} s once per run (private inductor cache per run: "
                          f"cold); {pays}", data={"stats": first.as_dict()})]
    return rows


def memory_slopes(table, first: int) -> dict[str, dict[int, float]]:
    """Per series (host RSS, malloc in-use, the leak verdict's host series) and rank, the
    Theil–Sen slope in bytes per step over the steps after ``first``. ``table``: a run's steps."""
    import pyarrow.compute as pc

    from ray_titan.metrics.collector.leak import SERIES_NAMES, host_series, theil_sen_slope

    series = {  # the verdict's host series leaves out the free bytes malloc keeps (metrics/leak.py)
        SERIES_NAMES["host_rss"]: lambda r: r["host_rss_bytes"],
        "malloc in-use": lambda r: r["host_heap_in_use_bytes"],
        SERIES_NAMES["host"]: lambda r: host_series(r["host_rss_bytes"], r["host_heap_free_bytes"])[0],
    }
    out: dict[str, dict[int, float]] = {name: {} for name in series}
    for rank in sorted(set(table["rank"].to_pylist())):
        rows = [r for r in table.filter(pc.equal(table["rank"], rank)).sort_by("step").to_pylist() if r["step"] > first]
        for name, value in series.items():
            pts = [(r["step"], value(r)) for r in rows if value(r) is not None]
            if len(pts) > 1:
                pts = pts[::max(1, len(pts) // 250)]  # every pair of ~250 samples: fast enough
                out[name][rank] = theil_sen_slope([p[0] for p in pts], [p[1] for p in pts])
    return out


def bench_memory(bench: Bench) -> list[Row]:
    """The main job on each C allocator: every rank's slopes after warm-up, per 100 steps."""
    steps = bench.steps("memory")
    first = min(MEMORY_WARMUP, steps // 2)
    rows = []
    for allocator in ("system", "jemalloc"):
        cfg = bench.job("memory", f"--metrics.log_freq={steps}", f"--memory.allocator={allocator}",
                        "--memory.breakdown_step=2")  # the default run: its profiled step included
        run = run_ray_titan(bench, cfg)
        result = run["result"]
        used = {r["allocator"] for k, r in result.timings.items() if k.startswith("rank")}
        verdicts = {r: v["verdict"] for r, v in result.memory_verdicts.items()}
        for name, slopes in memory_slopes(result.steps, first).items():
            text = " ".join(f"r{r}:{v * 100 / MiB:+.2f}" for r, v in slopes.items()) or "unmeasured"
            target = {"host RSS": "< 1", "malloc in-use": "< 0.2"}.get(name, "")
            rows.append(Row(
                f"{name} slope, steps {first + 1}-{steps} ({'/'.join(sorted(used))} malloc, pp=2 × dp_shard=2)",
                "MiB per 100 steps", text, target=target,
                note=f"Theil–Sen slope of every rank's {name} recorded at every step; verdicts {verdicts}",
                data={"slope_bytes_per_step": slopes, "steps": steps, "allocator": allocator,
                      "run_dir": run["run_dir"], "verdicts": verdicts},
            ))
    return rows


def bench_startup(bench: Bench) -> list[Row]:
    """``ray-titan train`` as a user runs it (a fresh local cluster with the dashboard), ``repeats``
    times (at most 3: each is a whole cluster's start); the split shows where the seconds go."""
    from ray_titan.metrics.worker.timing import read_timings

    bench.shutdown_ray()
    runs = []
    for i in range(min(3, bench.repeats)):
        dump = bench.work / "runs" / f"startup-{i}"
        cmd = [sys.executable, "-m", "ray_titan", "train", f"--training.steps={bench.steps('startup')}",
               "--metrics.log_freq=1", f"--job.dump_folder={dump}"]
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=REPO, env=bench.user_env)
        first_line = None
        output = []
        for line in proc.stdout:
            output.append(line)
            if first_line is None and re.match(r"step\s+1/", line):
                first_line = time.time()
        proc.wait()
        t_exit = time.time()
        if proc.returncode or first_line is None:
            raise RuntimeError("ray-titan train failed:\n" + "".join(output[-40:]))
        (run_dir,) = dump.glob("*")
        tim = read_timings(run_dir)
        d = tim["driver"]["marks"]
        ranks = [v["marks"] for k, v in tim.items() if k.startswith("rank")]
        split = {
            "imports and config (command → train())": d["train_called"] - t0,
            "cluster start (ray.init, local)": d["cluster_ready"] - d["train_called"],
            "run dir + collector actor": d["fit_called"] - d["cluster_ready"],
            "worker group (TorchTrainer.fit → train function on every worker)":
                max(r["worker_start"] for r in ranks) - d["fit_called"],
            "  of it: TorchTrainer.fit → last worker process created (Ray Train's controller and actors)":
                max(r.get("process_start", d["fit_called"]) for r in ranks) - d["fit_called"],
            "  of it: worker process → train function (Ray's worker, Ray Train's set-up, imports; slowest)":
                max(r.get("train_fn_entry", r["worker_start"]) - r.get("process_start", r["worker_start"])
                    for r in ranks),
            "data + model build (slowest rank)":
                max(r["model_built"] for r in ranks) - max(r["worker_start"] for r in ranks),
            "first step": max(r["step1_end"] for r in ranks) - max(r["model_built"] for r in ranks),
            "collector → console line": first_line - max(r["step1_end"] for r in ranks),
        }
        # CPU seconds a worker spends before its train function: on a machine with fewer cores
        # than workers, these (× workers ÷ cores) bound the worker group's start from below.
        cpu = [v["cpu_s"]["before_train_fn"] for k, v in tim.items() if k.startswith("rank") and "cpu_s" in v]
        runs.append({"total_to_first_line_s": first_line - t0, "total_to_exit_s": t_exit - t0, "split_s": split,
                     "worker_cpu_before_train_fn_s": cpu})
    med = statistics.median(r["total_to_first_line_s"] for r in runs)
    rows = [Row("start-up: `ray-titan train` → first step's console line", "seconds (median)",
                f"{med:.1f} s", note=f"{len(runs)} runs; exit after {bench.steps('startup')} steps at "
                f"{statistics.median(r['total_to_exit_s'] for r in runs):.1f} s", data={"runs": runs})]
    for part in runs[0]["split_s"]:
        v = statistics.median(r["split_s"][part] for r in runs)
        rows.append(Row(f"  start-up split: {part}", "seconds (median)", f"{v:.2f} s"))
    if cpu := [c for r in runs for c in r["worker_cpu_before_train_fn_s"]]:
        rows.append(Row("  worker CPU before the train function", "CPU seconds per worker",
                        f"{statistics.median(cpu):.2f} s", note=f"median of {len(cpu)} workers over {len(runs)} runs, "
                        f"{sum(cpu) / len(runs):.1f} s per run on {os.cpu_count()} cores"))
    return rows


def bench_collector_scale(bench: Bench) -> list[Row]:
    """The metrics path at 1,024 / 4,096 / 16,384 simulated ranks (``benchmarks/collector_scale.py``;
    --quick: 1,024 ranks, 20 steps). Not in the default set; its own flags choose sizes and steps."""
    from benchmarks import collector_scale

    bench.ray()
    sizes, steps = ((1024,) if bench.quick else collector_scale.SIZES), bench.steps("collector_scale")
    return [Row(f"collector_scale ranks={m['ranks']}", "µs of collector CPU per rank report",
                f"{m['us_per_rank_report']:.1f}", target="≤ 25 µs at 16,384 ranks, p99 lag ≤ 2 s, nothing dropped",
                note=f"lag p99 {m['lag_p99_s']:.2f} s, RSS {m['rss_mib'][0]:.0f}→{m['rss_mib'][1]:.0f} MiB, "
                     f"dropped {m['dropped']}, {m['steps']} steps at 1/s, path {m['path']}", data=m)
            for m in collector_scale.run(sizes, steps)]


def _metrics_scale():
    from benchmarks import metrics_scale  # numpy and pyarrow: imported by the benchmarks that use them

    return metrics_scale


def _dry_run_matrix():
    from benchmarks import dry_run_matrix

    return dry_run_matrix


BENCHMARKS = {
    "startup": bench_startup, "collector": bench_collector, "ray_train": bench_ray_train,
    "bare": bench_bare, "torchrun": bench_torchrun, "memory": bench_memory,
    "compile": bench_compile, "torchtitan": bench_torchtitan, "collector_scale": bench_collector_scale,
    "parquet_rank_history": lambda b: _metrics_scale().bench_parquet_rank_history(b.work, b.quick),
    "preflight_scale": lambda b: _metrics_scale().bench_preflight_scale(b.work, b.quick),
    "dry_run_matrix": lambda b: _dry_run_matrix().rows_for_runner(b.quick),
    "dry_run_flavors": lambda b: _dry_run_matrix().rows_for_runner(b.quick, flavors=True),
}


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import torch

    try:
        import ray
        ray_version = ray.__version__
    except ImportError:
        ray_version = None

    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    out = {
        "cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem / 2**30, 1),
        "python": platform.python_version(), "torch": torch.__version__, "ray": ray_version,
        "load_average": os.getloadavg(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the named benchmarks (``gpu``: :func:`benchmarks.gpu.main`, alone, with its own flags);
    returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu"]:  # the first-contact GPU run: its own flags, no Ray, nothing imported here first
        from benchmarks import gpu

        return gpu.main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"benchmarks to run (default: {' '.join(CPU_NAMES)}; also: all; "
                    "`gpu` alone: see benchmarks/gpu.py)")
    ap.add_argument("--repeats", type=int, default=3, help="repetitions per comparison (default 3)")
    ap.add_argument("--quick", action="store_true",
                    help="few steps and 2 repetitions: checks the runner, not the figures")
    ap.add_argument("--json", type=Path, default=None, help="where to write the results")
    args = ap.parse_args(argv)
    names = args.names or CPU_NAMES
    if names == ["all"]:
        names = ALL_NAMES
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; valid: {ALL_NAMES} or all")
    repeats = 2 if args.quick and args.repeats == 3 else args.repeats
    # A private local cluster for the in-process runs, like the test suite's.
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    user_env = dict(os.environ)  # `startup` runs ray-titan in the user's own environment
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    work = Path(tempfile.mkdtemp(prefix="rt_bench_", dir="/tmp"))
    bench = Bench(work, repeats, args.quick)
    bench.user_env = user_env
    started = datetime.now(UTC)
    info = {"started_utc": started.isoformat(timespec="seconds"), "machine": machine(),
            "repeats": repeats, "quick": args.quick, "steps": {n: bench.steps(n) for n in names}}
    rows: list[Row] = []
    results: dict[str, Any] = {}
    cpu_runs = any(n in CPU_NAMES for n in names)
    if cpu_runs:
        measure_cpu_peak()
    try:
        for name in names:
            t0 = time.time()
            print(f"[benchmarks] {name} ...", file=sys.stderr, flush=True)
            try:
                new = BENCHMARKS[name](bench)
            except Exception as e:  # one broken benchmark must not lose the others' figures
                new = [Row(name, "failed", f"{type(e).__name__}: {str(e)[:300]}")]
            rows += new
            results[name] = {"seconds": time.time() - t0, "rows": new}
            # Each benchmark's rows as soon as they exist, so an interrupted run keeps them.
            print(f"[benchmarks] {name} done in {time.time() - t0:.0f} s\n{format_table(new)}",
                  file=sys.stderr, flush=True)
    finally:
        bench.shutdown_ray()
    if cpu_runs:
        measure_cpu_peak()
        add_mfu(rows)
    info["finished_utc"] = datetime.now(UTC).isoformat(timespec="seconds")
    info["load_average_end"] = os.getloadavg()
    m = info["machine"]
    print(f"\nMachine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; Python {m['python']}, "
          f"torch {m['torch']}, Ray {m['ray']}; GPU: {m['gpu'] or 'none'}; load average at start "
          f"{m['load_average'][0]:.2f}, at end {info['load_average_end'][0]:.2f}; {repeats} repetitions; "
          f"{info['started_utc']} → {info['finished_utc']}\n")
    if _PEAK_PER_THREAD:
        info["cpu_matmul_peak_flops_per_thread"] = _PEAK_PER_THREAD
        print(f"CPU peak for MFU: {fmt_si(max(_PEAK_PER_THREAD), 'FLOP/s')} per thread (best fp32 "
              f"1024³ matmul on 1 thread, measured before and after) × threads the job can use\n")
    print(format_table(rows))
    path = args.json or REPO / "outputs" / "benchmarks" / f"benchmarks-{started:%Y%m%d-%H%M%S}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    for res in results.values():
        res["rows"] = [_row_json(r) for r in res["rows"]]
    path.write_text(json.dumps({"info": info, "results": results}, indent=1, default=str))
    print(f"\nJSON: {path}")
    return 0


def _row_json(r: Row) -> dict[str, Any]:
    d = {k: v for k, v in dataclasses.asdict(r).items() if k != "stats"}
    d["stats"] = r.stats.as_dict() if r.stats else None
    return d


if __name__ == "__main__":
    sys.exit(main())
