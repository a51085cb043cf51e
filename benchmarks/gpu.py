"""The first-contact run on one CUDA GPU: ``python -m benchmarks.run gpu --out DIR
[--deadline SECONDS] [--device cuda|cpu] [--small] [--stages a,b] [--timeout STAGE=SECONDS]``.

Made for one short chance on a lent GPU node: Python 3.12, a preinstalled torch ≥ 2.11, no
Ray, no network (the project's other dependencies from a wheelhouse: ``benchmarks/wheelhouse.py``).
Nothing on its path imports Ray.

**Stages**, in order of value (:data:`STAGES`; bodies in ``benchmarks/gpu_stages.py``):
``environment`` (GPU, driver, torch, CUDA, NCCL, free memory, Python, dependencies present),
``main_job`` (the main job's model, bf16, one rank through ray_titan's own loop: loss, tokens/s,
device peak beside the memory plan, host synchronisations per step counted by the profiler beside
the dry run's count), ``llama_1b`` (a Llama 3.2 1B-shaped model: tokens/s, MFU against the
datasheet and a measured bf16 matmul peak, device peak beside the plan), ``torchtitan`` (the same
shape, batch and dtype; the ratio), ``gpu_checks`` (``benchmarks/gpu_checks.py``, one fact per
check), ``main_mesh`` (the main job's pp=2 × dp_shard=2 on the one GPU), ``compile``
(``training.compile = true``), ``memory_levers`` (the 1B shape under each memory lever: peaks
beside the plan, the step-3 snapshot's peak and its owners, loss gaps) and ``families`` (every
family's debug flavor on the device and on the CPU: the loss gap).

**Facts.** Every fact goes to ``DIR/facts.jsonl`` the moment it is known, flushed and fsynced
(``benchmarks/facts.py``), and as a line on stdout; so a run killed at any point keeps
everything before it. Each stage ends with an ``outcome`` fact: ``ok``, ``failed (exit N)`` or
``timed out after S s`` (both with the stage's stderr tail; the whole of it is kept in
``DIR/stages/<stage>.stderr``), or ``skipped: ...``; then the next stage runs.

**Deadline.** Each stage runs in a process of its own (a new session: a timed-out stage's whole
process tree, torchrun's ranks included, is killed). The whole run ends by ``--deadline``
seconds after its start (default :data:`DEFAULT_DEADLINE_S`, 8 minutes). A stage gets at most
its cap (:data:`STAGES`), and never the time the stages after it have reserved (their
minimums): timeout = min(cap, time left − the later stages' minimums). A stage whose timeout
would be below its own minimum is skipped, saying so, and its time stays with the later ones.
So a hanging stage costs at most its cap, and every later stage keeps at least its minimum.
``--timeout STAGE=SECONDS`` replaces a stage's cap. The stage is told its own end (``--until``)
so the processes it starts (rank launches, torchtitan, the dry run) stop before it.

``--device cpu --small`` is the rehearsal: the same stages on CPU with small shapes and few steps,
device-only facts recorded as ``"n/a on cpu"`` (``tests/integration/test_gpu_first_contact.py``).
Exit status: 0 when every stage ended ``ok``; 1 otherwise, and where ``--device cuda`` finds no
CUDA device (a fact says what torch knows, and only the environment stage runs: the driver and
the wheel's CUDA say why); 128 + the signal's number when SIGTERM, SIGHUP or Ctrl-C stops the run
(the current stage's processes, torchrun's ranks included, are killed; the facts so far stay).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.facts import FactLog, stderr_tail
from benchmarks.harness import REPO, kill_tree

__all__ = ["DEFAULT_DEADLINE_S", "STAGES", "Stage", "main", "plan_timeout", "run_stage"]

DEFAULT_DEADLINE_S = 480.0


@dataclass(frozen=True)
class Stage:
    """A stage: its ``name`` (``benchmarks.gpu_stages``'s), what it measures (``title``), its cap
    and its reserved minimum (seconds; sized for one H100, the CPU rehearsal's fit inside)."""

    name: str
    title: str
    cap_s: float
    min_s: float


STAGES = (
    Stage("environment", "GPU, driver, torch, CUDA, NCCL, memory, Python, dependencies", 45, 15),
    Stage("main_job", "the main job's model, bf16, one rank: loss, tokens/s, memory vs plan, host syncs", 120, 40),
    Stage("llama_1b", "Llama 3.2 1B shape: tokens/s, MFU, memory vs plan", 90, 40),
    Stage("torchtitan", "torchtitan 0.3.0 at the 1B shape: tokens/s and the ratio", 75, 20),
    Stage("gpu_checks", "the checks only a GPU can make", 150, 60),
    Stage("main_mesh", "the main job's mesh, pp=2 × dp_shard=2, on the one GPU", 75, 30),
    Stage("compile", "training.compile = true: first step and tokens/s", 90, 30),
    Stage("memory_levers", "the 1B shape under each memory lever: tokens/s, peaks, loss gaps", 240, 60),
    Stage("families", "every family's debug flavor: device against CPU losses", 150, 40),
)


def plan_timeout(stage: Stage, left_s: float, later: list[Stage], cap_s: float | None = None) -> float | None:
    """Seconds ``stage`` may run with ``left_s`` seconds left before the deadline and the stages
    ``later`` still to come: ``min(cap, left − their minimums)``; None (skip it) when that is below
    the stage's own minimum (or a smaller ``cap_s``: a cap set by hand is honoured as is)."""
    cap = stage.cap_s if cap_s is None else cap_s
    t = min(cap, left_s - sum(s.min_s for s in later))
    return t if t >= min(stage.min_s, cap) and t > 0 else None


def run_stage(stage: Stage, timeout: float, out: Path, args: list[str], log: FactLog) -> str:
    """``python -m benchmarks.gpu_stages <stage> --out OUT <args> --until T`` in a session of its
    own, stdout streamed, stderr to ``OUT/stages/<stage>.stderr``; killed with its process group
    after ``timeout`` seconds. Records the ``outcome`` and ``seconds`` facts and returns the outcome."""
    (out / "stages").mkdir(parents=True, exist_ok=True)
    err_path = out / "stages" / f"{stage.name}.stderr"
    cmd = [sys.executable, "-m", "benchmarks.gpu_stages", stage.name, "--out", str(out), *args,
           "--until", f"{time.time() + timeout - 2:.1f}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.monotonic()
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=None, stderr=err, cwd=REPO, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            outcome = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)  # the stage and all below it, torchrun's ranks in their own sessions too
            proc.wait()
            outcome = f"timed out after {timeout:.0f} s"
        except BaseException:  # the run stopped (a signal, Ctrl-C): nothing left on the GPU
            kill_tree(proc.pid)
            log.add("outcome", "stopped: the run was interrupted")
            raise
    secs = time.monotonic() - t0
    tail = "" if outcome == "ok" else stderr_tail(err_path.read_text(errors="replace"))
    log.add("outcome", outcome, note=tail)
    log.add("seconds", round(secs, 1), "s")
    return outcome


def _parse_timeouts(items: list[str], ap: argparse.ArgumentParser) -> dict[str, float]:
    names = {s.name for s in STAGES}
    out = {}
    for item in items:
        name, _, secs = item.partition("=")
        if name not in names or not secs:
            ap.error(f"--timeout {item!r}: expected STAGE=SECONDS with STAGE one of {sorted(names)}")
        out[name] = float(secs)
    return out


def _args(argv: list[str] | None) -> tuple[argparse.Namespace, list[Stage], dict[str, float]]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder of facts.jsonl and the stages' files")
    ap.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                    help=f"seconds the whole run may take (default {DEFAULT_DEADLINE_S:.0f})")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the rehearsal")
    ap.add_argument("--small", action="store_true", help="small shapes and few steps (the CPU rehearsal's)")
    ap.add_argument("--stages", default=",".join(s.name for s in STAGES), help="which stages, comma-separated")
    ap.add_argument("--timeout", action="append", default=[], metavar="STAGE=SECONDS", help="a stage's cap")
    a = ap.parse_args(argv)
    wanted = a.stages.split(",")
    unknown = sorted(set(wanted) - {s.name for s in STAGES})
    if unknown:
        ap.error(f"unknown stage(s) {unknown}; valid: {[s.name for s in STAGES]}")
    return a, [s for s in STAGES if s.name in wanted], _parse_timeouts(a.timeout, ap)


class _Stopped(BaseException):
    """SIGTERM or SIGHUP (an outer timeout, a closed terminal) reached the run: the current
    stage's processes are killed and the run ends, every fact so far on disk."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, frame: Any) -> None:
    raise _Stopped(signum)


def _cuda_here(log: FactLog) -> bool:
    """Whether torch sees a CUDA device; where it does not, a fact says what it knows (the
    build's CUDA version, the device count's error: a driver older than the wheel's CUDA is the
    likeliest cause on a new node) before only the environment stage runs."""
    import torch

    if torch.cuda.is_available():
        return True
    try:
        count: Any = torch.cuda.device_count()
    except Exception as e:  # the runtime's own words
        count = f"{type(e).__name__}: {e}"
    log.add("cuda available", False, note=f"torch {torch.__version__} built for CUDA {torch.version.cuda}, "
            f"devices: {count}; only the environment stage runs (`--device cpu --small` rehearses every stage on CPU)")
    return False


def main(argv: list[str] | None = None) -> int:
    """Run the stages (module docstring); returns the exit status: 0 when every stage ended ok,
    1 otherwise (no CUDA device included: only the environment stage runs, to say why), 128 + the
    signal's number when SIGTERM, SIGHUP or SIGINT stopped it."""
    import signal

    a, stages, caps = _args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)
    start = time.monotonic()
    run_log = FactLog(a.out, "run")
    run_log.add("started", {"deadline_s": a.deadline, "device": a.device, "small": a.small,
                            "stages": [s.name for s in stages]})
    cuda_missing = a.device == "cuda" and not _cuda_here(run_log)
    if cuda_missing:
        stages = [s for s in stages if s.name == "environment"]  # the node's facts say why
    args = ["--device", a.device, *(["--small"] if a.small else [])]
    outcomes = []
    for i, stage in enumerate(stages):
        log = FactLog(a.out, stage.name)
        left = a.deadline - (time.monotonic() - start)
        timeout = plan_timeout(stage, left, stages[i + 1:], caps.get(stage.name))
        if timeout is None:
            log.add("outcome", f"skipped: not enough time left ({max(left, 0):.0f} s before the deadline, "
                               f"{sum(s.min_s for s in stages[i + 1:]):.0f} s reserved for the later stages)")
            continue
        print(f"[run] stage {stage.name} ({stage.title}): up to {timeout:.0f} s", flush=True)
        try:
            outcomes.append(run_stage(stage, timeout, a.out, args, log))
        except (_Stopped, KeyboardInterrupt) as e:
            signum = e.signum if isinstance(e, _Stopped) else int(signal.SIGINT)
            run_log.add("interrupted", f"signal {signum}", note=f"during stage {stage.name}; its processes killed")
            return 128 + signum
    run_log.add("finished", f"{sum(o == 'ok' for o in outcomes)} of {len(stages)} stages ok",
                note=f"{time.monotonic() - start:.0f} s")
    return 0 if not cuda_missing and all(o == "ok" for o in outcomes) and len(outcomes) == len(stages) else 1
