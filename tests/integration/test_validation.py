"""Validation, supervised fine-tuning's masked loss and document masks under pp=2 × dp_shard=2
(torchrun, no Ray), against one process.

One 4-rank run trains on prompt/response examples (loss on responses only, uneven counts per
microbatch and per rank) with document masks and validation after every step; its twin runs
without validation. Checked: the training losses are bit-identical with validation on or off;
the validation loss equals a one-process evaluation of the run's final weights; the losses
equal a one-process run over the whole global batch (the masked mean is over every counted
token of the global batch, not a mean of per-microbatch means); and the validation loss reaches
Parquet, TensorBoard, the console and the report.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ray_titan.config import load_config, merge_overrides
from ray_titan.data.holdout import holdout_mask, split_holdout
from ray_titan.metrics.collector.collector import MetricsCollector
from ray_titan.metrics.reading.steps import read_steps
from ray_titan.metrics.worker.report import LocalReporter, Reporter
from tests.conftest import REPO
from tests.support.ranks import launch

STEPS = 2


def _examples(n: int, seed: int) -> pa.Table:
    r = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = r.randint(0, 99), r.randint(0, 99)
        rows.append({"prompt": f"Q{i}: what is {a} plus {b}? " + "pad " * r.randint(0, 30),
                     "response": f"{a} + {b} = {a + b}." + " ok" * r.randint(0, 40)})
    return pa.Table.from_pylist(rows)


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft")
    pq.write_table(_examples(300, 0), d / "train.parquet")
    pq.write_table(_examples(40, 1), d / "val.parquet")
    return d


def _overrides(sft_data, dump, *extra):
    return [f"--job.dump_folder={dump}", f"--training.steps={STEPS}", "--metrics.log_freq=1",
            "--memory.breakdown_step=0",
            "--data.source=parquet", f"--data.path={sft_data / 'train.parquet'}", "--data.format=prompt_response",
            "--training.document_mask=true", "--validation.source=parquet",
            f"--validation.path={sft_data / 'val.parquet'}", "--validation.freq=1", "--validation.steps=1", *extra]


def _torchrun(sft_data, dump, *extra):
    # torchrun's 4 ranks, forked from the session's forkserver (tests/support/ranks.py)
    out = launch(["--config", str(REPO / "configs" / "debug_llama.toml"), *_overrides(sft_data, dump, *extra)], 4,
                 timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (run_dir,) = dump.glob("debug_llama-*")
    return out.stdout, run_dir, read_steps(run_dir)


@pytest.fixture(scope="module")
def pp_runs(sft_data, tmp_path_factory):
    """pp=2 × dp_shard=2, 1F1B: with validation after every step, and without."""
    on = _torchrun(sft_data, tmp_path_factory.mktemp("val_on"), "--validation.enable=true")
    off = _torchrun(sft_data, tmp_path_factory.mktemp("val_off"), "--validation.enable=false")
    return on, off


def _by_step(table, column, rank=0):
    rows = table.filter(pa.compute.equal(table["rank"], rank)).sort_by("step")
    return rows[column].to_pylist()


def test_training_is_bit_identical_with_validation_on_or_off(pp_runs):
    (_, _, on), (_, _, off) = pp_runs
    assert _by_step(on, "step_loss") == _by_step(off, "step_loss")
    assert _by_step(on, "grad_norm") == _by_step(off, "grad_norm")
    assert all(v is not None for v in _by_step(on, "step_val_loss"))
    assert all(v is None for v in _by_step(off, "step_val_loss"))


# DeepSeek-V3's MoE layers with aux-loss-free balancing: the first step after each validation
# infers the schedule's shapes again (torch's eval → train mode switch), on uninitialised inputs.
MOE = ("--model.name=deepseek_v3", "--model.flavor=debug", "--model.load_balance=aux_free",
       "--model.bias_update_rate=0.01", "--parallelism.ep=2")


def test_moe_training_is_bit_identical_with_validation_on_or_off(sft_data, tmp_path):
    """The routers count no phantom tokens after a validation: the expert load each step
    reports, and so the balancing bias and the losses after it, are those of the run without."""
    _, _, on = _torchrun(sft_data, tmp_path / "on", "--validation.enable=true", *MOE)
    _, _, off = _torchrun(sft_data, tmp_path / "off", "--validation.enable=false", *MOE)
    for rank in (0, 3):  # the first stage's MoE layers and the last's
        assert _by_step(on, "expert_load", rank) == _by_step(off, "expert_load", rank)
        assert _by_step(on, "step_loss", rank) == _by_step(off, "step_loss", rank)
        assert _by_step(on, "grad_norm", rank) == _by_step(off, "grad_norm", rank)
    assert all(v is not None for v in _by_step(on, "step_val_loss", 3))


def _one_process_cfg(sft_data, tmp_path, *extra):
    return load_config(REPO / "configs" / "debug_llama.toml", merge_overrides(_overrides(
        sft_data, tmp_path, "--parallelism.pp=1", "--parallelism.dp_shard=1", "--training.threads_per_worker=1",
        "--validation.enable=true"), list(extra)))


def test_validation_loss_equals_one_process_evaluation_of_the_same_weights(pp_runs, sft_data, tmp_path):
    from ray_titan.checkpoint import Checkpointer
    from ray_titan.data.build import build_loader
    from ray_titan.data.tokenizer import ByteTokenizer
    from ray_titan.trainer.build import build
    from ray_titan.trainer.evaluate import Validator

    (_, run_dir, on), _ = pp_runs
    cfg = _one_process_cfg(sft_data, tmp_path, f"--checkpoint.load_path={run_dir}", "--checkpoint.load_model_only=true")
    tok = ByteTokenizer()
    loader = build_loader(cfg, tok, 0, 1)
    parts = build(cfg, 0, tok.vocab_size, loader, torch.device("cpu"))
    Checkpointer(cfg, 0, parts.stages.values(), parts.optimizer, parts.scheduler, loader, Reporter(), None,
                 tok.vocab_size, torch.device("cpu")).restore()
    result = Validator(cfg, tok, 0, 1).run(parts)
    distributed = _by_step(on, "step_val_loss")[-1]
    assert result.loss == pytest.approx(distributed, rel=1e-5)
    # The last stage's two data-parallel ranks each evaluated their half of the batches.
    last = on.filter(pa.compute.and_(pa.compute.equal(on["step"], STEPS), on["is_last_stage"]))
    assert sum(last["val_tokens"].to_pylist()) == result.tokens


def test_masked_loss_is_the_mean_over_the_global_batch(pp_runs, sft_data, tmp_path):
    """The 4-rank run (4 microbatches per rank) equals one process taking the global batch in one
    piece, with counted tokens uneven over microbatches and ranks."""
    from ray_titan.data.build import build_loader
    from ray_titan.data.tokenizer import ByteTokenizer
    from ray_titan.trainer import train_loop

    (_, _, on), _ = pp_runs
    cfg = _one_process_cfg(sft_data, tmp_path, "--parallelism.microbatches=1", "--validation.enable=false")
    collector = MetricsCollector(str(tmp_path), 1, [0], STEPS, log_freq=1000, enable_tensorboard=False)
    train_loop(cfg, LocalReporter(collector), torch.device("cpu"), tmp_path)
    collector.finish()
    np.testing.assert_allclose(_by_step(on, "step_loss"), _by_step(read_steps(tmp_path), "step_loss"), rtol=1e-5)

    # The first global batch: counted labels per (rank, microbatch) are uneven, so a mean of
    # per-microbatch means would differ from the token mean.
    _, labels = next(build_loader(cfg, ByteTokenizer(), 0, 1))
    counted = (labels != -100).reshape(8, 2, -1).sum(dim=(1, 2))  # 2 ranks × 4 microbatches of 2 rows
    assert len(set(counted.tolist())) > 4
    ranks = on.filter(pa.compute.and_(pa.compute.equal(on["step"], 1), on["is_last_stage"]))
    assert sorted(ranks["loss_tokens"].to_pylist()) == sorted([int(counted[:4].sum()), int(counted[4:].sum())])


def test_validation_reaches_parquet_tensorboard_console_and_report(pp_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ray_titan.driver import RunResult
    from ray_titan.metrics.reading.run_summary import write_report

    (stdout, run_dir, on), _ = pp_runs
    val = _by_step(on, "step_val_loss")
    assert all(0 < v < math.log(258) + 0.5 for v in val)
    assert f"step {STEPS}/{STEPS} | loss" in stdout and f"val loss {val[-1]:.4f}" in stdout
    # Off the last stage: no loss of its own, but the step's validation loss on every row.
    first = on.filter(pa.compute.equal(on["is_last_stage"], False))
    assert set(first["val_loss"].to_pylist()) == {None} and None not in first["step_val_loss"].to_pylist()
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("val/loss")] == pytest.approx(val, rel=1e-6)
    assert [e.value for e in acc.Scalars("val/perplexity")] == pytest.approx([math.exp(v) for v in val], rel=1e-6)
    assert RunResult(run_dir=run_dir, steps=on, final_loss=None).validation == dict(enumerate(val, start=1))
    paths, _ = write_report(run_dir)
    assert paths[0].stat().st_size > 0


def test_holdout_is_by_content_disjoint_and_the_same_in_any_order():
    texts = pa.chunked_array([[f"document {i} " * (i % 7 + 1) for i in range(2000)]])
    train, held = split_holdout(texts, 0.1)
    assert len(train) + len(held) == 2000 and 150 < len(held) < 250
    assert not set(train.to_pylist()) & set(held.to_pylist())
    shuffled = pa.chunked_array([list(reversed(texts.to_pylist()))])
    assert set(split_holdout(shuffled, 0.1)[1].to_pylist()) == set(held.to_pylist())
    # A larger share holds out a superset: the hash, not the seed or the order, decides.
    assert holdout_mask(texts, 0.2)[holdout_mask(texts, 0.1)].all()
    with pytest.raises(ValueError, match="between 0 and 1"):
        holdout_mask(texts, 1.5)
