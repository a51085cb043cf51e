"""What context parallelism costs on the CPU: the same tokens per step at cp = 1 and cp = 2.

Trains the debug Llama on one sequence of ``--seq-len`` tokens per step (global batch 1, one
microbatch, no PP, no FSDP at cp = 1; at cp = 2 the sequence is split over two ranks, which
FSDP2 shards the model over) with ``python -m ray_titan.launch`` under ``torchrun``
(``benchmarks/tp_activation_memory.py``'s runner), ``--steps`` steps each, and prints per variant
the median step time after the first two steps (the slowest rank's), the largest rank's peak
allocation above step start at step 2 (the activations kept for backward, from the profiler),
and the ratios to cp = 1. The two runs take turns on the same cores, so the time ratio is that
of the same work split over two processes: on a CPU with spare cores the split sequence runs in
parallel, on a busy one the all-gathers and FSDP's collectives are what it adds.

    python -m benchmarks.context_parallel [--seq-len 1024] [--steps 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.tp_activation_memory import run_variant

VARIANTS = {"cp=1": (1, []), "cp=2": (2, ["--parallelism.cp=2"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (debug Llama: at most 1024)")
    ap.add_argument("--steps", type=int, default=8, help="steps per variant (the first two are not timed)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cp_cost_") as tmp:
        results = [run_variant(name, n, o, args.seq_len, Path(tmp), steps=args.steps)
                   for name, (n, o) in VARIANTS.items()]
    for r in results:
        r["step_time_s"] = statistics.median(r["step_times"][2:] or r["step_times"])
        r["peak_mib"] = max(v["above_start"] for v in r["ranks"].values())
    base = results[0]
    print(f"\nDebug Llama, 1 sequence × {args.seq_len} tokens a step, fp32, CPU, {args.steps} steps\n")
    print("| variant | step time (s, median) | vs cp=1 | peak above step start, largest rank (MiB) | vs cp=1 "
          "| losses (first 2 steps) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['step_time_s']:.3f} | {r['step_time_s'] / base['step_time_s']:.2f}× "
              f"| {r['peak_mib']:.1f} | {r['peak_mib'] / base['peak_mib']:.2f}× "
              f"| {', '.join(f'{x:.4f}' for x in r['losses'][:2])} |")
    if args.json:
        args.json.write_text(json.dumps({"seq_len": args.seq_len, "results": results}, indent=1))


if __name__ == "__main__":
    main()
