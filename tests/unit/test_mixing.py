"""Weighted mixtures of sources (no Ray): deterministic from the seed, in proportion to the
weights, recorded per step, resumed exactly from a checkpoint, refused when wrong."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ray_titan.checkpoint import LocalCheckpointStorage
from ray_titan.config import load_config
from ray_titan.config.schema import ConfigError
from ray_titan.data.build import build_loader
from ray_titan.data.tokenizer import ByteTokenizer
from ray_titan.metrics.collector.collector import MetricsCollector
from ray_titan.metrics.reading.steps import read_steps
from ray_titan.metrics.worker.report import LocalReporter
from ray_titan.trainer import train_loop
from tests.conftest import REPO


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("mix")
    # Documents of the same length in both sources, so token shares follow document shares.
    pq.write_table(pa.table({"text": [f"code {i:04d} " * 8 for i in range(300)]}), d / "code.parquet")
    pq.write_table(pa.table({"text": [f"prose {i:03d} " * 8 for i in range(200)]}), d / "prose.parquet")
    return d


def _cfg(sources, *extra, weights=(3.0, 1.0)):
    mix = ", ".join(
        f'{{name = "{n}", source = "parquet", path = "{sources / f"{n}.parquet"}", weight = {w}}}'
        for n, w in zip(("code", "prose"), weights))
    return load_config(REPO / "configs" / "debug_llama.toml", [
        f"--data.sources=[{mix}]", "--parallelism.pp=1", "--parallelism.dp_shard=1",
        "--parallelism.microbatches=1", "--training.global_batch_size=4", "--training.seq_len=64",
        "--training.threads_per_worker=1", "--checkpoint.interval=2", *extra])


def _batches(loader, n):
    out = []
    for _ in range(n):
        x, _ = next(loader)
        out.append((x.clone(), list(loader.source_tokens)))
    return out


def test_mixture_is_deterministic_and_follows_the_weights(sources):
    tok = ByteTokenizer()
    a, b = _batches(build_loader(_cfg(sources), tok, 0, 1), 40), _batches(build_loader(_cfg(sources), tok, 0, 1), 40)
    assert all(torch.equal(x, y) and s == t for (x, s), (y, t) in zip(a, b))
    other = _batches(build_loader(_cfg(sources, "--training.seed=1"), tok, 0, 1), 1)
    assert not torch.equal(other[0][0], a[0][0])
    counts = np.sum([s for _, s in a], axis=0)
    assert counts.sum() == 40 * 4 * 64
    assert counts[0] / counts.sum() == pytest.approx(0.75, abs=0.05)
    # Data-parallel ranks split the global batch: their counts add up to the whole's.
    halves = [build_loader(_cfg(sources), tok, r, 2) for r in range(2)]
    for x, s in a[:5]:
        parts = [_batches(h, 1)[0] for h in halves]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert [sum(c) for c in zip(*(p[1] for p in parts))] == s


def test_mixture_resumes_exactly_from_a_checkpoint(sources, tmp_path):
    def run(dump, steps, *extra):
        cfg = _cfg(sources, f"--training.steps={steps}", *extra)
        collector = MetricsCollector(str(dump), 1, [0], steps, log_freq=1000, enable_tensorboard=False)
        train_loop(cfg, LocalReporter(collector), torch.device("cpu"), dump,
                   checkpoint_storage=LocalCheckpointStorage(dump / "checkpoints", 0))
        collector.finish()
        return read_steps(dump).sort_by("step")

    whole = run(tmp_path / "whole", 4)
    step2 = tmp_path / "whole" / "checkpoints" / "step-00000002"
    resumed = run(tmp_path / "resumed", 4, f"--checkpoint.load_path={step2}")
    assert resumed["step"].to_pylist() == [3, 4]
    assert resumed["step_loss"].to_pylist() == whole["step_loss"].to_pylist()[2:]
    assert resumed["step_source_tokens"].to_pylist() == whole["step_source_tokens"].to_pylist()[2:]
    assert all(sum(c) == t for c, t in zip(whole["step_source_tokens"].to_pylist(), whole["step_tokens"].to_pylist()))


@pytest.mark.parametrize("change, message", [
    (lambda d: ("--data.sources=[{name = \"a\", source = \"parquet\", path = \"" + str(d / "empty.parquet")
                + "\", weight = 1.0}]",), "data.sources\\[0\\] \\('a'\\): .* has no documents"),
    (lambda d: ("--data.sources=[{name = \"a\", source = \"parquet\", path = \"" + str(d / "nowhere")
                + "\", weight = 1.0}]",), "data.sources\\[0\\] \\('a'\\): data.path = .* does not exist"),
    (lambda d: ("--data.sources=[{name = \"a\", source = \"csv\", path = \"x\", weight = 1.0}]",), "sources.0.source"),
    (lambda d: ("--data.sources=[{name = \"a\", source = \"python_stdlib\", weight = 0.0}]",),
     "sources.0.weight = 0.0: Input should be greater than 0"),
    (lambda d: ("--data.sources=[{name = \"a\", source = \"python_stdlib\", weight = 1.0}, "
                "{name = \"a\", source = \"python_stdlib\", weight = 2.0}]",), "repeat"),
])
def test_bad_mixtures_are_refused_before_workers(sources, corpus_cache, change, message):
    from ray_titan.preflight.checks import validate_job

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), sources / "empty.parquet")
    with pytest.raises(ConfigError, match=message):
        cfg = load_config(REPO / "configs" / "debug_llama.toml", [f"--data.cache_dir={corpus_cache}",
                                                                  *change(sources)])
        validate_job(cfg)


def test_config_show_round_trips_a_mixture(sources):
    import tomllib

    from ray_titan.config.docs import to_toml
    from ray_titan.config.schema import JobConfig

    cfg = load_config(REPO / "configs" / "debug_llama.toml", [
        '--data.sources=[{name = "std", source = "python_stdlib", weight = 2.0}, '
        f'{{name = "code", source = "parquet", path = "{sources / "code.parquet"}", weight = 1.0}}]'])
    assert JobConfig.from_dict(tomllib.loads(to_toml(cfg))) == cfg
