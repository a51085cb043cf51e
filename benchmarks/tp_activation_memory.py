"""Does tensor parallel split the activations at batch size 1? (docs/design.md, lesson 3)

Trains the debug Llama on one sequence of ``--seq-len`` tokens per step (global batch 1, one
microbatch, no PP, no FSDP) with ``python -m ray_titan.launch`` under ``torchrun``, once per
variant: ``tp = 1``, ``tp = 2`` with sequence parallel, ``tp = 2`` without it (both with loss
parallel), and ``tp = 2`` with neither. Each rank profiles step 2 with the torch profiler
(``memory.snapshot_steps = [2]``, as the activation-checkpointing figures in docs/memory.md) and the
table gives, per variant and rank, in MiB:

- ``peak above step start``: the highest net allocation during the step over what was alive
  when it began (``ray_titan.metrics.worker.profiling.allocation_peak``, from the profiler's allocation
  events): the activations kept for backward, plus gradients and temporaries at that moment.
  The parameters and optimizer state are excluded, so with a long sequence at batch size 1 this
  is the activation memory (the profiler's categorised timeline, which docs/memory.md's ``total``
  figures for activation checkpointing come from, cannot be had here: its data-flow analysis
  does not follow DTensor's ops);

and the losses of the two steps (tensor parallel must not change them).

    python benchmarks/tp_activation_memory.py [--seq-len 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ray_titan.config.units import MiB

REPO = Path(__file__).resolve().parents[1]

VARIANTS = {
    "tp=1": (1, []),
    "tp=2, sequence parallel": (2, ["--parallelism.tp=2"]),
    "tp=2, no sequence parallel": (2, ["--parallelism.tp=2", "--parallelism.sequence_parallel=false"]),
    "tp=2, neither SP nor loss parallel": (2, ["--parallelism.tp=2", "--parallelism.sequence_parallel=false",
                                               "--parallelism.loss_parallel=false"]),
}


def run_variant(name: str, nproc: int, overrides: list[str], seq_len: int, dump: Path, steps: int = 2) -> dict:
    """Train ``steps`` steps of ``name`` and read each rank's step-2 memory summary, the losses and
    each step's time (the slowest rank's, seconds; also used by benchmarks/context_parallel.py)."""
    sys.path.insert(0, str(REPO))
    from ray_titan.metrics.reading.steps import read_steps

    out = dump / name.replace(" ", "").replace(",", "_").replace("=", "")
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"] if nproc > 1 else [
        sys.executable]
    cmd = [*launcher, "-m", "ray_titan.launch", "--config", str(REPO / "configs" / "debug_llama.toml"),
           f"--training.steps={steps}", "--training.global_batch_size=1", f"--training.seq_len={seq_len}",
           "--parallelism.pp=1", "--parallelism.dp_shard=1", "--parallelism.microbatches=1",
           "--memory.snapshot_steps=[2]", "--checkpoint.enable=false", "--metrics.enable_tensorboard=false",
           "--training.threads_per_worker=1", f"--job.dump_folder={out}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    (run_dir,) = out.glob("debug_llama-*")
    ranks = {}
    for f in sorted((run_dir / "memory").glob("rank*-step2-summary.json")):
        s = json.loads(f.read_text())
        ranks[s["rank"]] = {"above_start": s["peak_above_step_start_bytes"] / MiB}
    table = read_steps(run_dir)
    losses = sorted({(r["step"], r["step_loss"]) for r in table.select(["step", "step_loss"]).to_pylist()})
    times: dict[int, float] = {}
    for r in table.select(["step", "step_time_s"]).to_pylist():
        times[r["step"]] = max(times.get(r["step"], 0.0), r["step_time_s"])
    return {"variant": name, "tp": nproc, "ranks": ranks, "losses": [loss for _, loss in losses],
            "step_times": [times[k] for k in sorted(times)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (debug Llama: at most 1024)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tp_mem_") as tmp:
        results = [run_variant(name, n, o, args.seq_len, Path(tmp)) for name, (n, o) in VARIANTS.items()]
    base = max(v["above_start"] for v in results[0]["ranks"].values())
    print(f"\nDebug Llama, 1 sequence × {args.seq_len} tokens, fp32, CPU; profiler, step 2, per rank (MiB)\n")
    print("| variant | peak above step start, per rank | largest rank vs tp=1 | losses (steps 1, 2) |")
    print("|---|---|---|---|")
    for r in results:
        peaks = " / ".join(f"{v['above_start']:.1f}" for v in r["ranks"].values())
        worst = max(v["above_start"] for v in r["ranks"].values())
        losses = ", ".join(f"{x:.4f}" for x in r["losses"])
        print(f"| {r['variant']} | {peaks} | {worst / base:.2f}× | {losses} |")
    if args.json:
        args.json.write_text(json.dumps({"seq_len": args.seq_len, "results": results}, indent=1))


if __name__ == "__main__":
    main()
