"""Run directories on a local path or a pyarrow filesystem URI (ray_titan.storage), no Ray."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

import ray_titan.driver.run as driver
import ray_titan.run_dir as run_dirs
from ray_titan import storage
from ray_titan.config import ConfigError, load_config
from ray_titan.metrics.collector.collector import MetricsCollector
from ray_titan.metrics.reading.steps import read_steps
from ray_titan.parallel.dims import ParallelDims
from tests.unit.test_collector import _report


def test_local_paths_and_file_uris_are_local(tmp_path):
    assert storage.local_path(f"file://{tmp_path}/runs") == tmp_path / "runs"
    assert storage.local_path("~/x") == storage.local_path("~/x").expanduser().resolve()
    assert storage.local_path("s3://bucket/runs") is None
    assert (storage.is_remote("gs://b/x") and not storage.is_remote(f"file://{tmp_path}")
            and not storage.is_remote("rel/x"))
    assert storage.join("s3://bucket/runs/", "a", "b.parquet") == "s3://bucket/runs/a/b.parquet"
    assert storage.join(f"file://{tmp_path}", "a") == str(tmp_path / "a")
    assert storage.join("s3://b/m?endpoint_override=h:1", "config.json") == "s3://b/m/config.json?endpoint_override=h:1"


def test_write_read_and_makedirs_through_pyarrow(tmp_path):
    uri = f"file://{tmp_path}/deep/er"
    storage.makedirs(uri)
    assert (tmp_path / "deep" / "er").is_dir()
    storage.write_text(storage.join(uri, "config.json"), '{"a": 1}')
    assert storage.read_text(storage.join(uri, "config.json")) == '{"a": 1}'
    assert storage.exists(storage.join(uri, "config.json")) and not storage.exists(storage.join(uri, "nope"))


def test_make_run_dir_on_a_file_uri_is_a_local_path(tmp_path):
    cfg = run_dirs.resolve_paths(load_config(None, [f'--job.dump_folder="file://{tmp_path}/runs"', "--job.name=u"]))
    assert cfg.job.dump_folder == str(tmp_path / "runs")
    run_dir = run_dirs.make_run_dir(cfg)
    assert run_dir.parent == tmp_path / "runs" and run_dir.is_dir() and run_dir.name.startswith("u-")


def test_collector_on_a_remote_uri_stages_locally_and_uploads(tmp_path, monkeypatch):
    """A remote run dir (any scheme but file) is written to a staging dir and mirrored to the
    URI at every flush and at the end. The 'remote' here is a file:// URI behind the mirror."""
    remote = tmp_path / "bucket" / "run"
    monkeypatch.setattr(storage, "is_remote", lambda uri: str(uri).startswith("mem://"))
    monkeypatch.setattr(storage, "staging_dir", lambda uri: (tmp_path / "staging").resolve())
    monkeypatch.setattr(storage, "Mirror", lambda local, dest: _FileMirror(local, remote))
    (tmp_path / "staging").mkdir()
    dims = ParallelDims(pp=2, dp_shard=1)
    c = MetricsCollector("mem://bucket/run", 2, dims.last_stage_ranks(), 4, flush_every_steps=2,
                         enable_tensorboard=True)
    for step in (1, 2):
        c.report([_report(step, 0, dims), _report(step, 1, dims, loss=2.0)])
    parts = sorted(p.name for p in (remote / "metrics" / "parts").iterdir())
    assert parts == ["part-00000.parquet"]  # uploaded at the first flush, before the run ends
    for step in (3, 4):
        c.report([_report(step, 0, dims), _report(step, 1, dims, loss=1.0)])
    summary = c.finish()
    assert summary["errors"] == []
    assert read_steps(remote)["step"].to_pylist() == [1, 1, 2, 2, 3, 3, 4, 4]
    assert any((remote / "tb").iterdir())
    # Each sync uploads what is new or changed: a part once, not again at every later flush.
    uploads = [rel for batch in c.mirror.batches for rel in batch]
    assert uploads.count("metrics/parts/part-00000.parquet") == 1 and "metrics/steps.parquet" in uploads


class _FileMirror(storage.Mirror):
    def __init__(self, local, dest):
        super().__init__(local, f"file://{dest}")
        self.batches: list[list[str]] = []

    def sync(self):
        self.batches.append(super().sync())
        return self.batches[-1]


