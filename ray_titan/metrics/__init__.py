"""Metrics: per-rank memory sampling, step reports, the collector actor and its sinks."""
