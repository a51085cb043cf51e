"""Metrics: per-rank memory sampling and snapshots (memory.py), step reports and reporters
(report.py), profiler traces and the measured memory breakdown (profiling.py), the collector actor
(collector.py) and its sinks (sinks.py: Parquet, TensorBoard),
the memory verdict (leak.py), start-up and step timing (timing.py), FLOPs and MFU (flops.py), and
MoE statistics read back from a run (moe_stats.py)."""
