"""One ``prepare_job`` for both launchers: the Ray driver and ``python -m ray_titan.launch`` run the
same resolved, validated config for the same input (no Ray: each is stopped where it makes its run
directory)."""

from __future__ import annotations

import pytest

import ray_titan.driver.run as driver
import ray_titan.launch.torchrun as launch
from ray_titan.config.schema import ConfigError, JobConfig
from ray_titan.config.units import format_bytes
from ray_titan.preflight.memory_plan import MemoryPlan
from tests.conftest import REPO


class _Made(Exception):
    """Raised in place of making the run directory: carries the config it was given."""

    def __init__(self, cfg: JobConfig):
        super().__init__("run directory")
        self.cfg = cfg


def _stop_at_run_dir(cfg: JobConfig):
    raise _Made(cfg)


def test_driver_and_launcher_prepare_the_same_job(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # A relative path to resolve, a warning to print, a mesh of one process.
    (tmp_path / "job.toml").write_text(
        '[job]\ndump_folder = "runs"\n[training]\nsteps = 3\nthreads_per_worker = 1\n'
        '[lr_scheduler]\nwarmup_steps = 5\n[parallelism]\npp = 1\ndp_shard = 1\n')
    overrides = ["--data.cache_dir=cache", "--training.seed=7"]
    monkeypatch.setattr(driver, "connect", lambda cfg: None)
    monkeypatch.setattr(driver, "cpus_per_worker", lambda cfg: 1.0)
    monkeypatch.setattr(driver, "make_run_dir", _stop_at_run_dir)
    monkeypatch.setattr(launch, "make_run_dir", _stop_at_run_dir)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(_Made) as by_ray:
        driver.train(str(tmp_path / "job.toml"), overrides)
    ray_warnings = capsys.readouterr().err
    with pytest.raises(_Made) as by_launch:
        launch.main(["--config", str(tmp_path / "job.toml"), *overrides])
    assert by_ray.value.cfg.model_dump() == by_launch.value.cfg.model_dump()
    assert by_ray.value.cfg.job.dump_folder == str(tmp_path / "runs")  # resolved, not merely copied
    assert by_ray.value.cfg.data.cache_dir == str(tmp_path / "cache")
    assert "lr_scheduler.warmup_steps = 5" in ray_warnings
    assert capsys.readouterr().err == ray_warnings  # the same warnings, once each


class _Stop(Exception):
    """Raised where a launcher, its memory plan written, would start the run."""


def _stop(*args, **kwargs):
    raise _Stop


def test_both_launchers_write_the_plan_ray_titan_memory_plan_prints(tmp_path, monkeypatch):
    """prepare_job's plan, written into the run directory by the Ray driver and by the launcher,
    is byte for byte the one ``ray-titan memory plan --json`` writes for the same job."""
    from ray_titan.cli import main

    config = str(REPO / "configs" / "debug_llama.toml")
    overrides = ["--parallelism.pp=1", "--parallelism.dp_shard=1", "--parallelism.microbatches=2",
                 "--training.threads_per_worker=1", f"--job.dump_folder={tmp_path}"]
    run_dirs = {name: tmp_path / name for name in ("ray", "launch")}
    monkeypatch.setattr(driver, "connect", lambda cfg: None)
    monkeypatch.setattr(driver, "cpus_per_worker", lambda cfg: 1.0)
    monkeypatch.setattr(driver, "make_run_dir", lambda cfg: run_dirs["ray"])
    monkeypatch.setattr(driver, "start_collector", _stop)
    monkeypatch.setattr(launch, "make_run_dir", lambda cfg: run_dirs["launch"])
    monkeypatch.setattr(launch, "LocalCheckpointStorage", _stop)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    for run_dir in run_dirs.values():
        run_dir.mkdir()
    with pytest.raises(_Stop):
        driver.train(config, overrides)
    with pytest.raises(_Stop):
        launch.main(["--config", config, *overrides])
    assert main(["memory", "plan", "--config", config, *overrides, "--device", "cpu",
                 "--json", str(tmp_path / "cli.json")]) == 0
    cli = (tmp_path / "cli.json").read_bytes()
    assert b'"world_size": 1' in cli and b'"microbatches": 2' in cli  # the overrides were planned
    for run_dir in run_dirs.values():
        assert (run_dir / "memory_plan.json").read_bytes() == cli


def test_launcher_refuses_a_local_rank_without_its_own_gpu(monkeypatch):
    """torchrun with more ranks per node than GPUs: a clear error naming the counts, not CUDA's
    invalid device ordinal (found writing the GPU acceptance run's multi-rank checks)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert launch.local_cuda_device() == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit, match=r"local rank 1 needs GPU 1, but this node has 1 GPU\(s\).*--nproc-per-node=1"):
        launch.local_cuda_device()


def test_launcher_refuses_a_process_count_not_the_meshs_and_a_ray_data_source(monkeypatch):
    """Both before the process group: the process count the mesh needs, named as torchrun's
    flag; a Ray Data source, which only the Ray driver streams (docs/reliability.md, Without Ray)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit, match=r"the mesh needs 4 processes \(pp × dp_replicate × dp_shard × tp = "
                       r"2 × 1 × 2 × 1\) but this launch has 1: use torchrun --nproc-per-node=4"):
        launch.main(["--config", str(REPO / "configs" / "debug_llama.toml")])
    with pytest.raises(SystemExit, match=r"data.source = 'ray_data' streams through Ray: run it with ray-titan train"):
        launch.main(["--parallelism.pp=1", "--parallelism.dp_shard=1", "--data.source=ray_data"])


