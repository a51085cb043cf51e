"""The documents a job trains and validates on, and the loaders over them.

One place decides which documents go where: the training source, less the held-out share when
``validation.source = "holdout"`` (``ray_titan.data.holdout``), and the validation documents
(that share, or a source of their own). The trainer asks for a loader for its data-parallel
position; ranks of one data-parallel group (pipeline stages) get the same batches.
"""

from __future__ import annotations

import pyarrow as pa

from ray_titan.config.schema import Data, JobConfig
from ray_titan.data.corpus import load_columns, load_texts
from ray_titan.data.holdout import split_holdout
from ray_titan.data.loader import PackedLoader
from ray_titan.data.mixing import MixedLoader
from ray_titan.data.sft import SFTLoader, example_columns
from ray_titan.data.tokenizer import Tokenizer

__all__ = ["build_loader", "build_validation_loader", "source_settings", "training_documents", "validation_documents"]


def _documents(data: Data) -> pa.ChunkedArray | pa.Table:
    """A source's documents: texts, or a table of supervised examples (``data.format``)."""
    return load_texts(data) if data.format == "text" else load_columns(data, example_columns(data))


def source_settings(data: Data) -> list[Data]:
    """The settings of each training source: ``data`` itself, or one per entry of a mixture
    (``data.sources``), each with the mixture's columns, format and tokenizer."""
    if not data.sources:
        return [data]
    return [data.model_copy(update={"source": s.source, "path": s.path, "sources": []}) for s in data.sources]


def training_documents(cfg: JobConfig, data: Data | None = None) -> pa.ChunkedArray | pa.Table:
    """A training source's documents (texts, or supervised examples; ``data`` default
    ``cfg.data``), without the held-out share when validation holds one out."""
    docs = _documents(data or cfg.data)
    if cfg.validation.enable and cfg.validation.source == "holdout":
        docs, _ = split_holdout(docs, cfg.validation.holdout_fraction)
    return docs


def validation_documents(cfg: JobConfig) -> pa.ChunkedArray | pa.Table:
    """The validation documents: the training source's held-out share (``source = "holdout"``)
    or the validation source's documents, read with the training source's column."""
    v = cfg.validation
    if v.source == "holdout":
        held = [split_holdout(_documents(d), v.holdout_fraction)[1] for d in source_settings(cfg.data)]
        if isinstance(held[0], pa.Table):
            return pa.concat_tables(held)
        return pa.chunked_array([c for h in held for c in h.chunks], type=held[0].type)
    return _documents(cfg.data.model_copy(update={"source": v.source, "path": v.path}))


def _loader(cfg: JobConfig, docs, tokenizer: Tokenizer, batch: int, dp_rank: int, dp_degree: int,
            seed: int | None = None) -> PackedLoader:
    shape = (cfg.training.seq_len, batch)
    where = {"dp_rank": dp_rank, "dp_degree": dp_degree, "seed": cfg.training.seed if seed is None else seed}
    if cfg.data.format == "text":
        return PackedLoader(docs, tokenizer, *shape, **where)
    return SFTLoader(docs, tokenizer, cfg.data, *shape, **where)


def build_loader(cfg: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_degree: int) -> PackedLoader:
    """The training loader of data-parallel rank ``dp_rank`` of ``dp_degree``."""
    batch = cfg.training.global_batch_size
    if cfg.data.source == "ray_data":
        from ray_titan.data.ray_data import StreamLoader, worker_rows

        return StreamLoader(worker_rows(cfg.data), cfg.data.text_column, tokenizer, cfg.training.seq_len, batch,
                            dp_rank, dp_degree)
    if not cfg.data.sources:
        return _loader(cfg, training_documents(cfg), tokenizer, batch, dp_rank, dp_degree)
    # Each source's own order from its own seed (its index), the mixture's draws from the job's.
    sources = [_loader(cfg, training_documents(cfg, d), tokenizer, batch, dp_rank, dp_degree,
                       seed=cfg.training.seed * 1009 + i) for i, d in enumerate(source_settings(cfg.data))]
    return MixedLoader(sources, [s.weight for s in cfg.data.sources], seed=cfg.training.seed)


def build_validation_loader(cfg: JobConfig, docs: pa.ChunkedArray | pa.Table, tokenizer: Tokenizer, dp_rank: int,
                            dp_degree: int) -> PackedLoader:
    """A fresh loader over the validation documents ``docs`` (so every evaluation reads the same
    batches): ``validation.batch_size`` sequences per batch (default the training batch)."""
    batch = cfg.validation.batch_size or cfg.training.global_batch_size
    return _loader(cfg, docs, tokenizer, batch, dp_rank, dp_degree)
