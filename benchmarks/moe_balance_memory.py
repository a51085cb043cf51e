"""MoE benchmark: expert-load balance with each balancing mode, and host-memory flatness.

Runs ``configs/debug_deepseek.toml`` (pp=2 × dp_shard=2, ep=2, 4 workers on a local Ray cluster;
``--config configs/debug_deepseek_v3.toml``: its DeepSeek-V3 twin)
for ``--steps`` steps with ``metrics.log_freq`` larger than the run, once per
``model.load_balance`` mode, and prints per mode:

- expert balance over the last 50 steps: each MoE layer's experts' token shares (summed over
  ranks from the collector's ``expert_load``), as min and max × the uniform share ``1/N``, and
  the worst layer's max/mean;
- host RSS growth per rank after warm-up: the Theil–Sen slope of ``host_rss_bytes`` (read by
  each rank from ``/proc/self/status`` after every step) over steps > ``--warmup``, in KiB per
  100 steps; and the same slope of ``host_heap_in_use_bytes`` (what malloc has handed out and
  not taken back: ``ray_titan.allocator.host_heap``): the trainer's own allocations, without
  the free space the allocator keeps; and which malloc the workers ran (``memory.allocator``,
  ``--allocator`` to compare);
- median tokens/s and the mean loss of the last 20 steps.

``python benchmarks/moe_balance_memory.py [--config configs/debug_deepseek.toml] [--steps 300] [--modes aux_loss aux_free none] [--allocator auto] [--json out.json]``
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run_mode(mode: str, steps: int, warmup: int, dump: str, allocator: str = "auto",
             config: str = "configs/debug_deepseek.toml") -> dict:
    import ray_titan
    from ray_titan.config import load_config
    from ray_titan.metrics.reading.moe_stats import expert_shares, memory_slopes

    cfg = load_config(REPO / config, [
        f"--job.name=bench_moe_{mode}", f"--job.dump_folder={dump}", f"--training.steps={steps}",
        f"--metrics.log_freq={steps + 1}", f"--model.load_balance={mode}", f"--memory.allocator={allocator}",
    ])
    result = ray_titan.train(cfg)
    t = result.steps
    shares = expert_shares(t, steps - 49, steps)
    n = len(next(iter(shares.values())))
    loss = np.array(result.step_column("step_loss"), dtype=float)
    tps = np.array(result.step_column("step_tokens_per_s"), dtype=float)
    return {
        "mode": mode,
        "steps": steps,
        "allocator": sorted({v.get("allocator") for k, v in result.timings.items() if k.startswith("rank")}),
        "share_min_x_uniform": min(min(s) for s in shares.values()) * n,
        "share_max_x_uniform": max(max(s) for s in shares.values()) * n,
        "per_layer_shares": {str(k): [round(x, 4) for x in v] for k, v in shares.items()},
        "rss_kib_per_100_steps": {str(r): s * 100 / 1024 for r, s in memory_slopes(t, warmup).items()},
        "heap_in_use_kib_per_100_steps": {
            str(r): s * 100 / 1024 for r, s in memory_slopes(t, warmup, "host_heap_in_use_bytes").items()},
        "tokens_per_s_median": float(np.median(tps[1:])),
        "loss_last20": float(loss[-20:].mean()),
        "errors": result.errors,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/debug_deepseek.toml",
                    help="the MoE job (relative to the repository; configs/debug_deepseek_v3.toml: the V3 twin)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--modes", nargs="+", default=["aux_loss", "aux_free", "none"])
    ap.add_argument("--allocator", default="auto", choices=["auto", "jemalloc", "system"],
                    help="memory.allocator of the workers (default auto: jemalloc where Ray ships it)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    rows = []
    with tempfile.TemporaryDirectory() as dump:
        for mode in args.modes:
            rows.append(run_mode(mode, args.steps, args.warmup, dump, args.allocator, args.config))
    print(f"\n{args.config}, pp=2 × dp_shard=2 × ep=2, {args.steps} steps; balance over the last 50 steps; "
          f"workers' malloc: {', '.join(sorted({a for r in rows for a in r['allocator']}))}")
    print(f"{'load_balance':<12} {'min share':>10} {'max share':>10} {'rss KiB/100 steps (r0..r3)':>34} "
          f"{'malloc in-use KiB/100 steps':>34} {'tok/s':>8} {'loss':>7}")
    for r in rows:
        rss = " ".join(f"{v:7.0f}" for v in r["rss_kib_per_100_steps"].values())
        heap = " ".join(f"{v:7.0f}" for v in r["heap_in_use_kib_per_100_steps"].values())
        print(f"{r['mode']:<12} {r['share_min_x_uniform']:>9.2f}x {r['share_max_x_uniform']:>9.2f}x "
              f"{rss:>34} {heap:>34} {r['tokens_per_s_median']:>8.0f} {r['loss_last20']:>7.3f}")
    print("(shares as multiples of the uniform share 1/8; memory target: < 1024 KiB per 100 steps)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
