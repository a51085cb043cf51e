"""Config loading, overrides and validation (no Ray)."""

from __future__ import annotations

import re
import tomllib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ray_titan.driver.run as driver
from ray_titan.config import ConfigError, JobConfig, load_config
from ray_titan.preflight.checks import validate_job
from tests.conftest import REPO


def test_defaults_are_the_debug_llama_config():
    assert load_config(REPO / "configs" / "debug_llama.toml") == JobConfig()


def test_every_shipped_config_loads():
    for path in sorted((REPO / "configs").glob("*.toml")):
        cfg = load_config(path)
        assert cfg.model_dump() == JobConfig.from_dict(tomllib.loads(path.read_text())).model_dump()


def test_overrides_are_parsed_as_toml_values():
    cfg = load_config(None, ["--training.steps=7", "--optimizer.lr=1e-4", "--job.name=abc",
                             "--metrics.enable_tensorboard=false", "parallelism.pipeline_schedule=GPipe"])
    assert cfg.training.steps == 7 and cfg.optimizer.lr == 1e-4 and cfg.job.name == "abc"
    assert cfg.metrics.enable_tensorboard is False
    assert cfg.parallelism.pipeline_schedule == "GPipe"


def test_unknown_key_is_an_error(tmp_path):
    (tmp_path / "c.toml").write_text("[training]\nstepz = 3\n")
    with pytest.raises(ConfigError, match="unknown setting 'training.stepz'"):
        load_config(tmp_path / "c.toml")
    with pytest.raises(ConfigError, match="unknown setting 'nosection'"):
        load_config(None, ["--nosection.x=1"])


def test_wrong_type_is_an_error(tmp_path):
    (tmp_path / "c.toml").write_text('[training]\nsteps = "100"\n')
    with pytest.raises(ConfigError, match=r"training.steps = '100'"):
        load_config(tmp_path / "c.toml")
    with pytest.raises(ConfigError, match="parallelism.pipeline_schedule"):
        load_config(None, ["--parallelism.pipeline_schedule=ZeroBubble"])


def test_malformed_override():
    with pytest.raises(ConfigError, match="--section.key=value"):
        load_config(None, ["--steps"])


