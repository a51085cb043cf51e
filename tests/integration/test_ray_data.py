"""Ray Data ingest on the shared local Ray cluster: a pp=2 × dp_shard=2 run fed by a
``ray.data.Dataset`` computes what the same documents give as a Parquet source, and the stream's
position resumes exactly; a path read by Ray Data keeps its order."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import ray_titan
from ray_titan.config import load_config
from ray_titan.config.schema import ConfigError, Data
from ray_titan.data.ray_data import StreamLoader, worker_rows
from ray_titan.data.tokenizer import ByteTokenizer
from ray_titan.metrics.collector.collector import MetricsCollector
from ray_titan.metrics.reading.steps import read_steps
from ray_titan.metrics.worker.report import LocalReporter
from ray_titan.trainer import train_loop
from tests.conftest import REPO

pytestmark = pytest.mark.ray

STEPS = 2
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """``files.parquet`` and ``stream.parquet``: the same documents, the second in the order the
    Parquet source reads the first in its first epoch (seed 0), which a stream keeps."""
    d = tmp_path_factory.mktemp("ray_data")
    rng = np.random.default_rng(7)
    texts = [f"def f{i}(x):\n" + "    x = x + 1\n" * int(rng.integers(1, 30)) + "    return x\n" for i in range(300)]
    pq.write_table(pa.table({"text": texts}), d / "files.parquet")
    order = np.random.default_rng([0, 0]).permutation(len(texts))
    pq.write_table(pa.table({"text": [texts[i] for i in order]}), d / "stream.parquet")
    pq.write_table(pa.table({"text": texts[:40]}), d / "small.parquet", row_group_size=10)
    return d


def _cfg(dump, *extra):
    return load_config(REPO / "configs" / "debug_llama.toml", [
        f"--job.dump_folder={dump}", f"--training.steps={STEPS}", "--metrics.log_freq=1000",
        "--checkpoint.enable=false", "--memory.breakdown_step=0", *extra])


def test_ray_data_run_equals_the_parquet_source(ray_cluster, corpus, tmp_path):
    import ray.data

    # In-memory blocks (no read tasks to wait for CPUs on this small cluster), several of
    # them, whose order the stream keeps.
    table = pq.read_table(corpus / "stream.parquet")
    ds = ray.data.from_arrow([table.slice(i, 60) for i in range(0, table.num_rows, 60)])
    run = ray_titan.train(_cfg(tmp_path / "ray"), dataset=ds)
    assert run.errors == [] and run.config.data.source == "ray_data"

    ref_dir = tmp_path / "ref"
    cfg = _cfg(ref_dir, "--data.source=parquet", f"--data.path={corpus / 'files.parquet'}",
               "--parallelism.pp=1", "--parallelism.dp_shard=1", "--training.threads_per_worker=1")
    collector = MetricsCollector(str(ref_dir), 1, [0], STEPS, log_freq=1000, enable_tensorboard=False)
    train_loop(cfg, LocalReporter(collector), torch.device("cpu"), ref_dir)
    collector.finish()
    ref = read_steps(ref_dir).sort_by("step")["step_loss"].to_pylist()
    np.testing.assert_allclose(run.losses(), ref, rtol=1e-5)


def test_the_stream_resumes_exactly_and_splits_by_data_parallel_rank(ray_cluster, corpus):
    import ray.data

    table = pq.read_table(corpus / "small.parquet")
    ds = ray.data.from_arrow([table.slice(i, 10) for i in range(0, table.num_rows, 10)])

    def loader(dp_rank=0, dp_degree=1):
        return StreamLoader(ds.iterator().iter_rows, "text", TOK, 64, 8, dp_rank, dp_degree)

    whole = loader()
    batches = [next(whole)[0] for _ in range(25)]  # past the end of the first pass
    assert whole.epoch == 1
    first = loader()
    for _ in range(12):
        next(first)
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    assert all(torch.equal(next(resumed)[0], b) for b in batches[12:])
    halves = [loader(r, 2) for r in range(2)]
    assert torch.equal(torch.cat([next(h)[0] for h in halves]), batches[0])


def test_ray_data_source_reads_a_path_in_order(ray_cluster, corpus, tmp_path):
    """``data.source = "ray_data"`` with ``data.path``: Parquet (4 row groups) or JSON Lines."""
    texts = pq.read_table(corpus / "small.parquet")["text"].to_pylist()
    (tmp_path / "small.jsonl").write_text("".join(json.dumps({"text": t, "n": 1}) + "\n" for t in texts))
    for path in (corpus / "small.parquet", tmp_path / "small.jsonl"):
        rows = list(worker_rows(Data(source="ray_data", path=str(path)))())
        assert [r["text"] for r in rows] == texts and set(rows[0]) == {"text"}


def test_a_dataset_without_the_text_column_is_refused(ray_cluster, tmp_path):
    import ray.data

    with pytest.raises(ConfigError, match="data.text_column = 'text' is not a column of the dataset"):
        ray_titan.train(_cfg(tmp_path), dataset=ray.data.from_items([{"body": "x"}]))