def test_read_steps_from_a_uri(tmp_path, monkeypatch):
    dims = ParallelDims(pp=1, dp_shard=1)
    c = MetricsCollector(str(tmp_path), 1, dims.last_stage_ranks(), 3, flush_every_steps=1, enable_tensorboard=False)
    for step in (1, 2, 3):
        c.report([_report(step, 0, dims, loss=1.5)])
    uri = f"file://{tmp_path}"
    assert read_steps(uri)["step"].to_pylist() == [1, 2, 3]  # the parts, before the run ends
    # A restarted worker group replays step 3; its collector keeps both rows in the parts until
    # they are consolidated, and a reader sees one row per step, the newer one.
    replay = _report(3, 0, dims, loss=0.5)
    replay["attempt_start_time"] = 2000.0
    c.report([replay])
    t = read_steps(uri)
    assert t["step"].to_pylist() == [1, 2, 3] and t["loss"].to_pylist() == [1.5, 1.5, 0.5]
    c.finish()
    assert not (tmp_path / "metrics" / "parts").exists()
    assert read_steps(uri)["step"].to_pylist() == [1, 2, 3]


@pytest.mark.parametrize("overrides, message", [
    (['--job.dump_folder="nosuchfs://bucket/runs"'],
     r"job.dump_folder = 'nosuchfs://bucket/runs': pyarrow cannot open it: .*Unrecognized filesystem"),
    # No network here: a bucket whose storage never answers, and an endpoint that refuses (the S3
    # client retries for ~15 s). Either must end at job.storage_timeout_s, not block for minutes.
    (['--job.dump_folder="gs://ray-titan-unreachable/runs"', "--job.storage_timeout_s=2"],
     r"job.dump_folder = 'gs://ray-titan-unreachable/runs': no answer from its storage within 2 s"),
    (['--job.dump_folder="s3://bucket/runs?endpoint_override=127.0.0.1:1&scheme=http"', "--job.storage_timeout_s=2"],
     r"no answer from its storage within 2 s \(unreachable endpoint or bucket"),
    # procfs answers "No such file or directory" to any new name: say what refused it.
    (["--job.dump_folder=/proc/ray_titan_runs"],
     r"dump_folder = '/proc/ray_titan_runs': cannot create it: it is on a proc filesystem, which takes no new files"),
    (["--job.dump_folder=/proc"],
     r"dump_folder = '/proc': cannot write there: it is on a proc filesystem, which takes no new files \(a kernel"),
    (["--job.dump_folder=/dev/null"], r"job.dump_folder = '/dev/null': cannot write there: Not a directory"),
])
def test_unusable_dump_folder_is_refused_before_workers(overrides, message, monkeypatch):
    monkeypatch.setattr(driver, "connect", lambda cfg: pytest.fail("the driver started Ray for an invalid config"))
    started = time.monotonic()
    with pytest.raises(ConfigError, match=message):
        driver.train(load_config(None, overrides))
    assert time.monotonic() - started < 20


def test_dump_folder_probe_leaves_nothing_and_refuses_a_read_only_mount(tmp_path):
    deep = tmp_path / "a" / "b" / "runs"
    storage.check_writable(deep, 5)
    assert list(tmp_path.iterdir()) == []  # the probe file and the directories made for it are gone
    (tmp_path / "file").write_text("x")
    with pytest.raises(storage.StorageError, match=r"file/runs: cannot create it: Not a directory"):
        storage.check_writable(tmp_path / "file" / "runs", 5)
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("mounting a read-only tmpfs needs root")
    try:
        with pytest.raises(storage.StorageError, match=r"ro: cannot write there: Read-only file system"):
            storage.check_writable(ro, 5)
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_jobs_probing_one_new_dump_folder_at_once_all_pass(tmp_path):
    """Two jobs launched together with the default ``outputs`` found each other's half-made
    directory ("cannot create it: File exists") or lost it to the other's clean-up ("cannot
    write there: No such file or directory"). Eight probes at once, many rounds: none refused."""
    from concurrent.futures import ThreadPoolExecutor

    def probe(i: int) -> None:
        storage.check_writable(tmp_path / f"round{i // 8}" / "runs", 5)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(probe, range(8 * 40)))
    assert not list(tmp_path.rglob(f"{storage.PROBE_NAME}*"))  # every probe file removed


def test_rank_reports_need_a_local_dump_folder(monkeypatch):
    from ray_titan.preflight.checks import validate_job

    monkeypatch.setattr(storage, "resolve", lambda uri: (None, str(uri)))  # no network for s3://
    cfg = load_config(None, ['--job.dump_folder="s3://bucket/runs"', "--metrics.save_rank_reports=true"])
    with pytest.raises(ConfigError, match=r"metrics.save_rank_reports = true writes local files .* is remote"):
        validate_job(cfg)


# An S3 endpoint on a closed local port: pyarrow's client retries for ~15 s, so without the probe's
# deadline each of these blocks (a gs:// bucket without network blocked for minutes, deaf to Ctrl-C).
_UNREACHABLE = "s3://bucket/{}?endpoint_override=127.0.0.1:1&scheme=http"


