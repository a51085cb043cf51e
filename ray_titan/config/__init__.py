"""Job configuration.

- :mod:`~ray_titan.config.schema`: the sections (pydantic), TOML loading and dotted overrides;
  imports nothing of the project. Its names are re-exported here.
- :mod:`~ray_titan.config.units`: units of memory (``MiB``, ``GiB``) and sizes read or printed;
  imports nothing of the project.
- :mod:`~ray_titan.config.docs`: the configuration reference (``docs/configuration.md``) and
  ``ray-titan config show``, rendered from the schema.

The checks run before any worker starts need the data, model, checkpoint and callback modules,
so they live outside this package, in :mod:`ray_titan.preflight.checks`: this package imports nothing
of the project and the package graph has no cycle.
"""

from ray_titan.config.schema import ConfigError, JobConfig, apply_overrides, load_config, merge_overrides

__all__ = ["ConfigError", "JobConfig", "apply_overrides", "load_config", "merge_overrides"]
