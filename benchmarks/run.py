"""Benchmark runner: ``python -m benchmarks.run [names] [--repeats N] [--quick] [--json PATH]``.

Runs the named benchmarks (default: the default set; ``all``: every one) of
``benchmarks/registry.py``, listed below; how to run each, what it prints and how long it takes:
docs/benchmarks.md. ``python -m benchmarks.run gpu --out DIR [--deadline SECONDS] [--device
cuda|cpu] [--small]`` is the first-contact run on one CUDA GPU, alone and without Ray
(``benchmarks/gpu.py``: staged processes under one deadline, every fact streamed to
``DIR/facts.jsonl``).

Every comparison runs both sides alternately in this one invocation (A B, B A, ...) and reports
the median of the paired ratios with min and max (``benchmarks/stats.py``). Tokens/s is measured
on the workers over the steps after :data:`ray_titan.metrics.worker.timing.WARMUP_STEPS`, so process
and cluster start-up are excluded (they are the ``startup`` benchmark). Every baseline process
and plain Ray Train's workers run the C allocator ray_titan gives its workers
(``memory.allocator``; ``benchmarks.harness.baseline_env``), so no ratio credits or charges
ray_titan for malloc. MFU uses ``ray_titan/metrics/flops.py``; on CPU the peak is the measured
single-thread matmul FLOP/s × the CPU threads the job can use (workers × threads each, at most
the machine's cores).

Prints a Markdown table and writes everything measured as JSON (default
``outputs/benchmarks/benchmarks-<UTC time>.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO, add_mfu, measure_cpu_peak
from benchmarks.registry import ALL_NAMES, BENCHMARKS, CPU_NAMES, STEPS, describe
from benchmarks.sides import Bench
from benchmarks.stats import Row, fmt_si, format_table


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
                                 epilog="benchmarks:\n" + describe(),
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
    bench = Bench(work, repeats, args.quick, STEPS)
    bench.user_env = user_env
    started = datetime.now(UTC)
    info = {"started_utc": started.isoformat(timespec="seconds"), "machine": machine(),
            "repeats": repeats, "quick": args.quick, "steps": {n: bench.steps(n) for n in names}}
    rows: list[Row] = []
    results: dict[str, Any] = {}
    cpu_runs = any(n in CPU_NAMES for n in names)
    peaks: list[float] = measure_cpu_peak() if cpu_runs else []
    try:
        for name in names:
            t0 = time.time()
            print(f"[benchmarks] {name} ...", file=sys.stderr, flush=True)
            try:
                new = BENCHMARKS[name].run(bench)
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
        peaks = measure_cpu_peak()
        add_mfu(rows)
    info["finished_utc"] = datetime.now(UTC).isoformat(timespec="seconds")
    info["load_average_end"] = os.getloadavg()
    m = info["machine"]
    print(f"\nMachine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; Python {m['python']}, "
          f"torch {m['torch']}, Ray {m['ray']}; GPU: {m['gpu'] or 'none'}; load average at start "
          f"{m['load_average'][0]:.2f}, at end {info['load_average_end'][0]:.2f}; {repeats} repetitions; "
          f"{info['started_utc']} → {info['finished_utc']}\n")
    if peaks:
        info["cpu_matmul_peak_flops_per_thread"] = peaks
        print(f"CPU peak for MFU: {fmt_si(max(peaks), 'FLOP/s')} per thread (best fp32 "
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
