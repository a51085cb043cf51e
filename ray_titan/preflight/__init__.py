"""Everything that happens before a worker starts, for both launchers (the Ray driver and
``python -m ray_titan.launch``), in the driver's (or the launching) process:

- :mod:`~ray_titan.preflight.prepare`: a job's one chain: resolve (the config's rewrites: paths,
  Hugging Face), validate, plan the memory.
- :mod:`~ray_titan.preflight.checks`: the pre-flight checks: a clear error naming the setting or
  file before any process group, Ray worker or GPU is touched.
- :mod:`~ray_titan.preflight.memory_plan`: every rank's predicted peak and the levers that would
  make a job fit; its parts, one concern a module, are the ``plan_*`` modules (``plan_levers``,
  ``plan_ranks``, ``plan_states``, ``plan_activations``, ``plan_job``, ``plan_types``).

Nothing here imports :mod:`ray_titan.trainer` (the worker side) or Ray.
"""