def _cfg(*overrides: str) -> JobConfig:
    return load_config(None, list(overrides))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--ray.num_workers=3"],
         r"ray.num_workers = 3 but the mesh needs parallelism.pp × parallelism.dp_shard = 2 × 2 = 4"),
        (["--parallelism.pp=5", "--parallelism.dp_shard=1", "--parallelism.pipeline_schedule=GPipe"],
         r"n_layers = 4, fewer than the 5 pipeline stages"),
        (["--parallelism.microbatches=1", "--training.global_batch_size=16"],
         r"parallelism.microbatches = 1 is fewer than the 2 pipeline ranks .* 1F1B needs microbatches >= pp"),
        (["--parallelism.pipeline_schedule=Interleaved1F1B"],
         r"stages_per_rank = 1 with pipeline_schedule = 'Interleaved1F1B'.*>= 2 stages per rank"),
        (["--parallelism.pipeline_schedule=Interleaved1F1B", "--parallelism.stages_per_rank=2",
          "--parallelism.microbatches=5", "--training.global_batch_size=20"],
         r"microbatches = 5 with Interleaved1F1B on pp = 2: .* multiple of 2; use 4 or 2"),
        (["--parallelism.stages_per_rank=2"], r"stages_per_rank = 2 needs pipeline_schedule = 'Interleaved1F1B'"),
        (["--training.global_batch_size=12"],
         r"global_batch_size = 12 is not divisible by parallelism.microbatches × parallelism.dp_shard = 4 × 2 = 8"),
        (["--training.seq_len=4096"], r"training.seq_len = 4096 exceeds the model's maximum sequence length 1024"),
        (["--data.source=parquet", "--data.path=/nonexistent/x.parquet"],
         r"data.path = '/nonexistent/x.parquet' does not exist"),
        (["--data.tokenizer=huggingface"], r"needs data.tokenizer_path"),
        (["--data.tokenizer=huggingface", "--data.tokenizer_path=/nonexistent/tokenizer.json"],
         r"data.tokenizer_path = '/nonexistent/tokenizer.json' does not exist"),
        (["--ray.max_failures=2", "--checkpoint.enable=false"],
         r"ray.max_failures = 2 with checkpoint.enable = false: "
         r"a restarted worker group would start again from step 1"),
        (["--debug.kill_at_step=3", "--debug.kill_rank=4"], r"debug.kill_rank = 4 but the mesh has ranks 0..3"),
        (["--data.path=/some/file.parquet"],
         r"data.path = '/some/file.parquet' is set but data.source = 'python_stdlib' ignores it"),
        (["--training.seed=-1"], r"training.seed = -1: Input should be greater than or equal to 0"),
        (["--model.flavor=huge"],
         r"model.flavor = 'huge' is unknown .* valid: \['3-8B', '3.1-70B', '3.1-8B', '3.2-1B', '3.2-3B', '8B', "
         r"'debug'\]"),
        (["--parallelism.ep=2"], r"parallelism.ep = 2 but model.name = 'llama' has no experts"),
        (["--model.name=deepseek_v2", "--parallelism.ep=4"],
         r"parallelism.ep = 4 must divide parallelism.dp_shard = 2 \(expert parallelism borrows its ranks"),
        (["--model.name=deepseek_v2", "--parallelism.pp=1", "--parallelism.dp_shard=3", "--parallelism.ep=3",
          "--parallelism.microbatches=1", "--training.global_batch_size=3"],
         r"parallelism.ep = 3 does not divide the 8 routed experts of deepseek_v2/debug"),
        (["--model.name=deepseek_v2", "--model.load_balance=sometimes"], r"model.load_balance = 'sometimes'"),
        (["--memory.snapshot_steps=[0, 5, 400]"],
         r"memory.snapshot_steps = \[0, 5, 400\]: step\(s\) \[0, 400\] "
         r"are outside the run \(1 .. training.steps = 300\)"),
        (["--memory.warmup_max_steps=20"],
         r"memory.warmup_max_steps = 20 is below memory.leak_window_steps = 28: a verdict needs a full window"),
        (["--memory.cpu_offload=true", "--parallelism.dp_shard=1"],
         r"memory.cpu_offload = true offloads FSDP2's shards, but parallelism.dp_shard = 1 applies no FSDP2"),
        (["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=layer",
          "--activation_checkpoint.layer_freq=9"],
         r"activation_checkpoint.layer_freq = 9 exceeds the model's 4 layers"),
        (["--parallelism.pipeline_schedule=ZBVZeroBubble", "--parallelism.stages_per_rank=2",
          "--parallelism.microbatches=4", "--activation_checkpoint.mode=selective",
          "--activation_checkpoint.selective_option=op"],
         r"selective_option = 'op' with pipeline_schedule = 'ZBVZeroBubble': a zero-bubble schedule runs each "
         r"backward in two parts"),
        (["--memory.on_leak=halt"], r"memory.on_leak = 'halt': Input should be 'warn' or 'stop'"),
        (["--activation_checkpoint.mode=partial"], r"activation_checkpoint.mode = 'partial'"),
        # Well-typed values that cannot mean anything, or would be ignored (docs/reliability.md).
        (["--optimizer.lr=inf"], r"optimizer.lr = inf: Input should be a finite number"),
        (["--optimizer.eps=nan"], r"optimizer.eps = nan: Input should be a finite number"),
        (["--training.max_norm=inf"], r"training.max_norm = inf: Input should be a finite number"),
        (["--optimizer.beta1=1.0"], r"optimizer.beta1 = 1.0: Input should be less than 1"),
        (["--training.seed=100000000000000000000000"],
         r"training.seed = 100000000000000000000000: Input should be less than or equal to 9223372036854775807"),
        (["--training.steps=100000000000000000000"],
         r"training.steps = 100000000000000000000: Input should be less than or equal to 1000000000"),
        (["--job.name=../x"], r"job.name = '../x' contains '/': the run directory is <dump_folder>/<job.name>-"),
        (["--job.name=a\x00b"], r"job.name = 'a\\x00b' contains '\\x00': .* without path separators or control"),
        (['--job.name=""'], r"job.name = '' is empty"),
        (["--data.tokenizer_path=/x/tokenizer.json"],
         r"data.tokenizer_path = '/x/tokenizer.json' is set but data.tokenizer = 'byte' ignores it"),
        (["--debug.kill_at_step=400"], r"debug.kill_at_step = 400 is beyond the run's last step \(training.steps"),
        (["--debug.kill_collector_at_step=301"], r"debug.kill_collector_at_step = 301 is beyond the run's last step"),
        (["--debug.nonfinite_loss_at_steps=[-1, 2, 500]"],
         r"debug.nonfinite_loss_at_steps = \[-1, 2, 500\]: step\(s\) \[-1, 500\] are outside the run"),
        (["--training.steps=5", "--training.steps=6"],
         r"override training.steps is given twice \('--training.steps=5' and '--training.steps=6'\); give each"),
    ],
)
def test_validation_errors_name_setting_value_and_fix(overrides, message, monkeypatch):
    # Raised by the driver before it connects to Ray, so before any worker could start.
    def no_cluster(cfg):
        raise AssertionError("the driver tried to start Ray for an invalid config")

    monkeypatch.setattr(driver, "connect", no_cluster)
    with pytest.raises(ConfigError, match=message):
        driver.train(_cfg(*overrides))