@pytest.mark.parametrize("setting, overrides", [
    ("checkpoint.initial_load_hf", []),
    ("checkpoint.load_path", []),
    ("data.path", ["--data.source=parquet"]),
    ("data.tokenizer_path", ["--data.tokenizer=huggingface"]),
    ("validation.path", ["--validation.enable=true", "--validation.source=parquet"]),
])
def test_an_unreachable_location_is_refused_within_the_storage_timeout(setting, overrides, monkeypatch):
    """Every location a job reads goes through the one probe (storage.probe_location): a child
    process stopped at job.storage_timeout_s, and an error naming the setting and the location."""
    monkeypatch.setattr(driver, "connect", lambda cfg: pytest.fail("the driver started Ray for an invalid config"))
    uri = _UNREACHABLE.format("x") if setting != "checkpoint.initial_load_hf" else "gs://ray-titan-unreachable/model"
    started = time.monotonic()
    with pytest.raises(ConfigError, match=rf"^{setting} = '{re.escape(uri)}': no answer from its storage within 1 s "
                       r".*\(job.storage_timeout_s = 1 s is the wait\)"):
        driver.train(load_config(None, [f'--{setting}="{uri}"', "--job.storage_timeout_s=1", *overrides]))
    assert time.monotonic() - started < 1 + 8  # the deadline, a child's start and the driver's imports


def test_local_locations_are_not_probed_in_a_child(tmp_path, monkeypatch):
    monkeypatch.setattr(storage.subprocess, "run", lambda *a, **k: pytest.fail("a child process for a local path"))
    storage.check_reachable(tmp_path / "model", 1)
    storage.check_reachable(f"file://{tmp_path}/model", 1)


def test_a_storage_that_answered_is_not_probed_again(monkeypatch):
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd[-1])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(storage, "_ANSWERED", set())
    monkeypatch.setattr(storage.subprocess, "run", run)
    storage.check_reachable("s3://bucket/model/config.json", 5)
    storage.check_reachable("s3://bucket/model/tokenizer.json", 5)
    storage.check_reachable("s3://other/model", 5)
    assert calls == ["s3://bucket/model/config.json", "s3://other/model"]


def test_staged_output_uploads_a_remote_directory_whole_with_the_marker_last(tmp_path, monkeypatch):
    """A remote directory is staged locally and uploaded at the end, config.json last; a failure
    inside the block uploads nothing and leaves no staging behind. The 'remote' is a local dir."""
    remote = tmp_path / "bucket"
    monkeypatch.setattr(storage, "check_writable", lambda uri, timeout_s: None)
    monkeypatch.setattr(storage, "resolve", lambda uri: (storage.pafs.LocalFileSystem(), str(remote / "out")))
    sent = []
    copy = storage.pafs.copy_files
    monkeypatch.setattr(storage.pafs, "copy_files", lambda src, dst, **kw: (sent.append(dst), copy(src, dst, **kw)))
    with pytest.raises(KeyboardInterrupt):
        with storage.staged_output("mem://bucket/out", last=("config.json",)) as staging:
            (Path(staging) / "a.safetensors").write_bytes(b"x")
            raise KeyboardInterrupt
    assert sent == [] and not Path(staging).exists()
    with storage.staged_output("mem://bucket/out", last=("config.json",)) as staging:
        for name in ("config.json", "b.safetensors", "a.safetensors"):
            (Path(staging) / name).write_text(name)
    assert [s.rsplit("/", 1)[-1] for s in sent] == ["a.safetensors", "b.safetensors", "config.json"]
    assert (remote / "out" / "config.json").read_text() == "config.json" and not Path(staging).exists()
    with pytest.raises(storage.StorageError, match="already exists and is not empty"):
        with storage.staged_output("mem://bucket/out"):
            pass


