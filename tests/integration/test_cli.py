"""The three entry points run the same driver; a bad config fails before Ray starts (no Ray)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

ENTRY_POINTS = {
    "ray-titan": [shutil.which("ray-titan") or "ray-titan", "train"],
    "python -m ray_titan": [sys.executable, "-m", "ray_titan", "train"],
    "jobs/train.py": [sys.executable, str(REPO / "jobs" / "train.py")],
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_config_error_exits_2_with_the_message_before_ray(entry, tmp_path):
    out = subprocess.run(
        [*ENTRY_POINTS[entry], "--config", str(REPO / "configs" / "debug_llama.toml"),
         "--training.global_batch_size=10"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert ("ray-titan train: config error: training.global_batch_size = 10 is not divisible by "
            "parallelism.microbatches × parallelism.dp_shard = 4 × 2 = 8") in out.stderr
    assert "Started a local Ray instance" not in out.stdout + out.stderr
    assert not (tmp_path / "outputs").exists()  # no run directory either


def test_help_lists_train(tmp_path):
    out = subprocess.run([*ENTRY_POINTS["ray-titan"][:1], "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "train" in out.stdout


def _all_parsers(parser):
    import argparse

    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def test_every_option_of_every_command_is_described():
    import argparse

    from ray_titan.cli import _parser
    from ray_titan.config.docs import sections

    parsers = list(_all_parsers(_parser()))
    assert {p.prog for p in parsers} == {"ray-titan", "ray-titan train", "ray-titan config",
                                         "ray-titan config show", "ray-titan config docs", "ray-titan report",
                                         "ray-titan export", "ray-titan memory", "ray-titan memory plan",
                                         "ray-titan dry-run"}
    for p in parsers:
        assert p.description, p.prog
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                assert all(len(c.help or "") > 15 for c in action._choices_actions), p.prog
                continue
            assert action.help and len(action.help) > 15, (p.prog, action.dest)
    # train --help lists every setting it can override, with its description.
    out = subprocess.run([sys.executable, "-m", "ray_titan", "train", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for name, cls in sections():
        for key, field in cls.model_fields.items():
            assert f"--{name}.{key}  (" in out.stdout, f"{name}.{key}"
            assert field.description, f"{name}.{key} has no description (add a docstring below it)"
            assert " ".join(field.description.split())[:40] in " ".join(out.stdout.split())


def test_config_show_prints_the_resolved_config_with_defaults(capsys):
    import tomllib

    from ray_titan.cli import main
    from ray_titan.config import JobConfig, load_config

    cfg_path = str(REPO / "configs" / "debug_llama.toml")
    assert main(["config", "show", cfg_path, "--training.steps=7", "--optimizer.lr=1e-4"]) == 0
    text = capsys.readouterr().out
    assert "steps = 7\n" in text and "lr = 0.0001\n" in text
    assert "max_inflight_reports = 16\n" in text  # a default the TOML file does not set
    assert "# tokenizer_path = (unset)" in text
    assert JobConfig.from_dict(tomllib.loads(text)) == load_config(
        cfg_path, ["--training.steps=7", "--optimizer.lr=1e-4"])
    assert main(["config", "show", "--training.bogus=1"]) == 2
    assert "unknown setting 'training.bogus'" in capsys.readouterr().err
    assert main(["config", "show", "--validate", "--training.global_batch_size=10"]) == 2
    assert "training.global_batch_size = 10 is not divisible" in capsys.readouterr().err


def test_committed_config_reference_matches_the_config_classes():
    from ray_titan.config.docs import REGENERATE, reference_markdown, sections

    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == reference_markdown(), f"docs/configuration.md is stale: run {REGENERATE}"
    for name, cls in sections():
        assert f"## `[{name}]`" in committed
        for key in cls.model_fields:
            assert f"| `{key}` |" in committed


def test_a_signal_ends_the_driver_within_its_grace_period_whatever_it_waits_on(tmp_path):
    """The driver's main thread stuck (here: a SIGINT handler that does nothing, as a call into
    C++ that never returns to Python would): SIGTERM still ends the process, with status 143,
    after the grace period, and a second signal ends it at once. SIGHUP (a closed terminal) alike,
    status 129: it ended the process at once, nothing flushed (issue 44, finding 7)."""
    import signal
    import time

    code = (
        "import signal, time\n"
        "from ray_titan.driver.signals import SignalGuard\n"
        "with SignalGuard(grace_s=1.5):\n"
        "    signal.signal(signal.SIGINT, lambda signum, frame: None)  # the main thread never acts on it\n"
        "    print('ready', flush=True)\n"
        "    while True:\n"
        "        time.sleep(60)\n"
    )
    for signals, within in (((signal.SIGTERM,), (1.2, 6.0)), ((signal.SIGHUP,), (1.2, 6.0)),
                            ((signal.SIGINT, signal.SIGINT), (0.0, 1.2))):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.stdout.readline() == "ready\n"
        started = time.monotonic()
        for s in signals:
            proc.send_signal(s)
            time.sleep(0.2)
        _, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - started
        assert proc.returncode == 128 + signals[0], err
        assert within[0] <= elapsed <= within[1], elapsed
        assert f"still stopping 1.5 s after {signals[0].name} (or signalled again): exiting now" in err


@pytest.mark.parametrize("skipped, status, line", [
    (3, 1, r"^ray_titan: no update was applied: 3 of 3 updates skipped \(training\.on_nonfinite = 'skip' dropped "
           r"every one; the weights are those the run started from\); final loss 5\.538, metrics .*, no checkpoint"),
    (1, 0, r"^ray_titan: done: final loss 5\.538 \(1 of 3 updates skipped\), metrics .*, no checkpoint was saved$"),
    (0, 0, r"^ray_titan: done: final loss 5\.538, metrics .*, no checkpoint was saved$"),
])
def test_a_run_that_applied_no_update_exits_1_and_its_last_line_counts_the_skipped(
        skipped, status, line, monkeypatch, capsys, tmp_path):
    """Issue 33, probe 8: `--optimizer.lr=1e300 --training.on_nonfinite=skip` undid 3 of 3
    updates and exited 0 with `done: final loss 5.5380`."""
    import re

    import pyarrow as pa

    import ray_titan.driver as driver
    from ray_titan.cli import main

    def train(*args, **kwargs):
        result = driver.RunResult(run_dir=tmp_path, steps=pa.table({}), final_loss=5.538, skipped_steps=skipped,
                                  steps_run=3)
        driver.say_outcome(result, "no checkpoint was saved")
        return result

    monkeypatch.setattr(driver, "train", train)
    assert main(["train"]) == status
    out = capsys.readouterr()
    last = (out.err if status else out.out).strip().splitlines()[-1]
    assert re.search(line, last), last


def test_an_interrupted_or_failed_export_leaves_no_model_directory(tmp_path, monkeypatch, capsys):
    """Issue 33, probe 2: an export stopped half-way left shards and an index, no config.json.
    The export writes a staging directory beside OUT_DIR that becomes it only when complete."""
    import ray_titan.checkpoint.hf_export as hf
    from ray_titan.checkpoint import CheckpointError
    from ray_titan.cli import main

    def export_into(stop):
        def run(checkpoint, out_dir, *args):
            (tmp_path / "staging").write_text(out_dir)
            with open(os.path.join(out_dir, "model-00001-of-00002.safetensors"), "wb") as f:
                f.write(b"half")
            raise stop
        return run

    out = tmp_path / "out"
    for stop, status in ((KeyboardInterrupt(), 130), (CheckpointError("checkpoint c holds non-finite weights"), 2)):
        monkeypatch.setattr(hf, "_export_into", export_into(stop))
        assert main(["export", str(tmp_path / "ckpt"), "--to", "hf", str(out)]) == status
        assert sorted(p.name for p in tmp_path.iterdir()) == ["staging"]  # no OUT_DIR, no .out.partial-*
        assert os.path.dirname((tmp_path / "staging").read_text()) == str(tmp_path)
    assert "ray-titan export: interrupted (SIGINT)" in capsys.readouterr().err
    (out / "keep").mkdir(parents=True)
    assert main(["export", str(tmp_path / "ckpt"), "--to", "hf", str(out)]) == 2
    assert f"{out}: already exists and is not an empty directory" in capsys.readouterr().err
    assert (out / "keep").is_dir()


def test_export_refuses_a_remote_out_dir_that_does_not_answer_within_its_timeout(tmp_path, capsys):
    import time

    from ray_titan.cli import main

    out = "s3://bucket/model?endpoint_override=127.0.0.1:1&scheme=http"  # a closed port: the client retries ~15 s
    started = time.monotonic()
    assert main(["export", str(tmp_path / "ckpt"), "--to", "hf", out, "--storage-timeout", "1"]) == 2
    assert time.monotonic() - started < 1 + 5
    assert f"ray-titan export: {out}: no answer from its storage within 1 s" in capsys.readouterr().err


def test_sigterm_stops_an_export_like_train_and_leaves_no_model_directory(tmp_path):
    """Issue 33, probe 2: SIGINT did nothing for 90 s during an export. Every command now runs
    under SignalGuard: SIGTERM ends it with 143 and the staging directory is removed."""
    import signal
    import time

    code = (
        "import os, sys, time\n"
        "import ray_titan.checkpoint.hf_export as hf\n"
        "from ray_titan.cli import main\n"
        "def export_into(checkpoint, out_dir, *args):\n"
        "    open(os.path.join(out_dir, 'model-00001-of-00002.safetensors'), 'wb').close()\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "hf._export_into = export_into\n"
        "sys.exit(main(['export', sys.argv[1], '--to', 'hf', sys.argv[2]]))\n"
    )
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "ckpt"), str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline() == "ready\n"
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    # At once, not through SignalGuard's forced exit 30 s later (a loaded machine: a margin).
    assert proc.returncode == 143 and time.monotonic() - started < 20, (proc.returncode, err)
    assert "ray-titan export: interrupted (SIGTERM)" in err and "still stopping" not in err
    assert list(tmp_path.iterdir()) == []


def test_train_where_ray_is_not_installed_exits_2_naming_the_launcher_for_the_mesh(monkeypatch, capsys):
    from ray_titan.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # as not installed: find_spec answers None
    config = str(REPO / "configs" / "debug_llama.toml")
    assert main(["train", "--config", config, "--parallelism.pp=1", "--training.steps=5"]) == 2
    assert capsys.readouterr().err == (
        "ray-titan train: Ray is not installed; run this job without Ray with the launcher: torchrun "
        f"--nproc-per-node=2 -m ray_titan.launch --config {config} --parallelism.pp=1 --training.steps=5\n")
    assert main(["train", "--parallelism.pp=1", "--parallelism.dp_shard=1"]) == 2  # one process: no torchrun
    assert capsys.readouterr().err.endswith(
        ": python -m ray_titan.launch --parallelism.pp=1 --parallelism.dp_shard=1\n")
    assert main(["train", "--data.source=ray_data"]) == 2
    assert "Ray is not installed, and data.source = 'ray_data' streams through it" in capsys.readouterr().err
