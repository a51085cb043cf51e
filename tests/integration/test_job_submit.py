"""`ray job submit` end to end against a real head node with token authentication.

One module-scoped head (`ray start --head --block` with this interpreter, loopback only, its own
ports, temp dir and HOME so the token is this test's own) serves every test here: a job submitted
with `--working-dir .` trains and writes its metrics, a job with a bad config fails with the
validation message, a client without the token is refused, and the Python driver API runs on the
same cluster through RAY_ADDRESS. Teardown stops only the processes this module started, by PID.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support.ranks import free_port

pytestmark = pytest.mark.ray

RAY_CLI = [sys.executable, "-m", "ray.scripts.scripts"]
# Small and quick: 2 workers (pp=2), a handful of steps, a line every 2 steps.
SMALL = ["--training.steps=6", "--parallelism.dp_shard=1", "--training.global_batch_size=4",
         "--metrics.log_freq=2", "--lr_scheduler.warmup_steps=2", "--ray.cpus_per_worker=0.5",
         "--memory.breakdown_step=0"]


def _base_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    # Its own HOME: `ray get-auth-token --generate` writes ~/.ray/auth_token, never the user's.
    env.update(HOME=str(home), RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0", PYTHONUNBUFFERED="1")
    return env


def _our_processes(head_pid: int, temp_dir: Path) -> list[int]:
    """PIDs of this head's processes (read from /proc): its process group, or a command line or
    working directory inside its temp dir (job drivers run in the working-dir copy there)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
            if str(temp_dir) in cmdline or cwd.startswith(str(temp_dir)) or os.getpgid(int(entry.name)) == head_pid:
                out.append(int(entry.name))
        except (OSError, ProcessLookupError):  # gone, or not ours to inspect
            pass
    return out


def _log_tail(temp_dir: Path, name: str, n: int = 3000) -> str:
    logs = sorted(temp_dir.glob(f"session_*/logs/{name}"))
    return f"\n--- {name} ---\n" + logs[-1].read_text(errors="replace")[-n:] if logs else ""


