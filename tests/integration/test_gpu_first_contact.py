"""The first-contact GPU run's CPU rehearsal (``python -m benchmarks.run gpu --device cpu
--small``) where ``import ray`` fails in every process it starts: every stage in order, each
fact on disk, a stage that times out recorded as such with the stages after it still run.
The ``gpu_checks`` stage is made to time out (its checks run in tests/integration/test_gpu_checks.py)
and so is ``compile`` (minutes of inductor on 2 cores; tests/integration/test_compile.py)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.facts import read_facts
from benchmarks.gpu import STAGES
from ray_titan.models.registry import FAMILIES

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.compat
def test_cpu_rehearsal_streams_every_stage_without_ray(tmp_path):
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text("import sys\nsys.modules['ray'] = None  # `import ray` fails\n")
    # The levers the assertions read: the others differ only in their flags (tested on their own).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(block), str(REPO)]), "OMP_NUM_THREADS": "1",
           "GPU_LEVERS": "none,offload all,128K vocab"}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "gpu", "--out", str(out), "--device", "cpu",
                           "--small", "--deadline", "400", "--timeout", "gpu_checks=1", "--timeout", "compile=1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    facts = read_facts(out)
    got = {(f["stage"], f["name"]): f for f in facts}
    value = {k: f["value"] for k, f in got.items()}
    assert proc.returncode == 1, proc.stderr[-2000:]  # two stages timed out
    assert [f["stage"] for f in facts if f["name"] == "outcome"] == [s.name for s in STAGES]
    # Every fact was printed as it was written.
    assert all(f"[{f['stage']}] {f['name']}:" in proc.stdout for f in facts)
    # Ray is blocked, and nothing needed it.
    assert value["environment", "dependencies"]["ray"] is None and value["environment", "ray_titan imports"] is True
    for stage in ("environment", "main_job", "llama_1b", "torchtitan", "main_mesh", "memory_levers", "families"):
        assert value[stage, "outcome"] == "ok", (stage, got[stage, "outcome"].get("note"))
    assert value["environment", "gpu"] == "n/a on cpu"
    # The main job's model: the plan before the run, the run, the device facts n/a, the host syncs.
    main = [f["name"] for f in facts if f["stage"] == "main_job"]
    assert main.index("memory plan peak, rank 0") < main.index("steps run")
    assert value["main_job", "loss finite"] is True and value["main_job", "tokens/s"] > 0
    assert value["main_job", "device peak active"] == "n/a on cpu"
    assert value["main_job", "host reads per step (profiler)"] > 0
    assert value["main_job", "dry run host syncs per step"] >= 1  # the dry run works on every torch
    assert 0 < value["llama_1b", "MFU vs measured matmul peak"] < 100
    assert math.isfinite(value["llama_1b", "last loss"])
    assert value["torchtitan", "torchtitan present"] in (False, "0.3.0")
    # The stage that timed out says so with its stderr's tail; the stages after it ran.
    assert value["gpu_checks", "outcome"] == "timed out after 1 s"
    assert value["main_mesh", "ranks exit status"] == 0 and value["main_mesh", "loss finite"] is True
    assert value["main_mesh", "collectives staged through host"].get("batch_p2p", 0) > 0
    assert value["compile", "outcome"] == "timed out after 1 s"
    assert (out / "stages" / "main_job.stderr").is_file()
    # The levers: offloading moves tensors and nothing else; the widened vocabulary reaches the plan.
    assert value["memory_levers", "offload all: largest loss gap to none"] == 0
    assert value["memory_levers", "128K vocab: plan peak"] > 10 * value["memory_levers", "none: plan peak"]
    assert [k[1] for k in value if k[0] == "families" and k[1].endswith("losses finite") and value[k]] == [
        f"{family}: losses finite" for family in FAMILIES]


def test_a_stage_killed_takes_every_process_below_it_other_sessions_included():
    """kill_tree, as a stage's timeout or a signal to the run uses it: the stage's grandchild in a
    session of its own (as run_bounded starts torchrun and torchtitan) dies with it; killing the
    stage's process group alone left it running on the GPU."""
    from benchmarks.harness import descendants, kill_tree

    stage = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time; "
        "p = subprocess.Popen(['sleep', '60'], start_new_session=True); print(p.pid, flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    grandchild = int(stage.stdout.readline())
    assert grandchild in descendants(stage.pid)
    kill_tree(stage.pid)
    assert stage.wait(timeout=10) == -9
    deadline = time.monotonic() + 10
    while Path(f"/proc/{grandchild}").exists() and "Z" not in _state(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in _state(grandchild)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
