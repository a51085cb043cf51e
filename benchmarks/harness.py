"""The harness: what every benchmark shares and nothing more. The job template, the flags that
reproduce a job in a subprocess, running a command under a deadline (its whole process tree
killed past it), timing a run, tokens/s, FLOPs per token and MFU against the measured CPU peak,
the baselines' environment and torchtitan's run.

The benchmarks (``benchmarks.main_job``, ``benchmarks.gpu`` and its stages, ...) import it; it
imports no benchmark, nothing of the runner (``benchmarks.run``, ``benchmarks.registry``), and no
Ray: the first-contact GPU run uses it where Ray is absent. The statistics and the printed table
are ``benchmarks.stats``. pyproject.toml's import contracts hold these layers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.stats import Row
from ray_titan.config.units import MiB

__all__ = [
    "MEMORY_WARMUP",
    "REPO",
    "MiB",
    "add_mfu",
    "baseline_env",
    "flops_per_token",
    "job_config",
    "measure_cpu_peak",
    "peak_flops_cpu",
    "run_bounded",
    "run_torchtitan",
    "subprocess_flags",
    "timed",
    "tokens_per_s",
]

REPO = Path(__file__).resolve().parents[1]
MEMORY_WARMUP = 100
"""Steps the ``memory`` benchmark and the GPU run's flat-memory check leave out before fitting
slopes (allocator pools, thread caches and the first checkpoint settle)."""


def job_config(work: Path, name: str, steps: int, *overrides: str):
    """The README's main job (``configs/debug_llama.toml``) named ``name``, ``steps`` steps, its
    runs under ``work/runs``, with ``overrides`` (``--section.key=value``) last. One intra-op
    thread per worker everywhere, so every side of a comparison uses the same CPU threads.
    Raises ``ConfigError`` for a bad override."""
    from ray_titan.config import load_config, merge_overrides
    from ray_titan.run_dir import resolve_paths

    return resolve_paths(load_config(REPO / "configs" / "debug_llama.toml", merge_overrides([
        f"--job.name={name}", f"--job.dump_folder={work / 'runs'}",
        f"--training.steps={steps}", "--training.threads_per_worker=1",
        f"--lr_scheduler.warmup_steps={min(20, steps // 2)}",
        # The breakdown profiles step 2 once per run (seconds of analysis): not a per-step
        # cost, and a comparison's steady window would catch ranks waiting for it.
        "--memory.breakdown_step=0"], list(overrides))))


def tokens_per_s(cfg, summaries: list[dict[str, Any]]) -> float:
    """Global tokens/s of a run from its ranks' timing summaries: global batch × seq_len tokens
    per step, over the slowest rank's steady-state time."""
    steps = min(s["steady_steps"] for s in summaries)
    secs = max(s["steady_time_s"] for s in summaries)
    return cfg.training.global_batch_size * cfg.training.seq_len * steps / secs


def subprocess_flags(cfg) -> list[str]:
    """``--section.key=value`` flags reproducing ``cfg`` (for a subprocess). Raises ValueError
    for a non-empty array table (``[[callbacks]]``), which has no flag form."""
    flags = []
    for section, values in cfg.model_dump().items():
        if isinstance(values, list):  # [[callbacks]]: array tables have no flag form
            if values:
                raise ValueError(f"{section}: {len(values)} entries cannot be passed as flags")
            continue
        for key, value in values.items():
            if value is not None:
                flags.append(f"--{section}.{key}={json.dumps(value)}")
    return flags


def flops_per_token(cfg) -> int:
    """Model FLOPs per trained token of ``cfg``'s model at its sequence length, with the
    tokenizer's vocabulary (``ray_titan.metrics.flops.model_flops_per_token``, the PaLM formula)."""
    from ray_titan.data.tokenizer import build_tokenizer
    from ray_titan.metrics.flops import model_flops_per_token
    from ray_titan.models.registry import get_model_args

    vocab = build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path).vocab_size
    args = dataclasses.replace(get_model_args(cfg.model.name, cfg.model.flavor), vocab_size=vocab)
    return model_flops_per_token(args, cfg.training.seq_len)


def baseline_env(cfg) -> dict[str, str]:
    """Environment of a baseline process: one intra-op thread, and the C allocator ray_titan's
    workers get (``memory.allocator``), so a comparison measures the trainer, not malloc."""
    from ray_titan.allocator import worker_env_vars

    return {**os.environ, "OMP_NUM_THREADS": "1", **worker_env_vars(cfg.memory.allocator)}


