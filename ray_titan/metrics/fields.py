"""Every per-rank field of the metrics path, in one table: :data:`FIELDS`.

A field is one thing a rank's report says about a step (its loss, a memory counter, its mesh
coordinate) or one thing the collector adds to the rank's row (its memory verdict, the step's
loss). Each :class:`Field` names its unit, its type, where it comes from and what it means. What
the rest of the metrics path spells per field is derived from this table:

- the numbers a batch of reports packs into one float64 matrix (:data:`PACKED_FIELDS`,
  ``ray_titan.metrics.packing.pack_reports``) and the objects packed beside it
  (:data:`PACKED_OBJECTS`), in the table's order;
- the memory sample (:data:`MEMORY_FIELDS`, ``ray_titan.metrics.worker.memory.MemorySampler``)
  and the mesh coordinates (:data:`COORD_AXES`);
- the columns of ``<run_dir>/metrics/steps.parquet``, in the table's order, and their Arrow types
  (``ray_titan.metrics.schema.STEP_SCHEMA``);
- the memory verdicts and their codes (:data:`VERDICTS`, :data:`VERDICT_CODES`);
- the column table of ``docs/metrics.md`` (:func:`columns_markdown`;
  ``python -m ray_titan.metrics.fields docs/metrics.md`` rewrites it).

``ray_titan.metrics.worker.report.StepReport`` is the one other place a reported field is
spelled (a dataclass, so a rank's code names its fields); ``tests/unit/test_fields.py`` fails
when the two differ, and when a field of the table is not carried from a report to its row.

Imports nothing (no numpy, no pyarrow): a worker reads it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "COLUMNS", "COORD_AXES", "FIELD", "FIELDS", "MEMORY_FIELDS", "PACKED_FIELDS", "PACKED_OBJECTS", "VERDICTS",
    "VERDICT_CODES", "Field", "columns_markdown", "describe_coords",
]

# Where a field's value comes from.
REPORT = "report"  # a number of the report (``StepReport``), packed
COORDS = "coords"  # a mesh coordinate, ``report["coords"][name]`` (0 on an axis the run lacks), packed
MEMORY = "memory"  # the memory sample, ``report["memory"][name]`` (None where not read), packed
OBJECT = "object"  # a report's value that is not one number (a list, a string, a dict), packed beside
SENDER = "sender"  # the sending reporter's count, packed with each report
COLLECTOR = "collector"  # added by the collector when it assembles the step


@dataclass(frozen=True)
class Field:
    """One per-rank field: ``name``; ``unit`` (``""``: none); ``type``: its Arrow type in
    ``steps.parquet`` (``int64``, ``float64``, ``bool``, ``string``, ``list<int64>``,
    ``list<list<int64>>``, ``list<float64>``); ``source``: where its value comes from (``report``, ``coords``,
    ``memory``, ``object``, ``sender``, ``collector``); ``description``: what it means and how it
    is measured. ``column``: a column of ``steps.parquet`` (else it travels to the collector only).
    ``default``: a report without the field reads as this; ``empty``: a report's empty value
    (0, ``""``, None, ``[]``) reads as ``"null"`` or as ``"list"`` (an empty list) instead of as
    itself."""

    name: str
    unit: str
    type: str
    source: str
    description: str
    column: bool = True
    default: Any = None
    empty: str | None = None


_AXIS = "The rank's coordinate on the mesh axis ``{}`` (0 on an axis the run does not have)."
_MEMORY = "Memory sample: "

FIELDS: tuple[Field, ...] = (
    Field("step", "", "int64", REPORT, "The optimizer step, from 1."),
    Field("rank", "", "int64", REPORT, "The global rank."),
    *(Field(axis, "", "int64", COORDS, _AXIS.format(axis), default=0)
      for axis in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")),
    Field("is_last_stage", "", "bool", REPORT, "The rank holds the last pipeline stage (it has the loss)."),
    Field("loss", "nats/token", "float64", REPORT,
          "The rank's loss: mean cross-entropy over its counted label tokens; null off the last stage "
          "(never a placeholder)."),
    Field("tokens", "tokens", "int64", REPORT, "Label tokens of the rank's data-parallel slice in the step."),
    Field("step_time_s", "s", "float64", REPORT,
          "The step on this rank: data, forward/backward, optimizer, GC and memory sample (validation and "
          "profiler exports left out)."),
    Field("data_time_s", "s", "float64", REPORT, "Waiting for the step's batch and moving it to the device."),
    Field("fwd_bwd_time_s", "s", "float64", REPORT, "Forward and backward (the pipeline schedule)."),
    Field("optim_time_s", "s", "float64", REPORT, "Gradient clipping, the optimizer step and the LR schedule."),
    Field("grad_norm", "", "float64", REPORT, "The whole model's gradient norm, before clipping."),
    Field("lr", "", "float64", REPORT, "The step's learning rate."),
    Field("gc_pause_s", "s", "float64", REPORT, "The synchronized GC run of the step (0 without one)."),
    Field("time", "Unix s", "float64", REPORT, "Wall-clock time at the end of the step.", default=0.0),
    Field("metrics_time_s", "s", "float64", REPORT,
          "The rank's previous step's memory sample, report and hand-over to the reporter (the Ray call "
          "included when one was made): the metrics path's own cost, callbacks excluded; null at an "
          "attempt's first step."),
    Field("host_rss_bytes", "bytes", "int64", MEMORY,
          _MEMORY + "resident pages of ``/proc/self/statm`` × page size: the resident set now (``VmRSS``)."),
    Field("host_peak_rss_bytes", "bytes", "int64", MEMORY,
          _MEMORY + "``ru_maxrss`` of ``getrusage(RUSAGE_SELF)``: the process's peak resident set so far "
                    "(``VmHWM``)."),
    Field("host_heap_in_use_bytes", "bytes", "int64", MEMORY,
          _MEMORY + "what malloc has handed out and not taken back (``ray_titan.allocator.host_heap``: "
                    "jemalloc ``stats.allocated`` less its thread caches, glibc ``mallinfo2`` "
                    "``uordblks + hblkhd``); null without either. Tensor data on CPU is malloc'd, so RSS "
                    "minus it is mostly free space the allocator keeps, plus code pages and Python's "
                    "small-object arenas."),
    Field("host_heap_free_bytes", "bytes", "int64", MEMORY,
          _MEMORY + "resident bytes malloc keeps without handing them out (jemalloc ``stats.resident`` − in "
                    "use, glibc ``fordblks``): the memory verdict watches ``host_rss_bytes − "
                    "host_heap_free_bytes``; null without either."),
    Field("host_available_bytes", "bytes", "int64", MEMORY,
          _MEMORY + "what the node can still give the process: ``MemAvailable`` of ``/proc/meminfo``, or "
                    "less where the process's cgroup (v2 ``memory.max`` − ``memory.current``, v1 "
                    "``memory.limit_in_bytes`` − ``memory.usage_in_bytes``) sets a tighter limit."),
    Field("device_allocated_bytes", "bytes", "int64", MEMORY,
          _MEMORY + "``allocated_bytes.all.current`` (``torch.accelerator.memory_stats``, "
                    "``torch.cuda.memory_stats`` on older torch); null on CPU, as every device field."),
    Field("device_active_bytes", "bytes", "int64", MEMORY, _MEMORY + "``active_bytes.all.current``."),
    Field("device_reserved_bytes", "bytes", "int64", MEMORY,
          _MEMORY + "``reserved_bytes.all.current``: held by the caching allocator."),
    Field("device_peak_active_bytes", "bytes", "int64", MEMORY,
          _MEMORY + "``active_bytes.all.peak`` since the previous sample (peaks are reset after each "
                    "sample, ``reset_peak_memory_stats``)."),
    Field("device_peak_reserved_bytes", "bytes", "int64", MEMORY,
          _MEMORY + "``reserved_bytes.all.peak`` since the previous sample."),
    Field("device_alloc_retries", "count", "int64", MEMORY,
          _MEMORY + "``num_alloc_retries``: cudaMalloc retries after freeing the cache (cumulative; rising "
                    "means fragmentation pressure)."),
    Field("device_ooms", "count", "int64", MEMORY,
          _MEMORY + "``num_ooms``: out-of-memory errors the allocator raised (cumulative)."),
    Field("device_capacity_bytes", "bytes", "int64", MEMORY,
          _MEMORY + "total of ``torch.accelerator.get_memory_info`` (read once; "
                    "``get_device_properties(..).total_memory`` on older torch)."),
    Field("aux_loss", "", "float64", REPORT,
          "MoE: the load-balance loss summed over the rank's MoE layers, mean over microbatches; null for a "
          "dense model."),
    Field("moe_layers", "", "list<int64>", OBJECT, "MoE: the indices of the MoE layers the rank holds.",
          empty="list"),
    Field("expert_load", "tokens", "list<list<int64>>", OBJECT,
          "MoE: per layer of ``moe_layers``, the tokens (× top-k) the rank's router sent to each expert in "
          "the step; summed over a stage's ranks it is the layer's load.", empty="list"),
    Field("gc_generation", "", "int64", REPORT,
          "The generation of the synchronized GC run of the step (``ray_titan.trainer.gc_schedule``); null: none ran."),
    Field("memory_verdict", "", "string", COLLECTOR,
          "The rank's memory verdict at the step (``ray_titan.metrics.collector.leak``): ``warming_up``, "
          "``stable`` or ``growing``."),
    Field("memory_slope_mib_per_step", "MiB/step", "float64", COLLECTOR,
          "The Theil–Sen rate of the series the verdict watches."),
    Field("memory_oom_step", "", "int64", COLLECTOR,
          "The step at which the rank would run out of memory at that rate; null unless growing with a "
          "known capacity."),
    Field("step_loss", "nats/token", "float64", COLLECTOR,
          "The step's loss, the same on every row of the step: the token-weighted mean over the last stage's "
          "data-parallel ranks (a tensor-parallel group's ranks hold one loss, counted once)."),
    Field("step_loss_max", "nats/token", "float64", COLLECTOR, "The largest loss of the last stage's ranks."),
    Field("step_tokens", "tokens", "int64", COLLECTOR, "The step's label tokens over its data-parallel ranks."),
    Field("step_tokens_per_s", "tokens/s", "float64", COLLECTOR,
          "``step_tokens`` over the slowest rank's ``step_time_s``."),
    Field("skipped_update", "", "bool", REPORT,
          "The step's update was dropped (a non-finite loss or gradient norm, under "
          "``training.on_nonfinite = \"skip\"``).", default=False),
    Field("attempt", "", "int64", COLLECTOR,
          "The worker group that ran the step: 0 for the first, 1 after the first restart, ...; a step "
          "replayed after a restart replaces the lost attempt's rows."),
    Field("attempt_start_time", "Unix s", "float64", REPORT,
          "When the rank's worker group started: the same on each rank of it, it identifies the attempt.",
          default=0.0),
    Field("pid", "", "int64", REPORT, "The worker process."),
    Field("val_loss", "nats/token", "float64", REPORT,
          "At steps that evaluated (``[validation]``), the rank's validation loss (last-stage ranks); null "
          "otherwise."),
    Field("val_tokens", "tokens", "int64", REPORT,
          "The rank's counted validation label tokens at steps that evaluated."),
    Field("val_time_s", "s", "float64", REPORT, "The evaluation's duration (not part of ``step_time_s``)."),
    Field("step_val_loss", "nats/token", "float64", COLLECTOR,
          "The step's validation loss, token-weighted over the last stage's data-parallel ranks (its "
          "perplexity is ``exp`` of it)."),
    Field("loss_tokens", "tokens", "int64", REPORT,
          "Under loss masks (supervised fine-tuning), the labels counted in ``loss``; null: all of ``tokens``."),
    Field("mtp_losses", "nats/token", "list<float64>", OBJECT,
          "Multi-token prediction (``model.mtp_layers``): each depth's loss on the last-stage rank, depth 1 "
          "first, normalised as ``loss`` (which is then the main next-token loss alone; the objective adds "
          "``training.mtp_loss_weight`` × their mean); null elsewhere."),
    Field("source_tokens", "tokens", "list<int64>", OBJECT,
          "With a mixture (``data.sources``), the label tokens of the rank's slice taken from each source, in "
          "the order of ``data.sources``; null without a mixture."),
    Field("step_source_tokens", "tokens", "list<int64>", COLLECTOR,
          "The same over the step's data-parallel ranks."),
    Field("node", "", "string", OBJECT,
          "The node the rank runs on (Ray's node id, or the host name without Ray).", empty="null"),
    Field("world_size", "ranks", "int64", REPORT,
          "The ranks of the rank's worker group (an elastic run's changes at a resize); null: the run's.",
          empty="null"),
    Field("memory_breakdown", "", "dict", OBJECT,
          "At ``memory.breakdown_step``, the rank's memory at the step's peak by category "
          "(``ray_titan.metrics.worker.profiling``): in ``metrics/memory_breakdown.jsonl``.", column=False),
    Field("dropped", "reports", "int64", SENDER,
          "The reports the sending rank had dropped when it sent this one (the collector ends the run with an "
          "error naming them).", column=False, default=0),
)
"""Every per-rank field, in the order of the columns of ``steps.parquet``."""

FIELD = {f.name: f for f in FIELDS}
COLUMNS = tuple(f.name for f in FIELDS if f.column)
"""The columns of ``steps.parquet``, in order."""
PACKED_FIELDS = tuple(f.name for f in FIELDS if f.source in (REPORT, COORDS, MEMORY, SENDER))
"""The columns of ``pack_reports``' ``values`` matrix, in order."""
PACKED_OBJECTS = tuple(f.name for f in FIELDS if f.source == OBJECT)
"""The fields of a report that are not one number, in the order of ``pack_reports``' ``objects`` tuples."""
MEMORY_FIELDS = tuple(f.name for f in FIELDS if f.source == MEMORY)
"""The memory sample of a report (``ray_titan.metrics.worker.memory.MemorySampler`` reads it)."""
COORD_AXES = tuple(f.name for f in FIELDS if f.source == COORDS)
"""The mesh axes, outermost first."""

