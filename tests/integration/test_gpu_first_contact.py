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
from pathlib import Path

import pytest

from benchmarks.facts import read_facts
from benchmarks.gpu import STAGES

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.compat
def test_cpu_rehearsal_streams_every_stage_without_ray(tmp_path):
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text("import sys\nsys.modules['ray'] = None  # `import ray` fails\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(block), str(REPO)]), "OMP_NUM_THREADS": "1"}
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
    for stage in ("environment", "main_job", "llama_1b", "torchtitan", "main_mesh"):
        assert value[stage, "outcome"] == "ok", (stage, got[stage, "outcome"].get("note"))
    assert value["environment", "gpu"] == "n/a on cpu"
    # The main job's model: the plan before the run, the run, the device facts n/a, the host syncs.
    main = [f["name"] for f in facts if f["stage"] == "main_job"]
    assert main.index("memory plan peak, rank 0") < main.index("steps run")
    assert value["main_job", "loss finite"] is True and value["main_job", "tokens/s"] > 0
    assert value["main_job", "device peak allocated"] == "n/a on cpu"
    assert value["main_job", "host reads per step (profiler)"] > 0
    assert ("main_job", "dry run host syncs per step") in got or ("main_job", "dry run failed") in got
    assert 0 < value["llama_1b", "MFU vs measured matmul peak"] < 100
    assert math.isfinite(value["llama_1b", "last loss"])
    assert value["torchtitan", "torchtitan present"] in (False, "0.3.0")
    # The stage that timed out says so with its stderr's tail; the stages after it ran.
    assert value["gpu_checks", "outcome"] == "timed out after 1 s"
    assert value["main_mesh", "ranks exit status"] == 0 and value["main_mesh", "loss finite"] is True
    assert value["main_mesh", "collectives staged through host"].get("batch_p2p", 0) > 0
    assert value["compile", "outcome"] == "timed out after 1 s"
    assert (out / "stages" / "main_job.stderr").is_file()
