"""The sides a CPU comparison runs, and the comparison itself: ray_titan on the invocation's one
local Ray cluster, the same loop under ``torchrun``, the bare single-process loop and the loop of
Ray Train's FSDP2 guide; :func:`compare` runs two of them alternately and makes the table's row.

:class:`Bench` is one invocation's state (work folder, repetitions, ``--quick``, the steps of each
benchmark, the Ray cluster). Ray is imported only when a side needs it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from benchmarks.cpu import CPUSampler
from benchmarks.harness import (
    REPO,
    baseline_env,
    flops_per_token,
    job_config,
    subprocess_flags,
    timed,
    tokens_per_s,
)
from benchmarks.stats import Row, alternate, fmt_si, ratio_stats

__all__ = ["Bench", "compare", "jsonable", "rank_summaries", "run_bare", "run_plain_ray_train", "run_ray_titan",
           "run_torchrun"]


class Bench:
    """Shared state of one invocation: the work directory, the repetitions per comparison, the
    steps of each benchmark (``steps``: name → (full, ``--quick``)), the Ray cluster."""

    def __init__(self, work: Path, repeats: int, quick: bool, steps: Mapping[str, tuple[int, int]]):
        self.work, self.repeats, self.quick = work, repeats, quick
        self._steps = dict(steps)
        self.user_env = dict(os.environ)
        self._ray = False

    def steps(self, name: str) -> int:
        return self._steps[name][1 if self.quick else 0]

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
           *merge_overrides(subprocess_flags(cfg), [f"--job.dump_folder={dump}"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"torchrun failed: {proc.stderr[-3000:]}")
    (run_dir,) = dump.glob("*")
    ranks = rank_summaries(read_timings(run_dir))
    return {"tokens_per_s": tokens_per_s(cfg, ranks), "rss_bytes": [r["host_rss_bytes"] for r in ranks],
            "first_step_s": max(r["marks"]["step1_end"] - r["marks"]["model_built"] for r in ranks)}


def run_bare(bench: Bench, cfg) -> dict[str, Any]:
    """The bare PyTorch loop in a process of its own (``benchmarks/baselines.py``)."""
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


Side = Callable[[], dict[str, Any]]


def compare(bench: Bench, name: str, a_label: str, run_a: Side, b_label: str, run_b: Side, target: str,
            note: str, workers: int, cfg) -> tuple[Row, list, list]:
    """Run side A and side B alternately ``bench.repeats`` times each (``benchmarks.stats``):
    the row of their tokens/s ratio (its MFU added at the end of the invocation: ``mfu_inputs``),
    and every run of each side."""
    a, b = alternate(timed(run_a), timed(run_b), bench.repeats)
    st = ratio_stats([x["tokens_per_s"] for x in a], [x["tokens_per_s"] for x in b])
    row = Row(name, a_label, fmt_si(st.median_a, "tok/s"), b_label, fmt_si(st.median_b, "tok/s"), st,
              target, note, data={"a": jsonable(a), "b": jsonable(b), "stats": st.as_dict(), "mfu_inputs": {
                  "tps_a": st.median_a, "tps_b": st.median_b, "flops_per_token": flops_per_token(cfg),
                  "threads": workers * (cfg.training.threads_per_worker or 1)}})
    return row, a, b


def jsonable(runs: list[dict]) -> list[dict]:
    """``runs`` without their in-memory results (what the JSON keeps)."""
    return [{k: v for k, v in r.items() if k != "result"} for r in runs]
