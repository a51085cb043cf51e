"""Documents from Ray Data: a ``ray.data.Dataset`` given to the driver, or ``data.source =
"ray_data"`` with a path Ray Data reads (Parquet, or JSON Lines; local or object storage).

Every rank streams the dataset in its order (``preserve_order``; nothing is materialised on
the driver) and packs it exactly as :class:`~ray_titan.data.loader.PackedLoader` packs a file
source, keeping its data-parallel slice of each global batch: so the ranks of one
data-parallel group (its pipeline stages) see the same batches, the groups see disjoint parts,
and a job fed by Ray Data computes what the same documents in the same order give as a Parquet
source. The position is the documents consumed in the current pass and the unused tokens; a
resumed run opens a new stream and skips that many documents (exact, at the cost of reading
them again). Ray Train's default split (``streaming_split``, a different part of the stream per
worker) is not used: it hands the stages of one pipeline different batches, and its dynamic
assignment of blocks to workers has no reproducible position to resume from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ray_titan.config.schema import Data
from ray_titan.data.loader import BufferedPackedLoader
from ray_titan.data.tokenizer import Tokenizer

__all__ = ["DATASET_NAME", "StreamLoader", "dataset_format", "read_dataset", "worker_rows"]

DATASET_NAME = "train"
"""The name of the dataset in Ray Train's ``datasets`` (``ray.train.get_dataset_shard``)."""


def dataset_format(path: str) -> str:
    """``"jsonl"`` for a ``.jsonl``/``.json`` file or a local directory of them, else ``"parquet"``."""
    p = Path(path)
    if path.endswith((".jsonl", ".json", ".jsonl.gz")):
        return "jsonl"
    if p.is_dir() and not any(p.rglob("*.parquet")) and any(p.rglob("*.jsonl")):
        return "jsonl"
    return "parquet"


def read_dataset(data: Data):
    """The ``ray.data.Dataset`` of ``data.path`` (``data.source = "ray_data"``): Parquet or JSON
    Lines (:func:`dataset_format`), ``data.text_column`` only, read in the files' order."""
    import ray.data

    assert data.path is not None  # the pre-flight checks require it
    if dataset_format(data.path) == "jsonl":
        ds = ray.data.read_json(data.path, lines=True).select_columns([data.text_column])
    else:
        ds = ray.data.read_parquet(data.path).select_columns([data.text_column])
    ds.context.execution_options.preserve_order = True  # the stream's order is the files'
    return ds


def worker_rows(data: Data) -> Callable[[], Iterable[dict[str, Any]]]:
    """A function that opens a new pass over the dataset's rows on this worker: Ray Train's
    iterator of the dataset (``get_dataset_shard``) in a Ray Train worker, else a dataset read
    from ``data.path`` here."""
    import ray.train

    try:
        it = ray.train.get_dataset_shard(DATASET_NAME)
    except Exception:  # not in a Ray Train worker
        it = None
    if it is None:
        it = read_dataset(data).iterator()
    return it.iter_rows


class StreamLoader(BufferedPackedLoader):
    """:class:`PackedLoader` over a stream of rows (dicts with ``text_column``) instead of a
    table: documents in the stream's order, a new pass (``epoch``) when it ends, no shuffle (the
    dataset's order is the order: shuffle the dataset itself, e.g. ``ds.random_shuffle(seed=…)``).
    ``open_rows()`` opens a new pass. Shapes, slicing and state keys as :class:`PackedLoader`'s
    (``doc_pos``: documents consumed in the current pass). Raises ``ValueError`` for a stream
    without documents."""

    def __init__(self, open_rows: Callable[[], Iterable[dict[str, Any]]], text_column: str, tokenizer: Tokenizer,
                 seq_len: int, global_batch_size: int, dp_rank: int = 0, dp_degree: int = 1):
        super().__init__(pa.chunked_array([[""]], pa.large_string()), tokenizer, seq_len, global_batch_size,
                         dp_rank, dp_degree)
        self.open_rows, self.text_column = open_rows, text_column
        self._rows: Iterator[dict[str, Any]] | None = None

    def _next_text(self) -> str:
        restarted = False
        while True:
            if self._rows is None:
                self._rows = iter(self.open_rows())
            for row in self._rows:
                text = row[self.text_column]
                if text is not None:
                    self.doc_pos += 1
                    return text
            if restarted:  # a whole pass without a document
                raise ValueError(f"the dataset has no documents in column {self.text_column!r}")
            self._rows, self.epoch, self.doc_pos, restarted = None, self.epoch + 1, 0, True

    def _fill(self, n_tokens: int) -> None:
        parts = [self._buffer]
        have = len(self._buffer)
        while have < n_tokens:
            ids = self.tok.encode(self._next_text())
            parts.append(np.concatenate(([self.tok.bos_id], ids, [self.tok.eos_id])).astype(np.int64))
            have += len(parts[-1])
        self._buffer = np.concatenate(parts)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: a new pass that skips the documents consumed."""
        self.epoch, skip = int(state["epoch"]), int(state["doc_pos"])
        self._buffer = np.asarray(state["buffer"], dtype=np.int64)
        self._rows, self.doc_pos = iter(self.open_rows()), 0
        while self.doc_pos < skip:
            self._next_text()