def test_data_without_text_column_is_refused_before_workers(tmp_path, monkeypatch):
    pq.write_table(pa.table({"content": ["a b c"]}), tmp_path / "d.parquet")
    monkeypatch.setattr(driver, "connect", lambda cfg: pytest.fail("connected to Ray"))
    with pytest.raises(ConfigError, match=r"data.text_column = 'text' is not a column of .*d.parquet.*\['content'\]"):
        driver.train(_cfg("--data.source=parquet", f"--data.path={tmp_path / 'd.parquet'}"))
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "none.parquet")
    with pytest.raises(ConfigError, match=r"none.parquet' has no documents \(0 rows in 1 file"):
        validate_job(_cfg("--data.source=parquet", f"--data.path={tmp_path / 'none.parquet'}"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"has no .jsonl files"):
        validate_job(_cfg("--data.source=jsonl", f"--data.path={tmp_path / 'empty'}"))


def test_valid_layouts_pass():
    validate_job(_cfg())
    validate_job(_cfg("--parallelism.pipeline_schedule=Interleaved1F1B", "--parallelism.stages_per_rank=2"))
    validate_job(_cfg("--parallelism.pp=1", "--parallelism.dp_shard=1"))
    validate_job(load_config(REPO / "configs" / "debug_deepseek.toml"))
    validate_job(_cfg("--model.name=deepseek_v2", "--parallelism.pp=1", "--parallelism.dp_shard=4",
                      "--parallelism.ep=2", "--training.global_batch_size=16"))


def test_lr_schedule_warms_up_to_the_peak_and_ends_at_the_floor():
    from ray_titan.trainer.build import build_lr_lambda

    for decay in ("cosine", "linear"):
        cfg = _cfg("--training.steps=10", "--lr_scheduler.warmup_steps=2", f"--lr_scheduler.decay={decay}",
                   "--lr_scheduler.min_lr_ratio=0.1")
        f = build_lr_lambda(cfg)
        lrs = [f(i) for i in range(10)]  # scheduler index i is step i + 1
        assert lrs[:2] == [0.5, 1.0]
        assert lrs[-1] == pytest.approx(0.1)
        assert all(a > b for a, b in zip(lrs[1:], lrs[2:]))  # decays monotonically after the peak
    assert [build_lr_lambda(_cfg("--lr_scheduler.decay=none"))(i) for i in (0, 19, 20, 299)] == [0.05, 1.0, 1.0, 1.0]




def test_warmup_longer_than_the_run_is_a_warning_not_an_error():
    from ray_titan.preflight.checks import job_warnings

    assert job_warnings(_cfg()) == []
    (warning,) = job_warnings(_cfg("--training.steps=10"))
    assert "warmup_steps = 20 is not below training.steps = 10" in warning
    validate_job(_cfg("--training.steps=10"))


@pytest.mark.parametrize(
    "callback, message",
    [
        ({"target": "ray_titan.callbacks.InjectLeak"}, r"is not of the form 'package.module:name'"),
        ({"target": "no_such_module_x:Cb"}, r"cannot import 'no_such_module_x'"),
        ({"target": "ray_titan.callbacks:Nope"}, r"'ray_titan.callbacks' has no 'Nope'"),
        ({"target": "ray_titan.callbacks:InjectLeak", "kwargs": {"rank": 1}},
         r"with kwargs \{'rank': 1\}: TypeError: .*unexpected keyword argument 'rank'"),
    ],
)
def test_bad_callback_is_refused_before_workers(callback, message, monkeypatch):
    monkeypatch.setattr(driver, "connect", lambda cfg: pytest.fail("connected to Ray"))
    cfg = JobConfig.from_dict({"callbacks": [callback]})
    with pytest.raises(ConfigError, match=r"callbacks\[0\].target = .*" + message):
        driver.train(cfg)


def test_a_callback_target_is_imported_but_never_called_before_workers(tmp_path, capsys, monkeypatch):
    """A config is code (issue 33, probe 7): `os:system` with a command once ran the command on
    `config show --validate` and on the driver of `train`; now a target that is not a callback
    class is refused without being called, and a callback class is imported, not instantiated."""
    from ray_titan.cli import main

    ran = tmp_path / "ran"
    job = tmp_path / "job.toml"
    job.write_text(f'[[callbacks]]\ntarget = "os:system"\nkwargs = {{ command = "touch {ran}" }}\n')
    monkeypatch.setattr(driver, "connect", lambda cfg: pytest.fail("connected to Ray"))
    assert main(["config", "show", "--validate", str(job), f"--job.dump_folder={tmp_path}"]) == 2
    assert re.search(r"callbacks\[0\]\.target = 'os:system': .* is a builtin_function_or_method, not a class "
                     r"\(it is not called\): give a class .*defining at least one of on_train_start",
                     capsys.readouterr().err)
    with pytest.raises(ConfigError, match=r"callbacks\[0\]\.target = 'os:system'"):
        driver.train(load_config(job, [f"--job.dump_folder={tmp_path}"]))
    assert not ran.exists()
    job.write_text(f'[[callbacks]]\ntarget = "subprocess:Popen"\nkwargs = {{ args = ["touch", "{ran}"] }}\n')
    assert main(["config", "show", "--validate", str(job), f"--job.dump_folder={tmp_path}"]) == 2
    assert "is a class with no callback event (it is not called)" in capsys.readouterr().err and not ran.exists()
    job.write_text(f'[[callbacks]]\ntarget = "tests.unit.test_config:Recorder"\nkwargs = {{ path = "{ran}" }}\n')
    assert main(["config", "show", "--validate", str(job), f"--job.dump_folder={tmp_path}"]) == 0
    assert not ran.exists()  # validated, not instantiated: only the workers do that


class Recorder:
    """A callback whose construction leaves a file."""

    def __init__(self, path: str):
        open(path, "w").close()

    def on_train_start(self, ctx) -> None:
        pass


def test_callbacks_and_memory_sections_load_from_toml(tmp_path):
    (tmp_path / "c.toml").write_text(
        '[memory]\non_leak = "stop"\nsnapshot_steps = [3]\n'
        '[activation_checkpoint]\nmode = "full"\n'
        '[[callbacks]]\ntarget = "ray_titan.callbacks:InjectLeak"\nkwargs = { ranks = [1], mib_per_step = 2.0 }\n'
    )
    cfg = load_config(tmp_path / "c.toml")
    assert cfg.memory.on_leak == "stop" and cfg.memory.snapshot_steps == [3]
    assert cfg.activation_checkpoint.mode == "full"
    assert cfg.callbacks[0].kwargs == {"ranks": [1], "mib_per_step": 2.0}
    validate_job(cfg)


@pytest.mark.parametrize("content, message", [
    (bytes(range(256)), r"is not UTF-8 text \(byte 128 is b'\\x80'\): a binary file\? give a TOML job config"),
    (b"\x00\x01[training]", r"holds a NUL character \(byte 0\): a binary file\?"),
    (b"\xef\xbb\xbf[training]\nsteps = 3\n", r"starts with a UTF-8 byte-order mark, which TOML does not allow"),
    (None, r"is a directory, not a TOML file"),
    (b"[training\nsteps = 3", r"is not valid TOML"),
])
def test_unreadable_config_files_are_config_errors_exit_2(tmp_path, capsys, content, message):
    from ray_titan.cli import main

    path = tmp_path / "job.toml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ray-titan train: config error: config file {str(path)!r} ") and re.search(message, err), err
    assert main(["config", "show", str(path)]) == 2