def test_workers_get_the_driver_s_configs_one_per_granted_worker_count():
    # The job's last rewrites happen in the driver: a worker only picks the entry of the worker
    # count Ray granted (no dict round trip, no rewrite on the worker).
    from ray_titan.parallel.elastic import fitting_worker_counts
    from ray_titan.preflight.prepare import on_cluster, worker_configs

    cfg = JobConfig.from_dict({"parallelism": {"pp": 2, "dp_shard": 2, "microbatches": 2},
                               "training": {"global_batch_size": 8}, "ray": {"num_workers": [2, 4]}})
    assert cfg.training.threads_per_worker is None
    cfg = on_cluster(cfg, 1.5)
    assert cfg.training.threads_per_worker == 2 and on_cluster(cfg, 7.0) is cfg  # set once, never again
    configs = worker_configs(cfg)
    assert sorted(configs) == fitting_worker_counts(cfg) == [2, 4]
    assert all(isinstance(c, JobConfig) and c.world_size == n and c.training.threads_per_worker == 2
               for n, c in configs.items())
    assert configs[2].parallelism.dp_shard == 1 and configs[4] is cfg


# memory.fit = "auto" (issue 41): the debug Llama's plan peaks at 18.1 MiB on CPU (pp=2 × dp_shard=2,
# 4 microbatches, no AC). At 12 MiB microbatches 8 + selective/op AC is the cheapest fit; at 7 MiB
# only more devices would fit; at 20 MiB it fits as given.
FIT_JOB = str(REPO / "configs" / "debug_llama.toml")


def _fit(corpus_cache, device_memory: str, *flags: str, **kwargs):
    from ray_titan.preflight.prepare import prepare_job

    return prepare_job(FIT_JOB, [f"--data.cache_dir={corpus_cache}", "--training.threads_per_worker=1",
                                 f"--memory.device_memory={device_memory}", *flags], **kwargs)


def test_fit_auto_applies_the_cheapest_microbatches_and_ac_choice(corpus_cache, capsys):
    off = _fit(corpus_cache, "12MiB")
    assert off.memory_plan is not None and off.memory_plan.fits is False  # compared with memory.device_memory
    assert "memory.fit" not in capsys.readouterr().out
    job = _fit(corpus_cache, "12MiB", "--memory.fit=auto")
    out = capsys.readouterr().out
    chosen = ["--parallelism.microbatches=8", "--activation_checkpoint.mode=selective",
              "--activation_checkpoint.selective_option=op"]
    cfg, plan = job.config, job.memory_plan
    assert (cfg.parallelism.microbatches, cfg.activation_checkpoint.mode,
            cfg.activation_checkpoint.selective_option) == (8, "selective", "op")
    # Same devices, model states on them: only the two lever groups changed.
    assert (cfg.parallelism.pp, cfg.parallelism.dp_shard, cfg.world_size, cfg.ray.num_workers,
            cfg.memory.cpu_offload) == (2, 2, 4, off.config.ray.num_workers, False)
    by_hand = _fit(corpus_cache, "12MiB", *chosen).config
    assert cfg.model_dump() == by_hand.model_dump() | {"memory": by_hand.memory.model_dump() | {"fit": "auto"}}
    assert plan is not None and plan.fits is True and plan.max_peak <= 12 * 2**20
    assert plan.job["microbatches"] == 8  # the re-plan is of the chosen job
    lines = [line for line in out.splitlines() if "memory.fit" in line]
    (line,) = lines
    assert line.startswith(f"ray_titan: memory.fit = auto: the plan's peak {format_bytes(off.memory_plan.max_peak)} "
                           f"does not fit 12 MiB; training with {' '.join(chosen)} "
                           f"(peak {format_bytes(plan.max_peak)}), the cheapest that fits (microbatches 4 → 8: ")
    # ... and why: each chosen lever's cost
    assert "activation checkpointing selective/op: recomputes" in line
    # A launch's other ranks (no warnings, no plan) train the same job, silently.
    quiet = _fit(corpus_cache, "12MiB", "--memory.fit=auto", warn=False, plan=False)
    assert quiet.config.model_dump() == cfg.model_dump() and "memory.fit" not in capsys.readouterr().out