def test_staged_output_fills_an_empty_directory_and_refuses_a_full_one(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # An empty directory that exists (a mount point, say) is staged inside, never beside it.
    with pytest.raises(RuntimeError), storage.staged_output(out) as staging:
        assert Path(staging).parent == out and Path(staging).name.startswith(".partial-")
        (Path(staging) / "model.safetensors").write_text("x")
        raise RuntimeError("a damaged tensor at the last shard")
    assert list(out.iterdir()) == []
    with storage.staged_output(out, last=("config.json",)) as staging:
        (Path(staging) / "config.json").write_text("{}")
        (Path(staging) / "model.safetensors").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with pytest.raises(storage.StorageError, match=r"out: already exists and is not an empty directory"):
        with storage.staged_output(out):
            pytest.fail("the block ran")
    with pytest.raises(RuntimeError):
        with storage.staged_output(tmp_path / "deep" / "other") as staging:
            (Path(staging) / "x").write_text("x")
            raise RuntimeError("a damaged tensor at the last shard")
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == []


def test_sigterm_while_a_location_is_probed_ends_train_at_once(tmp_path):
    """Issue 33, probe 1: SIGTERM to a driver blocked reading an unreachable initial_load_hf went
    through the forced exit 30 s later, naming a run directory that did not exist yet. The probe
    runs in a child process: the driver acts on the signal at once and says what was made."""
    import os
    import signal
    import sys

    from tests.conftest import REPO

    proc = subprocess.Popen(
        [sys.executable, "-m", "ray_titan", "train", "--checkpoint.initial_load_hf=gs://ray-titan-unreachable/model",
         "--job.storage_timeout_s=120", f"--job.dump_folder={tmp_path}"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    def probing() -> bool:  # the probe's child process has started
        for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
            try:
                if b"get_file_info" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
            except OSError:
                pass
        return False

    deadline = time.monotonic() + 120
    while not probing():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no probe in a child process within 120 s: {proc.communicate()[1][-2000:]}")
        time.sleep(0.2)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and time.monotonic() - started < 15, (proc.returncode, err)
    assert "ray_titan: interrupted (SIGTERM); no run directory was made yet" in err and "still stopping" not in err
    assert list(tmp_path.iterdir()) == []


def test_relative_paths_of_every_setting_are_made_absolute_before_workers_start(tmp_path, monkeypatch):
    """Ray Train runs the workers in another working directory: validation.path and
    checkpoint.load_path (as data.path) are made absolute where the job is loaded; URIs stay."""
    monkeypatch.chdir(tmp_path)
    cfg = run_dirs.resolve_paths(load_config(None, [
        "--data.source=jsonl", "--data.path=train.jsonl", "--validation.path=val.jsonl",
        "--checkpoint.load_path=runs/old", "--data.chat_template_path=chat.jinja"]))
    assert (cfg.data.path, cfg.validation.path, cfg.checkpoint.load_path, cfg.data.chat_template_path) == (
        str(tmp_path / "train.jsonl"), str(tmp_path / "val.jsonl"), str(tmp_path / "runs" / "old"),
        str(tmp_path / "chat.jinja"))
    uris = run_dirs.resolve_paths(load_config(None, [
        "--data.source=jsonl", "--data.path=s3://b/train.jsonl", "--validation.path=s3://b/val.jsonl?region=x",
        f"--checkpoint.load_path=file://{tmp_path}/old"]))
    assert (uris.data.path, uris.validation.path, uris.checkpoint.load_path) == (
        "s3://b/train.jsonl", "s3://b/val.jsonl?region=x", str(tmp_path / "old"))


def test_a_file_beside_a_uri_keeps_its_options(tmp_path, monkeypatch):
    """tokenizer_config.json beside data.tokenizer_path: a URI's ?options stay last (cutting at the
    last '/' dropped them: a different endpoint, or none), in the tokenizer and in what a
    checkpoint keeps for an export."""
    from types import SimpleNamespace

    from ray_titan.checkpoint.manifest import _hf_files
    from ray_titan.data.tokenizer import HFTokenizer
    from tests.support.hf_models import write_tokenizer

    uri = "s3://b/m/tokenizer.json?endpoint_override=http://h:9000/x"
    assert storage.sibling(uri, "tokenizer_config.json") == \
        "s3://b/m/tokenizer_config.json?endpoint_override=http://h:9000/x"
    assert storage.sibling(f"file://{tmp_path}/m/tokenizer.json", "x.json") == str(tmp_path / "m" / "x.json")
    tokenizer = write_tokenizer(tmp_path / "m").read_bytes()
    files = {uri: tokenizer, "s3://b/m/tokenizer_config.json?endpoint_override=http://h:9000/x":
             b'{"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}'}
    asked = []

    def read_bytes(u, *args, **kwargs):
        asked.append(str(u))
        if str(u) not in files:
            raise FileNotFoundError(u)
        return files[str(u)]

    monkeypatch.setattr(storage, "exists", lambda u: str(u) in files)
    monkeypatch.setattr(storage, "read_bytes", read_bytes)
    HFTokenizer(uri)
    assert asked == [uri, "s3://b/m/tokenizer_config.json?endpoint_override=http://h:9000/x"]
    cfg = SimpleNamespace(data=SimpleNamespace(tokenizer="huggingface", tokenizer_path=uri),
                          checkpoint=SimpleNamespace(initial_load_hf=None))
    assert set(_hf_files(cfg)) == {"tokenizer.json", "tokenizer_config.json"}


def test_a_small_file_read_whole_is_size_checked_before_it_is_read(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(2**32)  # sparse: 4 GiB of nothing
    t0 = time.perf_counter()
    with pytest.raises(storage.FileTooLargeError, match=rf"{big} has 4294967296 bytes; valid: at most 1024 \(X\)"):
        storage.read_bytes(big, 1024, "X")
    assert time.perf_counter() - t0 < 1.0
    (tmp_path / "small").write_text("ok")
    assert storage.read_text(f"file://{tmp_path}/small", 2) == "ok"
