"""Checkpoints and the non-finite policy without Ray: one process, the train loop in-process."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import shutil
import zlib

import numpy as np
import pytest

from ray_titan.checkpoint import (
    MANIFEST,
    CheckpointError,
    LocalCheckpointStorage,
    find_latest,
    read_manifest,
    resolve_checkpoint,
)
from ray_titan.config import ConfigError, load_config, merge_overrides
from ray_titan.metrics.collector.collector import MetricsCollector
from ray_titan.metrics.worker.report import LocalReporter
from ray_titan.preflight.checks import validate_job
from ray_titan.trainer import train_loop
from ray_titan.trainer.nonfinite import NonFiniteError
from tests.conftest import REPO


def _cfg(tmp_path, corpus_cache, *overrides):
    return load_config(REPO / "configs" / "debug_llama.toml", merge_overrides([
        "--parallelism.pp=1", "--parallelism.dp_shard=1", "--training.steps=4", "--checkpoint.interval=2",
        f"--data.cache_dir={corpus_cache}", f"--job.dump_folder={tmp_path}", "--training.threads_per_worker=1",
        "--metrics.enable_tensorboard=false", "--memory.breakdown_step=0"], overrides))


def _train(run_dir, cfg, save=True):
    """The train loop in this process; returns (step losses, skipped flags, grad norms, summary)."""
    collector = MetricsCollector(str(run_dir), 1, [0], cfg.training.steps, enable_tensorboard=False)
    storage = LocalCheckpointStorage(run_dir / "checkpoints", cfg.checkpoint.keep_latest_k) if save else None
    train_loop(cfg, LocalReporter(collector), None, checkpoint_storage=storage)
    summary = collector.finish()
    from ray_titan.metrics.reading.steps import read_steps

    t = read_steps(run_dir).sort_by("step")
    return t["step_loss"].to_pylist(), t["skipped_update"].to_pylist(), t["grad_norm"].to_pylist(), summary


def _saved_run(tmp_path_factory, corpus_cache):
    """4 steps with checkpoints at steps 2 and 4: (run directory, config, step losses)."""
    run_dir = tmp_path_factory.mktemp("saved")
    cfg = _cfg(run_dir, corpus_cache)
    losses, *_ = _train(run_dir, cfg)
    return run_dir, cfg, losses


@pytest.fixture(scope="module")
def saved(tmp_path_factory, corpus_cache):
    return _saved_run(tmp_path_factory, corpus_cache)


def _copy(src, tmp_path):
    dst = tmp_path / "checkpoints" / src.name
    shutil.copytree(src, dst)
    return dst




def test_load_model_only_starts_at_step_one_with_the_saved_weights(saved, tmp_path, corpus_cache):
    run_dir, _, losses = saved
    cfg = _cfg(tmp_path, corpus_cache, f"--checkpoint.load_path={run_dir / 'checkpoints' / 'step-00000004'}",
               "--checkpoint.load_model_only=true", "--training.steps=1", "--optimizer.name=SGD")
    fresh_start, *_ = _train(tmp_path, cfg, save=False)
    assert len(fresh_start) == 1  # step 1 of a new run: another optimizer is fine
    # The same first batch as the saved run's step 1, through trained weights: a lower loss.
    assert fresh_start[0] < losses[0] - 0.05


def test_manifest_lists_every_file_and_the_job(saved):
    run_dir, _, _ = saved
    m = read_manifest(run_dir / "checkpoints" / "step-00000004", verify_checksums=True)
    assert m["step"] == 4 and m["mesh"] == {"pp": 1, "dp_shard": 1, "stages_per_rank": 1}
    assert {".metadata", "__0_0.distcp", "reports/rank0.json"} <= set(m["files"])
    assert m["model"] == {"name": "llama", "flavor": "debug", "vocab_size": 258}


def test_partial_checkpoint_is_never_the_latest(saved, tmp_path):
    run_dir, _, _ = saved
    _copy(run_dir / "checkpoints" / "step-00000002", tmp_path)
    newest = _copy(run_dir / "checkpoints" / "step-00000004", tmp_path)
    (newest / MANIFEST).unlink()  # a save that crashed before its manifest
    assert find_latest(tmp_path / "checkpoints").name == "step-00000002"
    assert resolve_checkpoint(tmp_path).name == "step-00000002"  # a run directory resolves too
    with pytest.raises(CheckpointError, match=f"checkpoint {newest} is incomplete: it has no {MANIFEST}"):
        resolve_checkpoint(newest)


def test_a_run_directory_whose_latest_checkpoint_is_corrupt_falls_back_to_the_newest_good_one(
        saved, tmp_path, corpus_cache, capsys):
    run_dir, _, _ = saved
    good = _copy(run_dir / "checkpoints" / "step-00000002", tmp_path)
    bad = _copy(run_dir / "checkpoints" / "step-00000004", tmp_path)
    shard = bad / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only its CRC-32 tells
    shard.write_bytes(bytes(data))
    cfg = validate_job(_cfg(tmp_path / "run", corpus_cache, f"--checkpoint.load_path={tmp_path}",
                            "--training.steps=5"))
    assert cfg.checkpoint.load_path == str(good)  # the workers load what pre-flight checked
    err = capsys.readouterr().err
    assert f"passing over a damaged checkpoint (checkpoint {bad} is corrupt: __0_0.distcp fails its CRC-32 " \
           f"check); loading {good}" in err
    shard.write_bytes(b"")  # every checkpoint bad: an error naming them
    (good / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        validate_job(_cfg(tmp_path / "run", corpus_cache, f"--checkpoint.load_path={tmp_path}"))


@pytest.mark.parametrize("damage, message", [
    ("truncate", r"is corrupt: __0_0.distcp has \d+ bytes, the manifest says \d+"),
    ("flip", "is corrupt: __0_0.distcp fails its CRC-32 check"),
    ("delete", "is incomplete: __0_0.distcp is missing"),
    ("manifest", f"{MANIFEST} is corrupt"),
])
def test_damaged_checkpoint_is_a_clear_error(saved, tmp_path, corpus_cache, damage, message):
    run_dir, _, _ = saved
    ckpt = _copy(run_dir / "checkpoints" / "step-00000002", tmp_path)
    shard = ckpt / "__0_0.distcp"
    if damage == "truncate":
        os.truncate(shard, shard.stat().st_size - 10)
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "delete":
        shard.unlink()
    else:
        (ckpt / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match=message):
        read_manifest(ckpt, verify_checksums=True)
    cfg = _cfg(tmp_path / "run", corpus_cache, f"--checkpoint.load_path={ckpt}")
    with pytest.raises(ConfigError, match=message):  # before workers start: CRC-32s are checked there, once
        validate_job(cfg)
    if damage != "flip":
        with pytest.raises(CheckpointError, match=f"checkpoint {ckpt}"):  # the workers check sizes too
            _train(tmp_path / "run", cfg, save=False)


def _craft_metadata(ckpt, data: bytes) -> None:
    """Replace a checkpoint's .metadata and make its manifest match, as a hostile user with write
    access to shared storage would: only the unpickler stands in the way."""
    (ckpt / ".metadata").write_bytes(data)
    m = json.loads((ckpt / MANIFEST).read_text())
    m["files"][".metadata"] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (ckpt / MANIFEST).write_text(json.dumps(m))


def test_crafted_metadata_is_refused_before_workers_start_and_by_the_workers(saved, tmp_path, corpus_cache):
    run_dir, _, _ = saved
    ckpt = _copy(run_dir / "checkpoints" / "step-00000002", tmp_path)
    marker = tmp_path / "pwned"
    # Protocol 4: STACK_GLOBAL "torch.distributed.checkpoint.metadata" "os.system" ("touch ...").
    mod, name, cmd = (s.encode() for s in ("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}"))
    _craft_metadata(ckpt, b"\x80\x04\x8c" + bytes([len(mod)]) + mod + b"\x8c" + bytes([len(name)]) + name
                    + b"\x93\x8c" + bytes([len(cmd)]) + cmd + b"\x85R.")
    cfg = _cfg(tmp_path / "run", corpus_cache, f"--checkpoint.load_path={ckpt}")
    refused = "refusing to unpickle torch.distributed.checkpoint.metadata.os.system"
    with pytest.raises(ConfigError, match=rf"load_path = .*\.metadata is unreadable: UnpicklingError: {refused}"):
        validate_job(cfg)
    with pytest.raises(CheckpointError, match=rf"\.metadata is unreadable: UnpicklingError: {refused}"):
        _train(tmp_path / "run", cfg, save=False)  # a restarted worker group checks it too
    assert not marker.exists()


def test_metadata_that_points_outside_the_checkpoint_is_refused(saved, tmp_path, corpus_cache):
    from ray_titan.checkpoint import load_metadata

    run_dir, _, _ = saved
    ckpt = _copy(run_dir / "checkpoints" / "step-00000002", tmp_path)
    metadata = load_metadata(ckpt)
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].relative_path = "../../../etc/passwd"
    _craft_metadata(ckpt, pickle.dumps(metadata, protocol=4))
    cfg = _cfg(tmp_path / "run", corpus_cache, f"--checkpoint.load_path={ckpt}")
    with pytest.raises(ConfigError, match=r"\.metadata points .* to '\.\./\.\./\.\./etc/passwd', a path with '\.\.' "
                                          r"\(outside the checkpoint\); not a checkpoint this ray_titan wrote"):
        validate_job(cfg)


@pytest.mark.parametrize("override, message", [
    ("--model.flavor=8B", "DCP reshards across meshes, not across model shapes"),
    ("--optimizer.name=SGD", "holds AdamW optimizer state, this job uses optimizer.name = 'SGD'"),
    ("--training.seed=1", "the saved data position would not apply"),
    ("--training.steps=2", "is at step 2 but training.steps = 2: nothing left to train"),
])
def test_load_path_that_cannot_fit_is_refused_before_workers_start(saved, corpus_cache, override, message):
    run_dir, _, _ = saved
    cfg = _cfg(run_dir, corpus_cache, f"--checkpoint.load_path={run_dir / 'checkpoints' / 'step-00000002'}", override)
    with pytest.raises(ConfigError, match=message):
        validate_job(cfg)


def test_load_path_missing_or_empty_is_refused(tmp_path, corpus_cache):
    with pytest.raises(ConfigError, match="does not exist"):
        validate_job(_cfg(tmp_path, corpus_cache, f"--checkpoint.load_path={tmp_path / 'nope'}"))
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        validate_job(_cfg(tmp_path, corpus_cache, f"--checkpoint.load_path={tmp_path}"))


def test_max_failures_needs_checkpoints(corpus_cache, tmp_path):
    with pytest.raises(ConfigError, match="ray.max_failures = 2 with checkpoint.enable = false"):
        validate_job(_cfg(tmp_path, corpus_cache, "--ray.max_failures=2", "--checkpoint.enable=false"))
    validate_job(_cfg(tmp_path, corpus_cache, "--ray.max_failures=2"))  # allowed now


def test_nonfinite_stop_names_the_step_and_stage(tmp_path, corpus_cache):
    cfg = _cfg(tmp_path, corpus_cache, "--debug.nonfinite_loss_at_steps=[3]", "--checkpoint.enable=false")
    collector = MetricsCollector(str(tmp_path), 1, [0], cfg.training.steps, enable_tensorboard=False)
    with pytest.raises(NonFiniteError, match=r"step 3: the loss is not finite on the last stage \(stage 0\); "
                                             r"the gradient norm is nan \(non-finite gradients in stage\(s\) \[0\]\)"):
        train_loop(cfg, LocalReporter(collector), None)
    collector.finish()
    from ray_titan.metrics.reading.steps import read_steps

    t = read_steps(tmp_path)  # the failing step is recorded, its update dropped
    assert t["step"].to_pylist() == [1, 2, 3] and t["skipped_update"].to_pylist() == [False, False, True]


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_nonfinite_skip_drops_the_update_and_counts_it(tmp_path, corpus_cache, implementation):
    """The fused optimizer is told on the device (found_inf); the foreach one after a host read."""
    cfg = _cfg(tmp_path, corpus_cache, "--debug.nonfinite_loss_at_steps=[2]", "--training.on_nonfinite=skip",
               "--checkpoint.enable=false", f"--optimizer.implementation={implementation}")
    losses, skipped, grad_norms, summary = _train(tmp_path, cfg, save=False)
    assert skipped == [False, True, False, False] and summary["skipped_steps"] == 1
    assert math.isnan(losses[1]) and math.isnan(grad_norms[1])
    # Had the NaN update been applied, every later loss would be NaN.
    assert all(math.isfinite(x) for x in losses[2:])


def test_an_update_that_makes_weights_nonfinite_stops_or_is_undone(tmp_path, corpus_cache):
    """optimizer.lr = 1e300 is finite, but in fp32 it is inf: the first update makes every weight
    NaN from finite gradients (the reported run printed 'final loss nan' and exited 0)."""
    cfg = _cfg(tmp_path / "stop", corpus_cache, "--optimizer.lr=1e300", "--lr_scheduler.warmup_steps=0",
               "--checkpoint.enable=false")
    collector = MetricsCollector(str(tmp_path / "stop"), 1, [0], cfg.training.steps, enable_tensorboard=False)
    with pytest.raises(NonFiniteError, match=r"step 1: the optimizer update made parameters non-finite from finite "
                                             r"gradients \(optimizer.lr = 1e\+300 overflows"):
        train_loop(cfg, LocalReporter(collector), None)
    collector.finish()
    good = _cfg(tmp_path / "good", corpus_cache, "--checkpoint.enable=false", "--lr_scheduler.warmup_steps=0")
    good_losses, *_ = _train(tmp_path / "good", good, save=False)
    cfg = _cfg(tmp_path / "skip", corpus_cache, "--optimizer.lr=1e300", "--lr_scheduler.warmup_steps=0",
               "--training.on_nonfinite=skip")
    losses, skipped, _, summary = _train(tmp_path / "skip", cfg)
    # No update applied: RunResult.no_update_applied, `ray-titan train` exits 1 (issue 33, probe 8).
    assert skipped == [True] * 4 and summary["skipped_steps"] == 4 and summary["steps_run"] == 4
    assert losses[0] == good_losses[0] and all(math.isfinite(x) for x in losses)
    # Every update was undone: the weights stay the initial ones, and the checkpoints hold them.
    ckpt = find_latest(tmp_path / "skip" / "checkpoints")
    assert ckpt.name == "step-00000004"
    resumed = _cfg(tmp_path / "resumed", corpus_cache, "--checkpoint.load_model_only=true",
                   f"--checkpoint.load_path={ckpt}", "--checkpoint.enable=false", "--lr_scheduler.warmup_steps=0",
                   "--training.steps=1")
    first, *_ = _train(tmp_path / "resumed", resumed, save=False)
    assert first == good_losses[:1]


def test_nonfinite_weights_are_never_saved_or_loaded(saved, tmp_path):
    """The save refuses non-finite state (nothing written); a checkpoint whose weights were made
    NaN on disk (its manifest matching) is refused at load."""
    import torch
    from torch import nn

    from ray_titan.checkpoint import Checkpointer, load_metadata
    from ray_titan.metrics.worker.report import Reporter

    run_dir, cfg, _ = saved
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = type("Position", (), {"state_dict": lambda self: {"epoch": 0, "doc_pos": 0, "offset": 0}})()
    storage = LocalCheckpointStorage(tmp_path / "checkpoints", 0)
    ckpt = Checkpointer(cfg, 0, [model], opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0), loader,
                        Reporter(), storage, 258, torch.device("cpu"))
    with torch.no_grad():
        model[0].weight[1, 2] = float("nan")
    with pytest.raises(CheckpointError, match="step 3: parameters or optimizer state are not finite; no checkpoint"):
        ckpt.save(3)
    assert not (tmp_path / "checkpoints").exists()

    damaged = _copy(run_dir / "checkpoints" / "step-00000002", tmp_path)
    info = next(v for k, v in load_metadata(damaged).storage_data.items() if k.fqn.startswith("model."))
    shard = damaged / info.relative_path
    data = bytearray(shard.read_bytes())
    blob = bytes(data[info.offset:info.offset + info.length])  # one torch.save'd tensor
    raw = torch.load(io.BytesIO(blob), weights_only=True).numpy().tobytes()
    at = info.offset + blob.index(raw)
    data[at:at + 4] = np.float32(np.nan).tobytes()
    shard.write_bytes(bytes(data))
    m = json.loads((damaged / MANIFEST).read_text())
    m["files"][info.relative_path]["crc32"] = zlib.crc32(bytes(data))
    (damaged / MANIFEST).write_text(json.dumps(m))
    cfg = _cfg(tmp_path / "run", str(cfg.data.cache_dir), f"--checkpoint.load_path={damaged}")
    with pytest.raises(CheckpointError, match=f"checkpoint {damaged} holds non-finite model weights"):
        _train(tmp_path / "run", cfg, save=False)


def _tiny_checkpointer(tmp_path, rank=0):
    """A Checkpointer of a one-layer model saving to ``tmp_path / "checkpoints"``, no Ray."""
    import torch
    from torch import nn

    from ray_titan.checkpoint import Checkpointer
    from ray_titan.metrics.worker.report import Reporter

    cfg = _cfg(tmp_path, str(tmp_path / "cache"))
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = type("Position", (), {"state_dict": lambda self: {"epoch": 0, "doc_pos": 0, "offset": 0}})()
    storage = LocalCheckpointStorage(tmp_path / "checkpoints", 0)
    return Checkpointer(cfg, rank, [model], opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0), loader,
                        Reporter(), storage, 258, torch.device("cpu"))


def _disk_full(monkeypatch, free=4096):
    """Writing a checkpoint file fails as torch's zip writer fails on a full disk: a RuntimeError
    ("unexpected pos") whose context is the OSError ENOSPC; the filesystem has ``free`` bytes."""
    import errno
    import shutil as _shutil

    from torch.distributed.checkpoint import FileSystemWriter

    def write_data(self, plan, planner):
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904

    real = _shutil.disk_usage
    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    monkeypatch.setattr(_shutil, "disk_usage", lambda p: real(p)._replace(free=free))


def test_a_full_disk_gives_the_documented_message_and_removes_the_files(tmp_path, monkeypatch):
    """DCP raises its CheckpointException (a BaseException, not an Exception) for a failed write;
    the save removes this rank's files and says the documented message (issue 33, probe 6)."""
    import shutil as _shutil

    _disk_full(monkeypatch)
    write_dir = tmp_path / "checkpoints" / "step-00000003"
    real = _shutil.disk_usage  # the half-written files hold the space until they are removed
    monkeypatch.setattr(_shutil, "disk_usage", lambda p: real(p)._replace(free=0 if write_dir.exists() else 8 << 20))
    ckpt = _tiny_checkpointer(tmp_path)
    with pytest.raises(CheckpointError) as e:
        ckpt.save(3)
    assert str(e.value) == (f"step 3: writing the checkpoint to {write_dir} failed: OSError: No space left on device "
                            "(0.0 MiB free there; the filesystem is full)")
    assert not write_dir.exists()