def test_fit_auto_leaves_a_job_that_fits_and_fit_off_leaves_every_job(corpus_cache, capsys):
    given = _fit(corpus_cache, "20MiB")
    fits = _fit(corpus_cache, "20MiB", "--memory.fit=auto")
    assert fits.config.model_dump() == given.config.model_dump() | {
        "memory": given.config.memory.model_dump() | {"fit": "auto"}}
    assert fits.memory_plan is not None and fits.memory_plan.fits is True
    off = _fit(corpus_cache, "12MiB", "--memory.fit=off")
    assert (off.config.parallelism.microbatches, off.config.activation_checkpoint.mode) == (4, "none")
    assert "memory.fit" not in capsys.readouterr().out


def test_fit_auto_refuses_a_job_no_allowed_lever_fits_saying_what_would(corpus_cache):
    with pytest.raises(ConfigError) as info:
        _fit(corpus_cache, "7MiB", "--memory.fit=auto")
    msg = str(info.value)
    assert "memory.fit" in msg and "does not fit 7 MiB" in msg
    assert "--parallelism.dp_shard=4" in msg  # what would fit: more devices


def test_a_bad_device_memory_is_refused_naming_the_setting(corpus_cache):
    for bad in ("80GX", "0GiB", "lots"):
        with pytest.raises(ConfigError) as info:
            _fit(corpus_cache, bad, "--memory.fit=auto")
        assert "memory.device_memory" in str(info.value) and repr(bad) in str(info.value)


def test_memory_plan_prints_the_choice_a_run_makes(corpus_cache, capsys, tmp_path):
    from ray_titan.cli import main

    job = _fit(corpus_cache, "12MiB", "--memory.fit=auto")
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "memory.fit" in x]
    flags = [f"--data.cache_dir={corpus_cache}", "--memory.device_memory=12MiB", "--memory.fit=auto"]
    assert main(["memory", "plan", "--config", FIT_JOB, "--device", "cpu", *flags,
                 "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and out.splitlines()[-1] == line
    assert job.memory_plan is not None
    assert MemoryPlan.load(tmp_path / "plan.json").max_peak == job.memory_plan.max_peak  # the chosen job's plan
    assert main(["memory", "plan", "--config", FIT_JOB, "--device", "cpu", *flags[:-1]]) == 1  # fit off


def test_lever_groups_restrict_the_levers_and_the_recommendation():
    from ray_titan.preflight.memory_plan import memory_plan

    cfg = JobConfig.from_dict({})
    plan = memory_plan(cfg, "7MiB", "cpu", lever_groups=("microbatches", "ac"))
    allowed = ("--parallelism.microbatches", "--activation_checkpoint.mode")
    assert plan.levers and all(lv.overrides[0].split("=")[0] in allowed for lv in plan.levers)
    assert plan.recommendation is None
    assert memory_plan(cfg, "7MiB", "cpu").recommendation is not None
    with pytest.raises(ConfigError, match="lever groups"):
        memory_plan(cfg, "7MiB", "cpu", lever_groups=("more_gpus",))


def test_fit_auto_without_a_capacity_runs_the_job_as_given_and_says_so(corpus_cache, capsys, monkeypatch):
    import ray_titan.preflight.memory_plan as plan_module
    from ray_titan.preflight.prepare import prepare_job

    monkeypatch.setattr(plan_module, "_detect_device_memory", lambda: (None, "no CUDA device here"))
    flags = [f"--data.cache_dir={corpus_cache}", "--training.threads_per_worker=1"]
    given = prepare_job(FIT_JOB, flags).config
    job = prepare_job(FIT_JOB, [*flags, "--memory.fit=auto"])
    assert job.config.model_dump() == given.model_dump() | {"memory": given.memory.model_dump() | {"fit": "auto"}}
    assert job.memory_plan is not None and job.memory_plan.fits is None
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "memory.fit" in x]
    assert "no device capacity" in line and "memory.device_memory" in line and "runs as given" in line
