"""The driver side: everything that runs in the process that starts a run on Ray.

``run`` (:func:`train`, the Ray driver's train), ``torch_trainer`` (Ray Train's trainer and
scaling policies for the mesh), ``progress`` (the progress bar / plain lines) and ``signals``
(Ctrl-C and SIGTERM). The worker side is :mod:`ray_titan.trainer`; what both use lies below them
(``ray_titan.config``, ``run_dir``, ``metrics``, ...).

The names below are imported on first use, so that ``ray_titan.driver.progress`` (which the CLI
reads to parse its flags) does not import Ray or torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray_titan.driver.run import RunResult, init_local_cluster, say_outcome, train
    from ray_titan.driver.signals import Interrupted

__all__ = ["Interrupted", "RunResult", "init_local_cluster", "say_outcome", "train"]

_HOMES = {"train": "run", "RunResult": "run", "init_local_cluster": "run", "say_outcome": "run",
          "Interrupted": "signals"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"ray_titan.driver.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'ray_titan.driver' has no attribute {name!r}")