@pytest.fixture(scope="module")
def head(corpus_cache):
    """A token-auth head node on loopback; yields (dashboard URL, GCS address, env with the token)."""
    # Not under pytest's basetemp, which other pytest sessions on the machine rotate away.
    base = Path(tempfile.mkdtemp(prefix="rt_head_", dir="/tmp"))
    home, temp_dir = base / "home", base / "ray"
    home.mkdir()
    env = _base_env(home)
    env["RAY_AUTH_MODE"] = "token"
    gen = subprocess.run([*RAY_CLI, "get-auth-token", "--generate"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert gen.returncode == 0, gen.stderr
    token = (home / ".ray" / "auth_token").read_text().strip()
    assert token and token in gen.stdout  # the command prints the token it saved

    gcs_port, dash_port = free_port(), free_port()
    log = open(base / "head.log", "w")
    proc = subprocess.Popen(
        [*RAY_CLI, "start", "--head", "--block", f"--port={gcs_port}", "--node-ip-address=127.0.0.1",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}",
         f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}",
         "--num-cpus=2", f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{dash_port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (base / "head.log").read_text()[-3000:]
            try:
                req = urllib.request.Request(f"{url}/api/version", headers={"Authorization": f"Bearer {token}"})
                if urllib.request.urlopen(req, timeout=5).status == 200:
                    break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, "head node did not come up in 180 s"
            time.sleep(1)
        yield {"url": url, "gcs": f"127.0.0.1:{gcs_port}", "env": env, "token": token, "base": base,
               "cache": corpus_cache, "temp_dir": temp_dir}
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` shuts its node down on SIGTERM
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        leftovers = _our_processes(proc.pid, temp_dir)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(base, ignore_errors=True)


def _submit(head, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`ray job submit --working-dir . -- python jobs/train.py ...`, waiting for the end."""
    return subprocess.run(
        [*RAY_CLI, "job", "submit", "--address", head["url"], "--working-dir", ".", "--",
         "python", "jobs/train.py", *args],
        cwd=REPO, env=env or head["env"], capture_output=True, text=True, timeout=400,
    )


def _job_id(head, out: subprocess.CompletedProcess) -> str:
    m = re.search(r"Job '(raysubmit_\w+)' submitted successfully", out.stdout + out.stderr)
    assert m, out.stdout[-2000:] + out.stderr[-3000:] + _log_tail(head["temp_dir"], "dashboard.log")
    return m.group(1)


def _status_and_logs(head, job_id: str) -> tuple[str, str]:
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(head["url"], headers={"Authorization": f"Bearer {head['token']}"})
    return str(client.get_job_status(job_id)), client.get_job_logs(job_id)


def test_submitted_job_trains_and_writes_metrics(head):
    import pyarrow.parquet as pq

    dump = head["base"] / "runs"
    out = _submit(head, "--config", "configs/debug_llama.toml", *SMALL,
                  f"--job.dump_folder={dump}", f"--data.cache_dir={head['cache']}", "--job.name=submitted")
    job_id = _job_id(head, out)
    status, logs = _status_and_logs(head, job_id)
    assert out.returncode == 0 and status.endswith("SUCCEEDED"), logs[-4000:] + out.stderr[-2000:]
    # jobs/train.py joined the head's cluster (RAY_ADDRESS, its GCS port), not a local one of its own.
    assert "Started a local Ray instance" not in logs
    assert re.search(rf"Connect\w* to existing Ray cluster at address: \S+:{head['gcs'].rsplit(':', 1)[1]}\b", logs), \
        logs[:3000]
    # The driver's lines, plain (not a TTY under ray job submit): the last stage's loss at the
    # first step, every log_freq steps and the last.
    for step in (1, 2, 4, 6):
        assert re.search(rf"^step\s+{step}/6 \| loss\s+\d+\.\d{{4}} \|", logs, re.M), logs[-4000:]
    assert "\r" not in logs  # no progress-bar redraws in a log file
    run_dir = Path(re.search(r"run dir (\S+)", logs).group(1))
    assert run_dir.parent == dump and run_dir.name.startswith("submitted-")
    steps = pq.read_table(run_dir / "metrics" / "steps.parquet")
    assert sorted(set(steps["step"].to_pylist())) == [1, 2, 3, 4, 5, 6]
    assert steps.num_rows == 6 * 2
    last = [r for r in steps.to_pylist() if r["is_last_stage"]]
    assert len(last) == 6 and all(r["loss"] > 0 for r in last)


def test_submitted_job_with_a_bad_config_fails_with_the_message(head):
    out = _submit(head, "--config", "configs/debug_llama.toml", "--training.global_batch_size=10")
    job_id = _job_id(head, out)
    status, logs = _status_and_logs(head, job_id)
    assert out.returncode != 0 and status.endswith("FAILED"), (status, logs[-3000:])
    assert ("config error: training.global_batch_size = 10 is not divisible by "
            "parallelism.microbatches × parallelism.dp_shard = 4 × 2 = 8") in logs


def test_client_without_the_token_is_refused(head):
    bare_home = head["base"] / "bare_home"
    bare_home.mkdir(exist_ok=True)
    no_token = _base_env(bare_home)  # no RAY_AUTH_*, and a HOME without ~/.ray/auth_token
    out = subprocess.run([*RAY_CLI, "job", "list", "--address", head["url"]], env=no_token,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Missing authentication token" in out.stderr, out.stderr[-2000:]
    wrong = {**no_token, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 32}
    out = _submit(head, "--config", "configs/debug_llama.toml", env=wrong)
    assert out.returncode != 0 and "Invalid authentication token" in out.stderr, out.stderr[-2000:]
    assert "submitted successfully" not in out.stdout
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{head['url']}/api/jobs/", timeout=10)
    assert e.value.code == 401


def test_python_driver_api_on_the_running_cluster(head):
    """ray_titan.train with RAY_ADDRESS joins the head; a file:// URI as dump folder works."""
    dump = head["base"] / "api_runs"
    code = (
        "import json, ray, ray_titan\n"
        "r = ray_titan.train('configs/debug_llama.toml', "
        f"{SMALL + ['--job.name=api', f'--job.dump_folder=file://{dump}', '--data.cache_dir=' + head['cache']]!r})\n"
        "print('RESULT', json.dumps({'run_dir': str(r.run_dir), 'final_loss': r.final_loss, "
        "'rows': r.steps.num_rows, 'session': ray.get_runtime_context().gcs_address}))\n"
    )
    env = {**head["env"], "RAY_ADDRESS": head["gcs"]}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(out.stdout.split("RESULT ", 1)[1])
    # Joined the head (its GCS port), did not start a local cluster of its own.
    assert res["session"].rsplit(":", 1)[1] == head["gcs"].rsplit(":", 1)[1]
    assert res["rows"] == 6 * 2 and res["final_loss"] > 0
    assert Path(res["run_dir"]).parent == dump
    assert (Path(res["run_dir"]) / "metrics" / "steps.parquet").is_file()
    assert re.search(r"^step\s+6/6 \| loss", out.stdout, re.M)