def run_torchtitan(work: Path, cfg, device: str = "cpu", timeout: float | None = None,
                   fuse_qkv: bool = True) -> dict[str, Any]:
    """torchtitan 0.3.0 at ``cfg``'s shape and mesh under ``torchrun`` (``benchmarks/torchtitan_cpu.py``;
    ``device`` ``"cuda"``: natively, one GPU per rank), killed after ``timeout`` seconds;
    ``fuse_qkv`` False: its attention with separate q, k and v projections. Returns
    ``tokens_per_s``, ``rss_bytes`` and ``logged_losses``; raises RuntimeError when it fails
    (its whole stderr kept beside its output) and ``subprocess.TimeoutExpired`` past ``timeout``."""
    out = work / "runs" / f"torchtitan-{time.time_ns()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.world_size}",
           "-m", "benchmarks.torchtitan_cpu", "--config-json", cfg.model_dump_json(), "--out", str(out),
           f"--device={device}", *([] if fuse_qkv else ["--unfused-qkv"])]
    proc = run_bounded(cmd, timeout, cwd=REPO, env=baseline_env(cfg))
    if proc.returncode:
        out.mkdir(parents=True, exist_ok=True)
        (out / "stderr.txt").write_text(proc.stderr)  # a rank's fatal error is far above the tail
        raise RuntimeError(f"torchtitan failed (whole stderr in {out / 'stderr.txt'}): {proc.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return {"tokens_per_s": tokens_per_s(cfg, ranks), "rss_bytes": [r["host_rss_bytes"] for r in ranks],
            "logged_losses": {r["rank"]: r["logged_losses"] for r in ranks}}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs, ...), read from ``/proc`` (Linux), whatever
    session or process group each started; ``[]`` where ``/proc`` is not there."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except (OSError, IndexError):
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        out += below
        todo += below
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it. The tree is read before anything is killed (a
    killed parent's children are re-parented), and each process is killed by pid, not by group:
    a stage's torchrun and torchtitan start sessions of their own (:func:`run_bounded`), which
    killing the stage's group alone would leave running on the GPU."""
    import signal

    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_bounded(cmd: list[str], timeout: float | None, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)`` in a session of its own,
    so that past ``timeout`` seconds the whole process group dies (torchrun's ranks too, which
    ``subprocess.run``'s timeout would leave running). Raises ``subprocess.TimeoutExpired``
    (with what the command wrote) past ``timeout``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout or 0, out, err) from None
    except BaseException:  # the stage itself stopped (its own deadline, a signal): no orphans
        kill_tree(proc.pid)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def timed(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """``fn`` that also records its wall seconds as ``wall_s`` in the dict it returns."""
    def run() -> dict[str, Any]:
        t0 = time.time()
        out = fn()
        out["wall_s"] = time.time() - t0
        return out
    return run


_PEAK_PER_THREAD: list[float] = []


def measure_cpu_peak() -> list[float]:
    """Measure the single-thread fp32 matmul peak (FLOP/s) again; returns every measurement so far
    (the best is the one used: a peak measured at a busy moment must not inflate MFU)."""
    from ray_titan.metrics.flops import measure_matmul_peak_flops

    _PEAK_PER_THREAD.append(measure_matmul_peak_flops("cpu", n=1024, repeats=10, threads=1))
    return list(_PEAK_PER_THREAD)


def peak_flops_cpu(threads: int) -> float:
    """Best measured single-thread fp32 matmul peak × ``threads`` (at most the machine's cores)."""
    per_thread = max(_PEAK_PER_THREAD) if _PEAK_PER_THREAD else max(measure_cpu_peak())
    return per_thread * min(threads, os.cpu_count() or 1)


def add_mfu(rows: list[Row]) -> None:
    """Append MFU to the tokens/s of comparison rows (those with ``mfu_inputs``), with the best CPU
    peak measured in the whole invocation."""
    for r in rows:
        m = r.data.get("mfu_inputs")
        if not m:
            continue
        peak = peak_flops_cpu(m["threads"])
        r.data["mfu"] = {"a": m["tps_a"] * m["flops_per_token"] / peak, "b": m["tps_b"] * m["flops_per_token"] / peak,
                         "peak_flops": peak}
        r.a_value += f" (MFU {100 * r.data['mfu']['a']:.1f}%)"
        r.b_value += f" (MFU {100 * r.data['mfu']['b']:.1f}%)"
