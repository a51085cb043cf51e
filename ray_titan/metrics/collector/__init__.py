"""Metrics code that runs in the metrics collector: the Ray actor the driver owns
(:class:`~ray_titan.metrics.collector.collector.MetricsCollector`, or the same object in the
launcher's process without Ray), and the metrics aggregator actors between groups of ranks and it
(``aggregator``).

The collector (``collector``) wires small parts, one concern each: taking reports in
(``intake``), what is on disk per attempt (``durable``), a step's reports in columns
(``columns``) and its figures (``summary``), the memory verdict (``leak``) and the policy that
stops a leaking run (``leak_policy``), the console lines (``console``), errors
(``errors``), measured memory breakdowns (``breakdowns``), the completeness check at the end
(``completeness``), the restart from flushed parts (``resume``), the sinks (``sinks``: Parquet,
TensorBoard, W&B, one interface) and the Prometheus gauges (``ray_metrics``)."""
