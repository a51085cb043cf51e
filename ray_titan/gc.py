"""Synchronized garbage collection (DESIGN.md, lesson 5).

Automatic GC is turned off for the run; every rank collects generation 1 at the same steps, so
no rank stalls the others' next collective by collecting at its own moment. The pause is timed
and reported. The previous GC state is restored by :meth:`GarbageCollection.close`.
"""

from __future__ import annotations

import gc
import time

__all__ = ["GarbageCollection"]


class GarbageCollection:
    """Collect every ``gc_freq`` steps (``gc_freq`` > 0) on every rank.

    :meth:`run` returns the pause in seconds, 0.0 on steps without a collection.
    """

    def __init__(self, gc_freq: int, generation: int = 1):
        self.gc_freq, self.generation = gc_freq, generation
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect(generation)

    def run(self, step: int) -> float:
        if step % self.gc_freq:
            return 0.0
        t0 = time.perf_counter()
        gc.collect(self.generation)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self._was_enabled:
            gc.enable()
