"""The ``memory_vs_torchtitan`` benchmark's job table, job line and degradation without torchtitan
(no simulation runs here; the figures are the benchmark's business)."""

from __future__ import annotations

import re

import pytest

from benchmarks import memory_vs_torchtitan as mvt
from ray_titan.config.units import GiB


@pytest.mark.parametrize("job", mvt.JOBS, ids=lambda j: j.name)
def test_ray_titan_side_runs_the_job_of_the_row(job):
    """The overrides give ray_titan the row's mesh, local batch, sequence, AC mode, bf16 and AdamW,
    and a model of a torchtitan flavor: the shapes torchtitan's side is given."""
    from ray_titan.checkpoint import job_model_args
    from ray_titan.config import load_config
    from ray_titan.preflight.checks import _check_vocab, validate_job
    from ray_titan.trainer.build import parallel_dims

    cfg = validate_job(load_config(mvt.CONFIG, mvt.ray_titan_overrides(job)), check_data=False)
    _check_vocab(cfg, job_model_args(cfg).vocab_size)  # as the dry run checks it: the flavor's vocabulary
    dims = parallel_dims(cfg)
    assert (dims.world_size, dims.pp, dims.tp, dims.ep) == (job.world, job.pp, job.tp, job.ep)
    assert cfg.training.global_batch_size // dims.dp == job.local_batch
    assert cfg.training.seq_len == job.seq and cfg.parallelism.microbatches == job.microbatches
    assert cfg.training.mixed_precision == "bf16" and cfg.optimizer.name == "AdamW"
    assert cfg.parallelism.loss_parallel  # torchtitan's loss is vocab-parallel under tp
    ac = cfg.activation_checkpoint
    assert {"none": ("none",), "full": ("full",), "op": ("selective", "op")}[job.ac] == \
        ((ac.mode, ac.selective_option) if ac.mode == "selective" else (ac.mode,))
    assert (job.model, job.flavor) in mvt.FLAVORS
    assert job_model_args(cfg).vocab_size in (128256, 102400)  # the flavor's, not the byte tokenizer's


def test_job_line_format_and_missing_sides():
    line = mvt.job_line("x", 3 * GiB, 2 * GiB)
    m = re.fullmatch(r"memory_vs_torchtitan job=(\S+) ray_titan_gib=(\S+) torchtitan_gib=(\S+) ratio=(\S+)", line)
    assert m is not None and m.groups() == ("x", "3.00", "2.00", "1.5000")
    assert mvt.job_line("y", GiB, None).endswith("ray_titan_gib=1.00 torchtitan_gib=- ratio=-")


def test_select_names_jobs_and_refuses_unknown_ones():
    assert [j.name for j in mvt.select("llama8b_fsdp8_ac_op,llama8b_fsdp8_ac_none")] == \
        ["llama8b_fsdp8_ac_op", "llama8b_fsdp8_ac_none"]
    assert mvt.select(None) == mvt.JOBS
    with pytest.raises(SystemExit, match="known: llama8b_fsdp8_ac_none"):
        mvt.select("llama8b")


def test_without_torchtitan_its_side_is_skipped_with_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(mvt, "torchtitan_available", lambda: False)
    monkeypatch.setattr(mvt, "run_torchtitan", lambda *a: pytest.fail("torchtitan's side ran"))
    monkeypatch.setattr(mvt, "run_ray_titan", lambda job, steps: {"peak_device_bytes": 5 * GiB,
                                                                   "peak_by_category": {"parameters": GiB}})
    results, failed = mvt.compare(mvt.select("llama8b_fsdp8_ac_full"))
    out = capsys.readouterr().out
    assert not failed and "torchtitan" not in results[0]
    assert "pip install --no-deps torchtitan==0.3.0" in out
    assert out.splitlines()[-1] == "memory_vs_torchtitan job=llama8b_fsdp8_ac_full ray_titan_gib=5.00 " \
                                   "torchtitan_gib=- ratio=-"
