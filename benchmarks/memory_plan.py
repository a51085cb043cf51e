"""The memory plan against measurement: ``python -m benchmarks.memory_plan [--quick] [--filter S]``.

For the debug Llama and DeepSeek over pp ∈ {1, 2}, dp_shard ∈ {1, 2}, ep ∈ {1, 2} (DeepSeek),
every pipeline schedule that exists (GPipe, 1F1B, Interleaved1F1B with 2 stages per rank) and
every activation checkpointing mode (none, full, selective op, selective layer), it runs two
steps without Ray (``torchrun``, one process per rank, fp32 on CPU), reads each rank's measured
peak at step 2 (``memory.breakdown_step``: the torch profiler's peak of all tensors) and the
plan the run recorded before it started (``memory_plan.json``), and prints one row per rank
with the error (measured / predicted − 1). The target is |error| <= 15 % on every rank.

``--quick``: one configuration per model and mesh (no AC, default schedule). Writes JSON to
``outputs/benchmarks/memory-plan-<UTC time>.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ray_titan.config.units import MiB

REPO = Path(__file__).resolve().parents[1]

AC_MODES = {
    "none": [],
    "full": ["--activation_checkpoint.mode=full"],
    "sel-op": ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=op"],
    "sel-layer": ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=layer"],
}
SCHEDULES = {
    "GPipe": ["--parallelism.pipeline_schedule=GPipe"],
    "1F1B": ["--parallelism.pipeline_schedule=1F1B"],
    "Interleaved1F1B": ["--parallelism.pipeline_schedule=Interleaved1F1B", "--parallelism.stages_per_rank=2"],
}


def configurations(quick: bool) -> list[tuple[str, str, list[str]]]:
    """(name, config file, overrides) of every configuration measured."""
    out = []
    meshes = {"llama": [(pp, dp, 1) for pp in (1, 2) for dp in (1, 2)],
              "deepseek": [(pp, dp, ep) for pp in (1, 2) for dp, ep in ((1, 1), (2, 1), (2, 2))]}
    for model, mesh in meshes.items():
        for pp, dp, ep in mesh:
            schedules = ["1F1B"] if pp == 1 or quick else list(SCHEDULES)
            acs = ["none"] if quick else list(AC_MODES)
            for sched, ac in itertools.product(schedules, acs):
                name = f"{model} pp={pp} dp_shard={dp}" + (f" ep={ep}" if model == "deepseek" else "") \
                    + (f" {sched}" if pp > 1 else "") + f" AC {ac}"
                overrides = [f"--parallelism.pp={pp}", f"--parallelism.dp_shard={dp}", *AC_MODES[ac],
                             *(SCHEDULES[sched] if pp > 1 else [])]
                if model == "deepseek":
                    overrides.append(f"--parallelism.ep={ep}")
                out.append((name, f"debug_{model}.toml", overrides))
    return out


def measure(config: str, overrides: list[str], work: Path) -> dict[str, Any]:
    """Run two steps under torchrun; per rank the plan's and the measured peak (bytes)."""
    from ray_titan.metrics.collector.breakdowns import read_breakdowns
    from ray_titan.preflight.memory_plan import MemoryPlan

    pp = int(next(o.split("=")[1] for o in overrides if o.startswith("--parallelism.pp=")))
    dp = int(next(o.split("=")[1] for o in overrides if o.startswith("--parallelism.dp_shard=")))
    dump = Path(tempfile.mkdtemp(dir=work))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp * dp}",
           "-m", "ray_titan.launch", "--config", str(REPO / "configs" / config), "--training.steps=2",
           "--checkpoint.enable=false", "--metrics.enable_tensorboard=false", "--training.threads_per_worker=1",
           f"--job.dump_folder={dump}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for _attempt in range(2):  # a rendezvous port taken by a neighbour: once more
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode == 0:
            break
    if proc.returncode:
        # The ranks' own error lines, not torchrun's summary of who exited.
        lines = [ln for ln in proc.stderr.splitlines() if "Error" in ln and "error_file" not in ln]
        return {"error": "\n".join(lines[-5:]) or proc.stderr[-2000:]}
    (run_dir,) = dump.glob("*")
    plan = MemoryPlan.load(run_dir / "memory_plan.json")
    measured = read_breakdowns(run_dir)
    return {"ranks": [{"rank": r.rank, "coords": r.coords, "predicted": r.peak,
                       "measured": measured[r.rank]["peak_bytes"], "predicted_split": r.categories(),
                       "measured_split": measured[r.rank]["at_peak"]} for r in plan.ranks]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.memory_plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one configuration per model and mesh")
    ap.add_argument("--filter", default="", help="only configurations whose name contains this")
    ap.add_argument("--json", type=Path, default=None, help="where to write the results")
    args = ap.parse_args(argv)
    started = datetime.now(UTC)
    work = Path(tempfile.mkdtemp(prefix="rt_plan_", dir="/tmp"))
    results, worst = [], 0.0
    print("| configuration | rank | coords | predicted MiB | measured MiB | error |")
    print("|---|---|---|---|---|---|")
    for name, config, overrides in configurations(args.quick):
        if args.filter not in name:
            continue
        t0 = time.time()
        res = measure(config, overrides, work)
        results.append({"name": name, "overrides": overrides, "seconds": time.time() - t0, **res})
        if "error" in res:
            print(f"| {name} | failed | {res['error'].splitlines()[-1] if res['error'] else ''} | | | |", flush=True)
            continue
        for r in res["ranks"]:
            err = r["measured"] / r["predicted"] - 1
            worst = max(worst, abs(err))
            coords = ", ".join(f"{k}={v}" for k, v in r["coords"].items())
            print(f"| {name} | {r['rank']} | {coords} | {r['predicted'] / MiB:.2f} | {r['measured'] / MiB:.2f} "
                  f"| {err:+.1%} |", flush=True)
    n = sum(len(r.get("ranks", [])) for r in results)
    failed = sum("error" in r for r in results)
    print(f"\n{len(results)} configurations, {n} ranks, {failed} failed; largest |error| {worst:.1%} "
          f"(target <= 15 %)")
    path = args.json or REPO / "outputs" / "benchmarks" / f"memory-plan-{started:%Y%m%d-%H%M%S}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"started_utc": started.isoformat(timespec="seconds"), "results": results,
                                "largest_abs_error": worst}, indent=1))
    print(f"JSON: {path}")
    return 0 if worst <= 0.15 and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