def test_a_full_disk_on_another_rank_gives_every_rank_the_message(tmp_path, monkeypatch):
    """What DCP hands a rank whose own write succeeded: rank 1's error, sent over the process
    group (so without its context); the message names rank 1 and still measures the free space."""
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.api import _wrap_exception

    import ray_titan.checkpoint.checkpointer as checkpoint

    def save(*args, **kwargs):
        raise CheckpointException("write", {1: _wrap_exception(RuntimeError("unexpected pos 704 vs 598"))})

    _disk_full(monkeypatch, free=0)
    monkeypatch.setattr(checkpoint.dcp, "save", save)
    with pytest.raises(CheckpointError, match=r"^step 3: writing the checkpoint to .* failed on rank 1: RuntimeError: "
                                              r"unexpected pos 704 vs 598 \(0\.0 MiB free there; the filesystem is "
                                              r"full\)$"):
        _tiny_checkpointer(tmp_path).save(3)

    def interrupted(*args, **kwargs):  # DCP wraps this rank's KeyboardInterrupt too: it must still stop the rank
        raise CheckpointException("write", {0: _wrap_exception(KeyboardInterrupt())})

    monkeypatch.setattr(checkpoint.dcp, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _tiny_checkpointer(tmp_path).save(4)
    assert not (tmp_path / "checkpoints" / "step-00000004").exists()


# -- issue 33: paths outside the checkpoint (probe 5) and export of a damaged one (probe 3) ---------

def _touches(monkeypatch, target):
    """Record every os.stat / open of a path under ``target`` (what would size or read it)."""
    import builtins

    seen = []
    real_stat, real_open = os.stat, builtins.open

    def stat(p, *args, **kwargs):
        if str(target) in os.path.abspath(os.fspath(p)) if isinstance(p, (str, os.PathLike)) else False:
            seen.append(("stat", str(p)))
        return real_stat(p, *args, **kwargs)

    def open_(p, *args, **kwargs):
        if isinstance(p, (str, os.PathLike)) and str(target) in os.path.abspath(os.fspath(p)):
            seen.append(("open", str(p)))
        return real_open(p, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    return seen


@pytest.mark.parametrize("kind, why", [
    ("absolute", "an absolute path"),
    ("dotdot", "a path with '..'"),
    ("symlink", "a path through the symbolic link"),
])
def test_manifest_names_outside_the_checkpoint_are_refused_before_they_are_touched(
        saved, tmp_path, monkeypatch, kind, why):
    run_dir, _, _ = saved
    ckpt = _copy(run_dir / "checkpoints" / "step-00000002", tmp_path)
    secret = tmp_path / "outside" / "secret"
    secret.parent.mkdir()
    secret.write_bytes(b"not yours\n")
    if kind == "absolute":
        name = str(secret)
    elif kind == "dotdot":
        name = os.path.relpath(secret, ckpt)
    else:
        (ckpt / "reports" / "link").symlink_to(secret.parent)
        name = "reports/link/secret"
    m = json.loads((ckpt / MANIFEST).read_text())
    m["files"][name] = {"bytes": secret.stat().st_size, "crc32": zlib.crc32(secret.read_bytes())}  # true size, CRC
    (ckpt / MANIFEST).write_text(json.dumps(m))
    touched = _touches(monkeypatch, secret)
    with pytest.raises(CheckpointError, match=rf"checkpoint {ckpt}: {MANIFEST} lists '{name}', {why}"):
        read_manifest(ckpt, verify_checksums=True)
    with pytest.raises(CheckpointError, match=why):
        resolve_checkpoint(ckpt)
    assert touched == []


def test_metadata_storage_paths_outside_the_checkpoint_are_refused_before_they_are_opened(
        saved, tmp_path, monkeypatch):
    """A manifest that lists the escaping name too (what check_metadata trusted before): both
    pre-flight's check and the reader every DCP load goes through refuse it."""
    from ray_titan.checkpoint import SafeFileSystemReader, check_metadata, load_metadata

    run_dir, _, _ = saved
    ckpt = _copy(run_dir / "checkpoints" / "step-00000002", tmp_path)
    shard = ckpt / "__0_0.distcp"
    secret = tmp_path / "outside" / "__0_0.distcp"
    secret.parent.mkdir()
    shutil.copy(shard, secret)
    name = os.path.relpath(secret, ckpt)
    metadata = load_metadata(ckpt)
    for info in metadata.storage_data.values():
        info.relative_path = name
    _craft_metadata(ckpt, pickle.dumps(metadata, protocol=4))
    files = json.loads((ckpt / MANIFEST).read_text())["files"] | {name: {"bytes": secret.stat().st_size, "crc32": 0}}
    touched = _touches(monkeypatch, secret)
    with pytest.raises(CheckpointError, match=rf"\.metadata points '.*' to '{name}', a path with '\.\.' "
                                              r"\(outside the checkpoint\)"):
        check_metadata(load_metadata(ckpt), ckpt, files)
    with pytest.raises(CheckpointError, match=rf"\.metadata points '.*' to '{name}', a path with '\.\.'"):
        SafeFileSystemReader(str(ckpt)).read_metadata()
    assert touched == []


def _export(ckpt, out, *extra):
    from ray_titan.cli import main

    return main(["export", str(ckpt), "--to", "hf", str(out), "--dtype", "fp32", *extra])


def test_export_of_a_checkpoint_that_fails_its_crc_is_refused(saved, tmp_path, capsys):
    run_dir, _, _ = saved
    ckpt = _copy(run_dir / "checkpoints" / "step-00000002", tmp_path)
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert _export(ckpt, tmp_path / "out") == 2
    assert f"ray-titan export: checkpoint {ckpt} is corrupt: __0_0.distcp fails its CRC-32 check" \
        in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoints"]  # no OUT_DIR, no staging left


def _poison(ckpt, key, nbytes=8):
    """``nbytes`` of 0xFF (NaN in fp32) into tensor ``key``'s data, the manifest's CRC-32
    recomputed: only a finiteness check sees it."""
    from ray_titan.checkpoint import load_metadata

    info = next(v for k, v in load_metadata(ckpt).storage_data.items() if k.fqn == key)
    shard = ckpt / info.relative_path
    data = bytearray(shard.read_bytes())
    blob = bytes(data[info.offset:info.offset + info.length])
    raw = torch_load_bytes(blob)
    at = info.offset + blob.index(raw) + len(raw) // 2
    data[at:at + nbytes] = b"\xff" * nbytes
    shard.write_bytes(bytes(data))
    m = json.loads((ckpt / MANIFEST).read_text())
    m["files"][info.relative_path]["crc32"] = zlib.crc32(bytes(data))
    (ckpt / MANIFEST).write_text(json.dumps(m))


def torch_load_bytes(blob):
    import torch

    return torch.load(io.BytesIO(blob), weights_only=True).numpy().tobytes()


@pytest.mark.parametrize("key, hf_key, shard_gib", [
    ("model.tok_embeddings.weight", "model.embed_tokens.weight", 5.0),  # the first shard
    ("model.output.weight", "lm_head.weight", 2e-5),  # a later shard of several
])
def test_export_of_nonfinite_weights_is_refused_naming_the_tensor(saved, tmp_path, capsys, key, hf_key, shard_gib):
    run_dir, _, _ = saved
    ckpt = _copy(run_dir / "checkpoints" / "step-00000002", tmp_path)
    _poison(ckpt, key)
    read_manifest(ckpt, verify_checksums=True)  # the CRC-32s match: only finiteness tells
    assert _export(ckpt, tmp_path / "out", f"--max-shard-size={shard_gib}") == 2
    assert (f"ray-titan export: checkpoint {ckpt} holds non-finite model weights: {key} (Hugging Face {hf_key}) "
            "has NaN or infinite values; export an earlier checkpoint") in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoints"]  # no OUT_DIR, no staging left


def test_export_takes_the_tokenizer_only_from_inside_the_checkpoint(saved, tmp_path, capsys):
    """An older checkpoint (no hf/) whose manifest names a tokenizer elsewhere: nothing is copied
    from there, and one line says the export has no tokenizer files. A checkpoint's own hf/
    files (listed in its manifest) are copied."""
    run_dir, _, _ = saved
    ckpt = _copy(run_dir / "checkpoints" / "step-00000002", tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "tokenizer.json").write_text("not a tokenizer: must not be read")
    (elsewhere / "tokenizer_config.json").write_text("{}")
    m = json.loads((ckpt / MANIFEST).read_text())
    m["data"]["tokenizer"], m["tokenizer_path"] = "huggingface", str(elsewhere / "tokenizer.json")
    (ckpt / MANIFEST).write_text(json.dumps(m))
    assert _export(ckpt, tmp_path / "out") == 0
    assert not any((tmp_path / "out" / n).exists() for n in ("tokenizer.json", "tokenizer_config.json"))
    err = capsys.readouterr().err
    assert f"ray-titan export: note: checkpoint {ckpt} was saved before checkpoints kept their tokenizer files: " \
           "the export has no tokenizer files" in err

    from tests.support.hf_models import write_tokenizer

    write_tokenizer(ckpt / "hf")  # what a checkpoint keeps now: its tokenizer files in hf/
    kept = {p.name: p.read_bytes() for p in (ckpt / "hf").iterdir()}
    m["files"] |= {f"hf/{n}": {"bytes": len(d), "crc32": zlib.crc32(d)} for n, d in kept.items()}
    (ckpt / MANIFEST).write_text(json.dumps(m))
    assert _export(ckpt, tmp_path / "out2") == 0
    assert {n: (tmp_path / "out2" / n).read_bytes() for n in kept} == kept
    config = json.loads((tmp_path / "out2" / "config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == 0  # <|endoftext|>, from the kept files
    assert "note" not in capsys.readouterr().err


class _FakeCudaRng:
    """torch.cuda's generator calls as the CUDA path makes them, on a CPU-only build."""

    def __init__(self, monkeypatch):
        import contextlib

        import torch

        import ray_titan.checkpoint.checkpointer as checkpoint

        self.state = torch.arange(16, dtype=torch.uint8)  # what get_rng_state returns, as saved
        self.calls = []
        real_all_finite = checkpoint.all_finite
        monkeypatch.setattr(checkpoint, "all_finite",
                            lambda tensors, device: real_all_finite(tensors, torch.device("cpu")))
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.state.clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": self.calls.append(("set", state)))
        monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: self.calls.append(("seed", seed)))
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())


def _resume(tmp_path, saved_dir, device):
    import torch

    ckpt = _tiny_checkpointer(tmp_path / "resume")
    ckpt.loader.load_state_dict = lambda state: None  # the tiny loader's position is not the point here
    ckpt.cfg.checkpoint.load_path = str(saved_dir)
    ckpt.device = torch.device(device)
    return ckpt, ckpt.restore()


def test_a_checkpoint_saved_on_cpu_resumes_on_cuda_with_a_seeded_cuda_generator(tmp_path, monkeypatch, capsys):
    from ray_titan.checkpoint.checkpointer import _device_rng_seed

    _tiny_checkpointer(tmp_path).save(3)  # on CPU: no rng.rank0.cuda
    fake = _FakeCudaRng(monkeypatch)
    saved_dir = tmp_path / "checkpoints" / "step-00000003"
    ckpt, step = _resume(tmp_path, saved_dir, "cuda:0")
    assert step == 3
    seed = _device_rng_seed(ckpt.cfg.training.seed, 3, 0)
    assert fake.calls == [("seed", seed)]
    assert seed == _device_rng_seed(ckpt.cfg.training.seed, 3, 0) != _device_rng_seed(ckpt.cfg.training.seed, 3, 1)
    err = capsys.readouterr().err
    assert err.count("holds no CUDA generator state") == 1 and str(saved_dir) in err


def test_a_checkpoint_saved_on_cuda_resumes_on_cpu_and_on_cuda(tmp_path, monkeypatch):
    import torch

    fake = _FakeCudaRng(monkeypatch)
    saver = _tiny_checkpointer(tmp_path)
    saver.device = torch.device("cuda", 0)
    cpu_state = torch.get_rng_state()
    saver.save(3)
    saved_dir = tmp_path / "checkpoints" / "step-00000003"
    from torch.distributed.checkpoint import FileSystemReader

    saved_keys = FileSystemReader(str(saved_dir)).read_metadata().state_dict_metadata
    assert {"rng.rank0.cpu", "rng.rank0.cuda"} <= set(saved_keys)
    torch.manual_seed(12345)  # the resume must put the saved CPU state back
    _, step = _resume(tmp_path, saved_dir, "cpu")  # the CUDA state is not asked for
    assert step == 3 and fake.calls == [] and torch.equal(torch.get_rng_state(), cpu_state)
    _, step = _resume(tmp_path / "again", saved_dir, "cuda:0")
    assert step == 3 and [c[0] for c in fake.calls] == ["set"] and torch.equal(fake.calls[0][1], fake.state)


@pytest.mark.parametrize("change, message", [
    ({"n_layers": 10**8}, r"num_hidden_layers = 100000000 is not valid; valid: an integer from 1 to 256"),
    ({"dim": 10**9}, r"hidden_size = 1000000000 is not valid"),
])
def test_the_model_arguments_a_manifest_records_are_bounded_before_they_size_anything(saved, change, message):
    """Export builds the model (on meta) from the manifest's model_args: 1e8 layers passed 8 GB
    of RSS in minutes before; they pass the bounds of a config.json first (SIZE_FIELDS)."""
    from pathlib import Path

    from ray_titan.checkpoint.hf_export import _args_of
    from ray_titan.models.registry import get_spec

    run_dir, _, _ = saved
    m = json.loads((run_dir / "checkpoints" / "step-00000002" / MANIFEST).read_text())
    m["model_args"] |= change
    with pytest.raises(CheckpointError, match=rf"checkpoint x: the model arguments its manifest records.* are not "
                                              rf"valid: .*{message}"):
        _args_of(m, get_spec(m["model"]["name"]), Path("x"))


@pytest.mark.parametrize("change, message", [
    ({"n_layers": 300}, r"num_hidden_layers = 300 is not valid; valid: an integer from 1 to 256"),
    ({"rope_theta": float("nan")}, r"rope_theta = nan is not valid; valid: a finite number > 0"),
    ({"n_heads": 0}, r"ZeroDivisionError"),
])
def test_export_checks_the_model_arguments_a_manifest_records(saved, tmp_path, capsys, change, message):
    """An export of a checkpoint whose manifest records model arguments a config.json could not
    hold (SIZE_FIELDS, FLOAT_FIELDS, the family's relations) fails at once naming the checkpoint
    and the field, and writes nothing."""
    import time

    run_dir, _, _ = saved
    ckpt = _copy(run_dir / "checkpoints" / "step-00000002", tmp_path)
    m = json.loads((ckpt / MANIFEST).read_text())
    m["model_args"] |= change
    (ckpt / MANIFEST).write_text(json.dumps(m))
    t0 = time.perf_counter()
    assert _export(ckpt, tmp_path / "out") == 2
    assert time.perf_counter() - t0 < 10
    err = capsys.readouterr().err
    assert re.search(rf"ray-titan export: checkpoint {ckpt}: the model arguments its manifest records.* are not "
                     rf"valid: .*{message}", err), err
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoints"]


def test_a_huge_manifest_or_metadata_is_refused_from_its_size(saved, tmp_path):
    """The manifest and DCP's .metadata are read whole: one beyond its bound (a sparse file here;
    far above any real checkpoint's) is refused before it is read."""
    from ray_titan.checkpoint import MAX_MANIFEST_BYTES, MAX_METADATA_BYTES, load_metadata

    run_dir, _, _ = saved
    ckpt = _copy(run_dir / "checkpoints" / "step-00000002", tmp_path)
    with open(ckpt / ".metadata", "r+b") as f:
        f.truncate(MAX_METADATA_BYTES + 1)
    with pytest.raises(CheckpointError, match=rf"checkpoint {ckpt}: \.metadata has {MAX_METADATA_BYTES + 1} bytes; "
                                              rf"valid: at most {MAX_METADATA_BYTES} \(MAX_METADATA_BYTES\)"):
        load_metadata(ckpt)
    with open(ckpt / MANIFEST, "r+b") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)
    with pytest.raises(CheckpointError, match=rf"checkpoint {ckpt}: {MANIFEST} has {MAX_MANIFEST_BYTES + 1} bytes; "
                                              rf"valid: at most {MAX_MANIFEST_BYTES} \(MAX_MANIFEST_BYTES\)"):
        read_manifest(ckpt)


def test_a_failed_write_of_the_side_files_fails_the_save_cleanly(tmp_path, monkeypatch):
    """The metrics reports and hf/ files are written after DCP's shards, by this process alone: a
    failure there (disk full) is the same CheckpointError with the documented message, and the
    rank's files are removed (on several ranks a flag all-reduce tells every rank)."""
    import errno
    import shutil as _shutil
    from pathlib import Path as _Path

    real_usage = _shutil.disk_usage
    monkeypatch.setattr(_shutil, "disk_usage", lambda p: real_usage(p)._replace(free=0))
    real = _Path.write_text

    def write_text(self, *args, **kwargs):
        if self.parent.name == "reports":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(_Path, "write_text", write_text)
    write_dir = tmp_path / "checkpoints" / "step-00000003"
    with pytest.raises(CheckpointError, match=r"^step 3: writing the checkpoint to .* No space left on device.*"
                                              r"the filesystem is full\)$"):
        _tiny_checkpointer(tmp_path).save(3)
    assert not write_dir.exists()


@pytest.mark.parametrize("holds_embedding", [False, True], ids=["last_stage_alone", "first_and_last_stages"])
def test_embedding_copies_absent_from_a_checkpoint_are_read_as_the_embedding(tmp_path, holds_embedding):
    """A checkpoint saved where no stage held a copy of the embedding (one stage: the tied head and
    multi-token prediction's ``mtp_embeddings`` are the embedding) loaded by a last pipeline stage
    that holds both copies: alone (they are read from the embedding's values) or beside the
    first stage on one rank (a V-shaped schedule: set equal to the loaded embedding). Weights,
    AdamW state and param-group settings equal the embedding's; the other weights load as saved."""
    import torch
    from torch import nn

    from ray_titan.checkpoint import Checkpointer
    from ray_titan.metrics.worker.report import Reporter

    class Stage(nn.Module):
        def __init__(self, first: bool, last: bool):
            super().__init__()
            self.tok_embeddings = nn.Embedding(10, 4) if first else None
            self.layers = nn.ModuleDict({"0": nn.Linear(4, 4)} if first else {"1": nn.Linear(4, 4)})
            if last and not first:
                self.output = nn.Linear(4, 10, bias=False)  # a tied head's copy
                self.mtp_embeddings = nn.Embedding(10, 4)
            elif last:
                self.layers["1"] = nn.Linear(4, 4)

    cfg = _cfg(tmp_path, str(tmp_path / "cache"))
    loader = type("Position", (), {"state_dict": lambda self: {"epoch": 0, "doc_pos": 0, "offset": 0},
                                   "load_state_dict": lambda self, sd: None})()

    def checkpointer(stages, lr, write):
        params = [p for s in stages for p in s.parameters()]
        opt = torch.optim.AdamW(params, lr=lr)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()  # state of its own in each slot: what the load must overwrite
        storage = LocalCheckpointStorage(tmp_path / write, 0)
        return Checkpointer(cfg, 0, stages, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0), loader,
                            Reporter(), storage, 258, torch.device("cpu")), opt

    torch.manual_seed(0)
    whole = Stage(first=True, last=True)
    saver, saved_opt = checkpointer([whole], 1e-3, "saved")
    saver.save(3)
    emb = whole.tok_embeddings.weight
    want = {k: v.clone() for k, v in saved_opt.state[emb].items()}

    last = Stage(first=False, last=True)
    stages = [Stage(first=True, last=False), last] if holds_embedding else [last]
    loading, opt = checkpointer(stages, 5e-2, "loading")
    assert loading._load(tmp_path / "saved" / "step-00000003", model_only=False, own=False) == 3
    torch.testing.assert_close(last.layers["1"].weight, whole.layers["1"].weight, rtol=0, atol=0)
    for copy in (last.output.weight, last.mtp_embeddings.weight, *([stages[0].tok_embeddings.weight]
                                                                   if holds_embedding else [])):
        torch.testing.assert_close(copy, emb, rtol=0, atol=0)
        for key, value in want.items():
            torch.testing.assert_close(opt.state[copy][key], value, rtol=0, atol=0)
    assert {g["lr"] for g in opt.param_groups} == {1e-3}