VERDICTS = ("warming_up", "stable", "growing")
"""The memory verdicts (``memory_verdict``), by code: the code is the index here, in the collector's
arrays and as TensorBoard's scalar ``memory/rank{r}/verdict``."""
VERDICT_CODES = {v: i for i, v in enumerate(VERDICTS)}


def describe_coords(rank: int, coords: dict[str, int]) -> str:
    """``"rank 3 (pp=1, dp_shard=1)"``: a rank named with its mesh coordinates (those of the
    axes the run has: ``"rank 5 (pp=0, dp_shard=1, tp=1)"`` under tensor parallel)."""
    inner = ", ".join(f"{k}={v}" for k, v in coords.items())
    return f"rank {rank} ({inner})" if inner else f"rank {rank}"


DOC_BEGIN = "<!-- columns: generated from ray_titan/metrics/fields.py -->"
DOC_END = "<!-- end of columns -->"


def columns_markdown() -> str:
    """The table of ``steps.parquet``'s columns for ``docs/metrics.md``, between its markers."""
    rows = [f"| `{f.name}` | `{f.type}` | {f.unit} | {f.description.replace('``', '`').replace('|', '/')} |"
            for f in FIELDS if f.column]
    return "\n".join([DOC_BEGIN, "| column | type | unit | meaning |", "|---|---|---|---|", *rows, DOC_END])


def _rewrite(doc: Path) -> None:
    """Replace the column table between the markers of ``doc`` with :func:`columns_markdown`."""
    text = doc.read_text()
    head, rest = text.split(DOC_BEGIN, 1)
    doc.write_text(head + columns_markdown() + rest.split(DOC_END, 1)[1])


if __name__ == "__main__":
    _rewrite(Path(sys.argv[1]))
