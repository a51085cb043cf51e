"""Synchronized garbage collection (docs/design.md, lesson 5).

Automatic GC is turned off for the run; every rank collects at the same steps, so no rank stalls
the others' next collective by collecting at its own moment. Each collection is timed and
reported (pause in seconds and the generation collected). The previous GC state (enabled or
not, debug flags) is restored by :meth:`GarbageCollection.close`.

Which generation: every ``gc_freq`` steps generation 1 (young objects: the cycles a step
creates, such as autograd graphs captured by closures, are young when they die; a pass costs
about a millisecond). With automatic GC off, a cycle that survived into generation 2 would never
be freed by those, so every ``full_every``-th collection and every checkpoint boundary, before
and after the save (where the ranks wait anyway), is a full one, generation 2. What exists when
the policy starts (after the model, optimizer and data are built) is frozen (``gc.freeze``), so
a full collection traverses only what the run created since: in a main-job Ray worker it took
0.58–0.73 s before, when it also walked every object of Ray, torch and the model.

After each collection, with ``trim`` (``[memory] malloc_trim``), malloc hands its free pages
back to the kernel (:func:`ray_titan.allocator.malloc_trim`; under glibc ~25 MiB per rank on the
main job, which the next step faults back in).

Debug mode collects every step and reports the reference cycles that held tensors: objects the
collector had to free are kept in ``gc.garbage`` (``gc.DEBUG_SAVEALL``) for inspection, their
tensors summed and described, and then released.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass

from ray_titan.allocator import malloc_trim

__all__ = ["GCResult", "GarbageCollection", "cycle_tensors"]


@dataclass
class GCResult:
    """One step's GC: ``pause_s`` (seconds, 0.0 without a collection), ``generation`` collected
    (None without one), and in debug mode the tensors found in collected cycles (count and
    bytes, and a short description of each cycle's tensors)."""

    pause_s: float = 0.0
    generation: int | None = None
    cycle_tensors: int = 0
    cycle_tensor_bytes: int = 0
    description: str = ""


def cycle_tensors(objects: list) -> tuple[int, int, str]:
    """Tensors among ``objects`` (the contents of ``gc.garbage``): their count, their bytes
    (each storage once) and a description of the largest few (shape, dtype, and the types of
    the objects in the cycle that referred to them)."""
    import torch

    tensors = [o for o in objects if isinstance(o, torch.Tensor)]
    if not tensors:
        return 0, 0, ""
    storages: dict[int, int] = {}
    for t in tensors:
        try:
            st = t.untyped_storage()
            storages[st.data_ptr() or id(st)] = st.nbytes()
        except Exception:
            continue
    ids = {id(o) for o in objects}
    parts = []
    for t in sorted(tensors, key=lambda t: -t.numel())[:5]:
        holders = sorted({type(r).__name__ for r in gc.get_referrers(t) if id(r) in ids})
        parts.append(f"tensor{tuple(t.shape)} {t.dtype} held by {', '.join(holders) or '?'}")
    return len(tensors), sum(storages.values()), "; ".join(parts)


class GarbageCollection:
    """Collect every ``gc_freq`` steps (``gc_freq`` > 0) on every rank.

    Args:
        gc_freq: steps between collections (generation 1).
        full_every: every this many collections is a full one (generation 2); 0: only at
            checkpoint boundaries (:meth:`at_checkpoint`).
        debug: collect every step and look for reference cycles that held tensors.
        rank: named in debug messages.
        trim: call :func:`malloc_trim` after each collection (its time is part of the pause).
    """

    def __init__(self, gc_freq: int, full_every: int = 10, debug: bool = False, rank: int = 0,
                 trim: bool = False):
        self.gc_freq, self.full_every, self.debug, self.rank = gc_freq, full_every, debug, rank
        self.trim = trim
        self.collections = 0
        self._was_enabled = gc.isenabled()
        self._old_flags = gc.get_debug()
        gc.disable()
        gc.collect(1)
        # Everything alive now (modules, Ray, the model, optimizer and loader) lives for the run:
        # full collections skip the permanent generation (module docstring).
        frozen_before = gc.get_freeze_count()
        gc.freeze()
        # close() undoes this freeze whenever it froze anything, even if objects were frozen
        # before (CPython 3.12 starts with 375: immortal tuples its collector itself moves to the
        # permanent generation, again at every collection). gc.unfreeze() cannot tell whose
        # objects it releases: it moves the whole permanent generation into the oldest one.
        # Releasing the others' costs only their traversal by later full collections (alive or
        # immortal, they are never freed by it; 3.12 re-freezes its immortals itself); keeping
        # ours frozen would leave every cycle alive when the run started (model, optimizer,
        # loader) uncollectable for the rest of the process, a leak per run where a process runs
        # several.
        self._froze = gc.get_freeze_count() > frozen_before

    def _collect(self, generation: int) -> GCResult:
        if self.debug:
            gc.set_debug(self._old_flags | gc.DEBUG_SAVEALL)
        t0 = time.perf_counter()
        gc.collect(generation)
        if self.trim:
            malloc_trim()
        res = GCResult(time.perf_counter() - t0, generation)
        if self.debug:
            gc.set_debug(self._old_flags)
            garbage = list(gc.garbage)
            gc.garbage.clear()
            res.cycle_tensors, res.cycle_tensor_bytes, res.description = cycle_tensors(garbage)
            del garbage
            gc.collect(generation)  # now really free what DEBUG_SAVEALL kept
            if res.cycle_tensors:
                print(f"ray_titan: gc debug: rank {self.rank}: reference cycles held {res.cycle_tensors} "
                      f"tensor(s), {res.cycle_tensor_bytes} bytes: {res.description}",
                      file=sys.stderr, flush=True)
        self.collections += 1
        return res

    def run(self, step: int) -> GCResult:
        """The collection due at ``step`` (every step in debug mode), or an empty result."""
        if not self.debug and step % self.gc_freq:
            return GCResult()
        full = self.full_every and (self.collections + 1) % self.full_every == 0
        return self._collect(2 if full else 1)

    def at_checkpoint(self) -> GCResult:
        """A full collection at a checkpoint boundary: call it at the same step on every rank,
        before the save and again after it. After, because DCP's ``torch.save`` defines pickler
        and writer classes on every call: reference cycles that held 3.4 MiB per save on the
        debug model (tracemalloc) until the next full collection, up to ``gc_full_every ×
        gc_freq`` steps later, and that a young collection does not free (measured: 1.6 of the
        3.4 MiB stayed)."""
        return self._collect(2)

    def close(self) -> None:
        """Restore the GC state found at construction and undo construction's freeze (which, as
        ``gc.unfreeze`` can only, also releases what others had frozen before: see ``__init__``)."""
        gc.set_debug(self._old_flags)
        if self._froze:
            gc.unfreeze()
        if self._was_enabled:
            gc.enable()
