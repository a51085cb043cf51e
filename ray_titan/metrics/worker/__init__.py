"""Metrics code that runs on a training worker (a Ray Train worker, or the launcher's process
without Ray): the memory sample and snapshots (``memory``), profiler traces and the measured
memory breakdown (``profiling``), start-up and step timing (``timing``; the driver writes its
own marks with it too), and :class:`~ray_titan.metrics.worker.report.StepReport` with the
reporters that deliver it to the collector without waiting (``report``)."""
