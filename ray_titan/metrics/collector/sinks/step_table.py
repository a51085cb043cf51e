"""The collector's Parquet rows, built in columns once per flush.

A step's numbers arrive as one float64 matrix (:func:`~ray_titan.metrics.packing.pack_reports`).
Turning it into Arrow costs one ``pa.array`` per column, about sixty a step, whatever the number
of ranks: ~1.5 ms a step at 4 ranks, more than the collector's whole step before issue 31.
:class:`StepTableBuffer` keeps each assembled step's matrices and objects until the collector
flushes (or until they hold a few thousand rows), then builds their rows with one ``pa.array``
per column.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ray_titan.metrics.fields import FIELD, PACKED_FIELDS, VERDICTS
from ray_titan.metrics.packing import MOE_PAD, OBJECT_INDEX
from ray_titan.metrics.schema import STEP_SCHEMA

__all__ = ["StepColumns", "StepTableBuffer"]

_INT_TYPES = {f.name for f in STEP_SCHEMA if pa.types.is_integer(f.type)}
_BOOL_TYPES = {f.name for f in STEP_SCHEMA if pa.types.is_boolean(f.type)}
_VERDICTS = pa.array(VERDICTS)
_PACKED_COLUMNS = [(k, name) for k, name in enumerate(PACKED_FIELDS) if FIELD[name].column]
_LAYERS, _LOAD = OBJECT_INDEX["moe_layers"], OBJECT_INDEX["expert_load"]
_LISTS = (("node", OBJECT_INDEX["node"]), ("source_tokens", OBJECT_INDEX["source_tokens"]),
          ("mtp_losses", OBJECT_INDEX["mtp_losses"]))
# Step-level figures repeated in every row of the step: (column, key of the step's summary).
_STEP_LEVEL = (("step_loss", "loss"), ("step_loss_max", "loss_max"), ("step_tokens", "tokens"),
               ("step_tokens_per_s", "tokens_per_s"), ("step_val_loss", "val/loss"))


def _block_column(block: np.ndarray, held: np.ndarray, type_: pa.DataType) -> pa.Array:
    """A list column (``(ranks, L)`` → list<int64>, ``(ranks, L, E)`` → list<list<int64>>) from
    one numpy block, keeping the layers where ``held`` (bool ``(ranks, L)``: not padding), without
    a Python object per element."""
    inner = block[held]  # (k,) or (k, E)
    arr: pa.Array = pa.array(inner.reshape(-1))
    if inner.ndim == 2:
        arr = pa.ListArray.from_arrays(pa.array(np.arange(len(inner) + 1, dtype=np.int32) * inner.shape[1]), arr)
    offsets = np.zeros(len(block) + 1, np.int32)
    np.cumsum(held.sum(axis=1), out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), arr).cast(type_)


def _object_columns(steps: list[StepColumns]) -> dict[str, pa.Array]:
    """The columns that are not numbers (node, MoE layers and load, mixture tokens) of ``steps``:
    MoE layers and load from a step's blocks where it has them, else from each rank's objects."""
    objects = [o for s in steps for o in s.objects]
    cols = {name: pa.array([o[i] for o in objects], STEP_SCHEMA.field(name).type) for name, i in _LISTS}
    shapes = {None if s.moe is None else (s.moe[0].shape[1:], s.moe[1].shape[1:]) for s in steps}
    for i, block_i, name in ((_LAYERS, 0, "moe_layers"), (_LOAD, 1, "expert_load")):
        type_ = STEP_SCHEMA.field(name).type
        if shapes == {None}:  # ragged steps only: the lists are in the objects
            cols[name] = pa.array([o[i] for o in objects], type_)
        elif None not in shapes and len(shapes) == 1:  # blocks of one shape (dense: no layers): all at once
            layers = np.concatenate([s.moe[0] for s in steps if s.moe is not None])
            block = layers if block_i == 0 else np.concatenate([s.moe[1] for s in steps if s.moe is not None])
            cols[name] = _block_column(block, layers != MOE_PAD, type_)
        else:
            cols[name] = pa.concat_arrays([
                pa.array([o[i] for o in s.objects], type_) if s.moe is None
                else _block_column(s.moe[block_i], s.moe[0] != MOE_PAD, type_) for s in steps])
    return cols


@dataclass
class StepColumns:
    """One assembled step, as the Parquet rows need it (one row per rank, in rank order).

    ``values``, ``nulls``: float64 and bool ``(ranks, len(PACKED_FIELDS))``, the step's packed
    reports (NaN and True where a report had None). ``objects``, ``moe``: each rank's
    ``PACKED_OBJECTS`` and the step's MoE blocks (``(ranks, L)`` layers, :data:`MOE_PAD` for
    padding, and ``(ranks, L, E)`` load) or None, as ``columns.newest_reports`` joins them.
    ``summary``: the step's figures (``loss``, ``loss_max``, ``tokens``, ``tokens_per_s``,
    ``val/loss``, ``source_tokens``; ``summary.step_summary``). ``code``: each rank's verdict
    (index into :data:`~ray_titan.metrics.fields.VERDICTS`); ``slope``: MiB per step, NaN for
    none; ``oom``: projected OOM step, NaN for none. ``size``: the worker group's ranks.
    """

    values: np.ndarray
    nulls: np.ndarray
    objects: list[tuple]
    moe: tuple[np.ndarray, np.ndarray] | None
    summary: dict[str, Any]
    code: np.ndarray
    slope: np.ndarray
    oom: np.ndarray
    size: int


class StepTableBuffer:
    """Assembled steps held until the next flush (:meth:`take`): as numpy until they hold
    ``chunk_rows`` rows, then as an Arrow table. Small steps share the per-column cost; a large
    step (a 16K-rank job's) is built at once, in cache-sized pieces, and no Python object per
    rank outlives it. Bounded by the collector's ``flush_every_steps``."""

    def __init__(self, chunk_rows: int = 4096) -> None:
        self.chunk_rows = chunk_rows
        self._steps: list[StepColumns] = []
        self._rows = 0
        self._tables: list[pa.Table] = []

    def add(self, step: StepColumns) -> None:
        self._steps.append(step)
        self._rows += len(step.values)
        if self._rows >= self.chunk_rows:
            self._tables.append(_table(self._steps))
            self._steps, self._rows = [], 0

    def take(self) -> pa.Table | None:
        """Every held step's rows in :data:`STEP_SCHEMA`, in the order added; None if none is
        held. The buffer is empty afterwards."""
        if self._steps:
            self._tables.append(_table(self._steps))
        tables, self._tables, self._steps, self._rows = self._tables, [], [], 0
        return pa.concat_tables(tables) if tables else None


def _table(steps: list[StepColumns]) -> pa.Table:
    """The rows of ``steps``, built column by column over all of them at once."""
    values = np.concatenate([s.values for s in steps])
    nulls = np.concatenate([s.nulls for s in steps])
    counts = [len(s.values) for s in steps]
    n = len(values)
    cols: dict[str, pa.Array] = {}
    ints = np.where(nulls, 0.0, values).astype(np.int64)  # one conversion for every int column
    any_null: np.ndarray = np.asarray(nulls.any(axis=0))
    for k, name in _PACKED_COLUMNS:
        mask = nulls[:, k] if any_null[k] else None
        if name in _INT_TYPES:
            cols[name] = pa.array(ints[:, k], mask=mask)
        elif name in _BOOL_TYPES:
            cols[name] = pa.array(ints[:, k].astype(bool))
        else:
            cols[name] = pa.array(values[:, k], mask=mask)
    # A step whose reports name their group's size has it in every row; else the run's (null).
    sized = np.repeat([not s.nulls[:, PACKED_FIELDS.index("world_size")].all() for s in steps], counts)
    if sized.any():
        cols["world_size"] = pa.array(np.repeat([s.size for s in steps], counts), mask=~sized)
    cols.update(_object_columns(steps))
    code = np.concatenate([s.code for s in steps]).astype(np.int64)
    slope = np.concatenate([s.slope for s in steps])
    oom = np.concatenate([s.oom for s in steps])
    cols["memory_verdict"] = _VERDICTS.take(pa.array(code))
    cols["memory_slope_mib_per_step"] = pa.array(slope, mask=np.isnan(slope))
    cols["memory_oom_step"] = pa.array(np.nan_to_num(oom).astype(np.int64), mask=np.isnan(oom))
    cols["attempt"] = pa.array(np.zeros(n, np.int64))
    for name, key in _STEP_LEVEL:
        figures = [s.summary[key] for s in steps]
        none = np.repeat([f is None for f in figures], counts)
        filled = np.repeat([0 if f is None else f for f in figures], counts)  # NaN stays NaN: not null
        cols[name] = pa.array(filled, mask=none if none.any() else None).cast(STEP_SCHEMA.field(name).type)
    cols["step_source_tokens"] = pa.array([s.summary["source_tokens"] for s in steps for _ in range(len(s.values))],
                                          pa.list_(pa.int64()))
    return pa.Table.from_arrays([cols[f.name] for f in STEP_SCHEMA], schema=STEP_SCHEMA)
