"""Metrics, split by the process its code runs on:

- :mod:`ray_titan.metrics.worker`: on each training worker (or the launcher's process): memory
  sampling and snapshots, profiler traces, timings, the step report and the reporters that
  deliver it;
- :mod:`ray_titan.metrics.collector`: in the metrics collector Ray actor (or in-process under the
  launcher) and the metrics aggregator actors: assembling steps, the memory verdict and the
  leak policy, the sinks (Parquet, TensorBoard, W&B), Prometheus gauges;
- :mod:`ray_titan.metrics.reading`: wherever a finished (or crashed) run is read: its steps
  table, MoE statistics, ``ray-titan report``.

Shared by all three, at this level: the one table of per-rank fields (:mod:`~ray_titan.metrics.fields`),
the Arrow schema derived from it (:mod:`~ray_titan.metrics.schema`), the packed wire format of
reports (:mod:`~ray_titan.metrics.packing`), the run's outcome (:mod:`~ray_titan.metrics.outcome`)
and FLOPs / MFU (:mod:`~ray_titan.metrics.flops`). Imports point from ``reading`` to ``collector``
to ``worker`` to these, never back (``pyproject.toml``, ``[tool.importlinter]``)."""
