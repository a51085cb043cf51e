"""Does the main job learn in bf16 as in fp32? (``training.mixed_precision``, issue 30)

Trains the README's main job (``configs/debug_llama.toml``: the debug Llama, pp=2 × dp_shard=2,
1F1B, 4 microbatches) for ``--steps`` steps twice with ``python -m ray_titan.launch`` under
``torchrun``: ``training.mixed_precision = "fp32"`` and ``"bf16"`` (FSDP2's
``MixedPrecisionPolicy``: bf16 parameters all-gathered and computed with, fp32 gradient
reduction, fp32 master weights and AdamW state). Prints, per run, the wall time and the loss
every ``--every`` steps, and the largest and mean absolute difference between the two loss
curves (nats) over all steps, and over the last 10 steps' mean. The LR schedule is the main
job's (20 warm-up steps, cosine decay over ``--steps``).

On CPU bf16 matmuls are emulated (no AMX on most cloud CPUs), so the bf16 run is slower there;
the speed of interest is on GPUs (``benchmarks/gpu.py``).

    python benchmarks/mixed_precision.py [--steps 100] [--every 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(mixed_precision: str, steps: int, dump: Path, extra: list[str]) -> dict:
    """Train the main job for ``steps`` steps in ``mixed_precision``; its per-step losses and wall time."""
    sys.path.insert(0, str(REPO))
    from ray_titan.metrics.reading.steps import read_steps

    out = dump / mixed_precision
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "-m", "ray_titan.launch",
           "--config", str(REPO / "configs" / "debug_llama.toml"), f"--training.steps={steps}",
           f"--training.mixed_precision={mixed_precision}", "--checkpoint.enable=false",
           "--metrics.enable_tensorboard=false", "--metrics.log_freq=1000", "--memory.breakdown_step=0",
           f"--job.dump_folder={out}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{mixed_precision} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    (run_dir,) = out.glob("debug_llama-*")
    rows = read_steps(run_dir).select(["step", "step_loss"]).to_pylist()
    losses = [loss for _, loss in sorted({(r["step"], r["step_loss"]) for r in rows})]
    return {"mixed_precision": mixed_precision, "wall_s": wall, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=10, help="print the loss every this many steps")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("overrides", nargs="*", help="more --section.key=value flags for both runs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mixed_precision_") as tmp:
        fp32, bf16 = (run(m, args.steps, Path(tmp), args.overrides) for m in ("fp32", "bf16"))
    diff = [abs(a - b) for a, b in zip(fp32["losses"], bf16["losses"])]
    shown = [s for s in range(1, args.steps + 1) if s == 1 or s % args.every == 0]
    print(f"\nmain job (debug Llama, pp=2 × dp_shard=2), {args.steps} steps, loss (nats) per step\n")
    print("| step | " + " | ".join(str(s) for s in shown) + " |")
    print("|---|" + "---|" * len(shown))
    for r in (fp32, bf16):
        print(f"| {r['mixed_precision']} | " + " | ".join(f"{r['losses'][s - 1]:.3f}" for s in shown) + " |")
    tail = min(10, args.steps)
    last = [sum(r["losses"][-tail:]) / tail for r in (fp32, bf16)]
    print(f"\nwall time: fp32 {fp32['wall_s']:.0f} s, bf16 {bf16['wall_s']:.0f} s (4 ranks, startup included)")
    print(f"|bf16 − fp32| per step: max {max(diff):.4f}, mean {sum(diff) / len(diff):.4f} nats; "
          f"mean of the last {tail} steps: fp32 {last[0]:.4f}, bf16 {last[1]:.4f}")
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "runs": [fp32, bf16]}, indent=1))


if __name__ == "__main__":
    main()
