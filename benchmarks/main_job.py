"""The benchmarks of the README's main job on CPU (``configs/debug_llama.toml``, the debug Llama):
each a function of the invocation's :class:`~benchmarks.sides.Bench` returning the table's rows.
``benchmarks.registry`` names them; ``python -m benchmarks.run NAME`` runs them.

- ``collector``: ray_titan with the metrics collector and per-step memory sampling vs the same
  run with ``metrics.enabled = false`` (pp=2 × dp_shard=2, 1F1B), and the CPU each process role takes.
- ``bare``: ray_titan with one worker vs a bare single-process PyTorch loop; host RSS of both.
- ``torchrun``: the same train loop under Ray vs under ``torchrun`` (dp_shard=2, 2 workers).
- ``ray_train``: ray_titan vs the loop of Ray Train's FSDP2 guide with ``ray.train.report``
  every step (dp_shard=4, 4 workers), and what each gets out.
- ``memory``: every rank's host-memory slopes after warm-up over a 600-step run on each C allocator.
- ``startup``: seconds from ``ray-titan train`` to the first step's console line, and the split.
- ``compile``: ``training.compile = true`` vs eager under torchrun: tokens/s, the first step's seconds.
- ``torchtitan``: ray_titan vs torchtitan 0.3.0 on the same shape, optimizer, schedule, batch and
  mesh, and on one process (``benchmarks/torchtitan_cpu.py``; needs the ``bench`` extra).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.harness import MEMORY_WARMUP, REPO, MiB, run_torchtitan
from benchmarks.sides import Bench, compare, run_bare, run_plain_ray_train, run_ray_titan, run_torchrun
from benchmarks.stats import Row, ratio_stats

__all__ = ["bench_bare", "bench_collector", "bench_compile", "bench_memory", "bench_ray_train", "bench_startup",
           "bench_torchrun", "bench_torchtitan", "memory_slopes", "worker_side_cost"]


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


def bench_torchtitan_ac(bench: Bench) -> list[Row]:
    """Step time under each activation-checkpointing mode, ray_titan vs torchtitan 0.3.0, both
    under torchrun on dp_shard = 2 (FSDP2) with the main job's model, batch and data: ``none``,
    ``full`` and selective ``op`` (torchtitan's ``SelectiveAC``, whose policy ray_titan's ``op``
    follows), and without AC once more against torchtitan with its q, k and v projections unfused
    (ray_titan's layout). Issue 41's "not slower on CPU" for the memory comparison's policies."""
    rows = []
    for mode in ("none", "full", "selective"):
        cfg = bench.job("torchtitan_ac", "--parallelism.pp=1", "--parallelism.dp_shard=2",
                        "--parallelism.microbatches=1", f"--activation_checkpoint.mode={mode}",
                        "--activation_checkpoint.selective_option=op")
        label = "selective op" if mode == "selective" else mode
        row, _, _ = compare(
            bench, f"vs torchtitan 0.3.0, AC {label} (dp_shard=2, fp32)",
            "ray_titan (torchrun)", lambda cfg=cfg: run_torchrun(bench, cfg),
            "torchtitan Trainer (torchrun, CPU shims)", lambda cfg=cfg: run_torchtitan(bench.work, cfg),
            "A/B ≥ 1.0", "", 2, cfg,
        )
        rows.append(row)
        if mode == "none":  # the share of torchtitan's fused q/k/v (its Llama 3 default) in the gap
            row, _, _ = compare(
                bench, "vs torchtitan 0.3.0 with q, k, v unfused, AC none (dp_shard=2, fp32)",
                "ray_titan (torchrun)", lambda cfg=cfg: run_torchrun(bench, cfg),
                "torchtitan Trainer, fuse_qkv=False", lambda cfg=cfg: run_torchtitan(bench.work, cfg, fuse_qkv=False),
                "", "the same projection layout on both sides (ray_titan's, as Hugging Face's)", 2, cfg,
            )
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

