"""The Arrow schema of ``<run_dir>/metrics/steps.parquet``: :data:`STEP_SCHEMA`, the columns of
:data:`ray_titan.metrics.fields.FIELDS` in its order, each of its type (what each column means:
the table there, or docs/metrics.md). The collector writes it; a reader of a finished run reads
it."""

from __future__ import annotations

import pyarrow as pa

from ray_titan.metrics.fields import FIELDS

__all__ = ["STEP_SCHEMA", "arrow_type"]

_TYPES = {
    "int64": pa.int64(), "float64": pa.float64(), "bool": pa.bool_(), "string": pa.string(),
    "list<int64>": pa.list_(pa.int64()), "list<list<int64>>": pa.list_(pa.list_(pa.int64())),
    "list<float64>": pa.list_(pa.float64()),
}


def arrow_type(name: str) -> pa.DataType:
    """The Arrow type of a :class:`~ray_titan.metrics.fields.Field`'s ``type``."""
    return _TYPES[name]


STEP_SCHEMA = pa.schema([(f.name, arrow_type(f.type)) for f in FIELDS if f.column])
"""One row per step per rank (docs/metrics.md, the layout of ``steps.parquet``). Steps replayed
after a restart replace the lost attempt's rows, so each (step, rank) appears once, and a step's
rows are all of one attempt."""