def test_the_schemas_schedule_names_are_the_schedule_tables():
    """config.schema imports nothing of the project, so its Literal of schedule names repeats the
    keys of ray_titan.parallel.schedules.SCHEDULES (the one home of each schedule's properties)."""
    import typing

    from ray_titan.config.schema import Parallelism
    from ray_titan.parallel.schedules import SCHEDULES

    names = typing.get_args(Parallelism.model_fields["pipeline_schedule"].annotation)
    assert list(names) == list(SCHEDULES)
    assert all(s.torch_class.__name__.startswith("Schedule") for s in SCHEDULES.values())


def test_a_tp_that_leaves_a_rank_no_vocabulary_row_is_refused_before_workers():
    """The embedding gives each tp rank ceil(vocab / tp) rows (VocabParallelEmbedding): 9 tokens
    over 8 ranks would leave the last rank none, which its workers would only find at build."""
    from ray_titan.preflight.checks import _check_vocab

    cfg = load_config(None, ["--parallelism.tp=8", "--parallelism.loss_parallel=false"])
    _check_vocab(cfg, 258)  # 33 rows a rank, 27 on the last
    with pytest.raises(ConfigError, match=r"parallelism.tp = 8 leaves a tp rank no row of the embedding's "
                                          r"vocabulary of 9 tokens .*ceil\(9/8\) = 2 rows a rank"):
        _check_vocab(cfg, 9)
