"""A worker-side callback the multi-node tests use to hold a run at a known step while they
remove or add a node (tests/integration/test_multinode.py). Importable on every node's workers through
``PYTHONPATH``."""

from __future__ import annotations

import time
from pathlib import Path

from ray_titan.callbacks import Callback


class PauseAt(Callback):
    """At the end of ``step``, in a worker group of ``world_size`` ranks, each rank writes
    ``<dir>/<name>.<rank>`` and waits (at most ``timeout_s``) for ``<dir>/<name>.done``; once that
    file exists the pause is spent and no later worker group stops there."""

    def __init__(self, directory: str, pauses: list[tuple[int, int, str]], timeout_s: float = 150.0):
        self.dir, self.pauses, self.timeout_s = Path(directory), pauses, timeout_s

    def on_step_end(self, ctx, step, report):
        for at, world, name in self.pauses:
            done = self.dir / f"{name}.done"
            if step == at and ctx.world_size == world and not done.exists():
                (self.dir / f"{name}.{ctx.rank}").touch()
                deadline = time.monotonic() + self.timeout_s
                while not done.exists() and time.monotonic() < deadline:
                    time.sleep(0.2)
