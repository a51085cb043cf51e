"""The one table of per-rank fields (``ray_titan.metrics.fields.FIELDS``): what is derived from it
(the packed order, the Arrow schema, the verdict codes, the docs' column table) agrees with it, and
a field added in one place only fails here: in the report but not the table, in the table but not
the report, a memory field the sampler does not read, a column the collector does not write."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ray_titan.metrics import fields
from ray_titan.metrics.fields import (
    COLUMNS,
    COORD_AXES,
    FIELDS,
    MEMORY_FIELDS,
    PACKED_FIELDS,
    PACKED_OBJECTS,
    VERDICT_CODES,
    VERDICTS,
)
from ray_titan.metrics.schema import STEP_SCHEMA, arrow_type
from ray_titan.metrics.worker.report import StepReport

REPO = Path(__file__).resolve().parents[2]
_REPORTED = (fields.REPORT, fields.OBJECT)  # a StepReport attribute each


def test_every_field_of_a_report_is_in_the_table_and_every_reported_field_of_the_table_in_the_report():
    from ray_titan.parallel.dims import ParallelDims

    in_report = {f.name for f in dataclasses.fields(StepReport)} - {"coords", "memory", "extra"}
    in_table = {f.name for f in FIELDS if f.source in _REPORTED}
    assert in_report - in_table == set(), "StepReport fields missing from ray_titan/metrics/fields.py"
    assert in_table - in_report == set(), "fields of ray_titan/metrics/fields.py missing from StepReport"
    # Coordinates: every mesh axis, in the mesh's order.
    assert list(ParallelDims(pp=2, dp_replicate=2, dp_shard=4, cp=2, tp=2, ep=2).coords(0)) == list(COORD_AXES)


def test_the_memory_sampler_reads_every_memory_field_and_only_those(monkeypatch):
    """On CPU (host fields) and on a device (a fake accelerator answering every counter)."""
    import torch

    from ray_titan.allocator import host_heap
    from ray_titan.metrics.worker import memory

    host = memory.MemorySampler(torch.device("cpu"), slow_interval_s=0).sample()
    assert list(host) == list(MEMORY_FIELDS)
    read = {k for k, v in host.items() if v is not None}
    assert {k for k in MEMORY_FIELDS if k.startswith("host_")} - read <= (
        {"host_heap_in_use_bytes", "host_heap_free_bytes"} if host_heap() == (None, None) else set())

    class FakeAccelerator:
        def memory_stats(self, device):
            return {k: 1 for k in ("allocated_bytes.all.current", "active_bytes.all.current",
                                   "reserved_bytes.all.current", "active_bytes.all.peak", "reserved_bytes.all.peak",
                                   "num_alloc_retries", "num_ooms")}

        def reset_peak_memory_stats(self, device):
            pass

    monkeypatch.setattr(memory, "_accelerator", FakeAccelerator)
    monkeypatch.setattr(memory, "_capacity", lambda device: 80 << 30)
    device = memory.MemorySampler(torch.device("cuda"), slow_interval_s=0).sample()
    assert list(device) == list(MEMORY_FIELDS)
    assert all(device[k] is not None for k in MEMORY_FIELDS if k.startswith("device_"))


def test_the_packed_order_and_the_arrow_schema_are_the_tables():
    assert STEP_SCHEMA.names == list(COLUMNS) == [f.name for f in FIELDS if f.column]
    for f in FIELDS:
        if f.column:
            assert STEP_SCHEMA.field(f.name).type == arrow_type(f.type), f.name
    packed = [f.name for f in FIELDS if f.source in (fields.REPORT, fields.COORDS, fields.MEMORY, fields.SENDER)]
    assert list(PACKED_FIELDS) == packed and len(PACKED_FIELDS) == len(set(PACKED_FIELDS))
    assert list(PACKED_OBJECTS) == [f.name for f in FIELDS if f.source == fields.OBJECT]
    assert {f.source for f in FIELDS} <= {fields.REPORT, fields.COORDS, fields.MEMORY, fields.OBJECT, fields.SENDER,
                                          fields.COLLECTOR}
    assert all(f.description and f.type for f in FIELDS)
    assert len({f.name for f in FIELDS}) == len(FIELDS)  # each field named once


def test_the_verdict_codes_are_the_tables():
    from ray_titan.metrics.collector import leak

    assert (leak.WARMING_UP, leak.STABLE, leak.GROWING) == VERDICTS
    assert VERDICT_CODES == {"warming_up": 0, "stable": 1, "growing": 2}  # TensorBoard's scalar, in every run


def _distinct_report() -> tuple[dict[str, Any], dict[str, Any]]:
    """A one-rank report with a value of its own in every reported field, and the value each
    column must then hold."""
    values: dict[str, Any] = {}
    for i, f in enumerate(FIELDS):
        values[f.name] = {"int64": 100 + i, "float64": i + 0.25, "bool": True, "string": f"s{i}",
                          "list<int64>": [i], "list<list<int64>>": [[i, i + 1]], "list<float64>": [i + 0.5],
                          "dict": {}}[f.type]
    # What one rank of a one-rank job must say for its step to be assembled and its loss counted.
    values.update(step=1, rank=0, tp=0, cp=0, world_size=1, is_last_stage=True,
                  memory_breakdown={"rank": 0, "step": 1, "peak_bytes": 7})
    rep = {f.name: values[f.name] for f in FIELDS if f.source in _REPORTED}
    rep["coords"] = {a: values[a] for a in COORD_AXES}
    rep["memory"] = {k: values[k] for k in MEMORY_FIELDS}
    return StepReport(**rep).to_dict(), values


def test_a_report_carries_every_field_to_its_row(tmp_path):
    """Each reported field's value reaches its column unchanged, through the packed columns (one
    rank's call and an aggregator's), and every column of the table is written."""
    from ray_titan.metrics.collector.breakdowns import read_breakdowns
    from ray_titan.metrics.collector.collector import MetricsCollector
    from ray_titan.metrics.packing import pack_reports
    from ray_titan.metrics.reading.steps import read_steps

    rep, values = _distinct_report()
    for how, batch in (("list", [rep]), ("packed", pack_reports([rep]))):
        c = MetricsCollector(str(tmp_path / how), 1, [0], 1, enable_tensorboard=False)
        c.report(batch)  # type: ignore[arg-type]
        c.finish()
        row = read_steps(tmp_path / how).to_pylist()
        assert len(row) == 1
        carried = {f.name for f in FIELDS if f.column and f.source != fields.COLLECTOR}
        assert {k: row[0][k] for k in carried} == {k: values[k] for k in carried}, how
        assert row[0]["step_loss"] == values["loss"] and row[0]["step_val_loss"] == values["val_loss"]
        assert read_breakdowns(tmp_path / how) == {0: values["memory_breakdown"]}


def test_the_docs_list_every_column():
    doc = (REPO / "docs" / "metrics.md").read_text()
    assert fields.DOC_BEGIN in doc and fields.DOC_END in doc
    block = doc[doc.index(fields.DOC_BEGIN):doc.index(fields.DOC_END) + len(fields.DOC_END)]
    assert block == fields.columns_markdown(), (
        "docs/metrics.md's column table is stale: run python -m ray_titan.metrics.fields docs/metrics.md")
