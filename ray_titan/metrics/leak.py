"""The memory verdict of each rank: ``warming_up``, ``stable`` or ``growing`` (docs/design.md, lesson 4).

A rank's memory rises over the first steps (optimizer state, allocator pools, autograd caches)
and then flattens; a leak keeps rising. :class:`LeakDetector` tells them apart from one series
of samples (bytes per step):

- warm-up: ``warming_up`` until the window is full (a verdict needs ``window`` samples) and the
  newest quarter of it rises over the one before by less than the threshold rate (memory has
  flattened), or until ``warmup_max_steps`` at the latest (a leak from step 1 never flattens).
- after warm-up, the Theil–Sen slope (the median of the slopes between every pair of samples in a
  sliding window; Theil 1950, Sen 1968) is the rate. It ignores outliers up to its breakdown point
  of 29%, so an allocator returning a block or a GC round does not read as growth or shrinkage.
  Once the window is full, the verdict is ``growing`` when the rate reaches the threshold over
  the whole window and between the medians of each pair of successive quarters of it (a one-time
  level shift, such as a new allocator pool, tilts the whole window but lifts at most two of the
  three steps between quarters; a leak lifts all three; the median of each quarter ignores
  spikes), and ``stable`` again when the median of those four rates falls below half of the
  threshold (hysteresis). A fall between two successive samples of more than four times the
  threshold rate over a quarter of the window is a release (a GC round freeing garbage, a
  checkpoint's buffers, pages handed back), a level shift down: the samples after it are lifted
  back by its size before fitting, so a release during a leak neither hides the leak nor reads
  as shrinkage.
- where a capacity is known (device memory, or the host memory still available), the step at
  which the rank would run out is projected from the rate.

:class:`LeakMonitor` keeps one detector per rank and series (device allocated memory where the
rank has a device, host memory always) and gives each rank one verdict; the collector calls it
with every assembled step. The host series is RSS less the free bytes glibc malloc holds
(``host_rss_bytes − host_heap_free_bytes``): a heap fragmented by a step's frees grows RSS with
nothing new in use (measured: 0–2 MiB per 100 steps on healthy CPU runs, and bursts of
0.2–0.7 MiB/step in the first 40 steps on a loaded machine), which is the allocator's, not a
leak. Without glibc's ``mallinfo2`` the series is RSS.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "GROWING",
    "SERIES_NAMES",
    "STABLE",
    "WARMING_UP",
    "LeakDetector",
    "LeakMonitor",
    "MemoryLeakError",
    "Verdict",
    "describe_coords",
    "host_series",
    "leak_settings",
    "theil_sen_slope",
]

WARMING_UP, STABLE, GROWING = "warming_up", "stable", "growing"
MiB = 2**20


class MemoryLeakError(RuntimeError):
    """A rank's memory is growing and ``memory.on_leak = "stop"`` ended the run. The message
    names the rank, its mesh coordinates and the rate."""


@functools.lru_cache(maxsize=64)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(n, k=1)


def theil_sen_slope(x: ArrayLike, y: ArrayLike) -> float:
    """Median of ``(y[j] - y[i]) / (x[j] - x[i])`` over all pairs ``i < j`` with ``x[j] != x[i]``.

    ``x``, ``y``: 1-D, same length >= 2; the result is in units of ``y`` per unit of ``x``.
    Raises ``ValueError`` for fewer than two distinct ``x``.
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    i, j = _pairs(len(x))
    dx = x[j] - x[i]
    ok = dx != 0
    if not ok.any():
        raise ValueError("theil_sen_slope needs at least two distinct x values")
    return float(np.median((y[j] - y[i])[ok] / dx[ok]))


@dataclass
class Verdict:
    """One series' (or one rank's) verdict at a step.

    ``slope_mib_per_step``: the Theil–Sen rate over the window (None while the window holds
    fewer than 5 samples). ``oom_step``: projected step at which ``capacity`` would be used up
    at that rate (None when not growing or no capacity is known). ``source``: which series
    (``device`` allocated memory, ``host`` RSS less malloc's free bytes, or ``host_rss`` where
    the C library cannot tell those).
    """

    verdict: str
    slope_mib_per_step: float | None
    oom_step: int | None
    source: str


class LeakDetector:
    """Verdict of one memory series of one rank. Feed it with :meth:`update` once per step.

    Args:
        window: samples in the sliding window of the Theil–Sen slope.
        threshold_mib_per_step: rate at which the series is ``growing``.
        warmup_max_steps: the latest step at which warm-up ends (see the module docstring).
        source: name of the series (``host`` / ``host_rss`` / ``device``), carried into the verdicts.
    """

    MIN_SAMPLES = 5
    RELEASE = 4
    """A fall between two samples larger than this many times the threshold rate over a quarter
    of the window is a release, not a trend (:meth:`_without_releases`)."""

    def __init__(self, window: int, threshold_mib_per_step: float, warmup_max_steps: int, source: str):
        self.window, self.threshold = window, threshold_mib_per_step
        self.warmup_max = warmup_max_steps
        self.source = source
        self._steps: deque[int] = deque(maxlen=window)
        self._bytes: deque[float] = deque(maxlen=window)
        self.state = WARMING_UP
        self.warmup_end: int | None = None
        """The step at which warm-up ended (None while warming up)."""

    def _without_releases(self) -> list[float]:
        """The window's samples with every release undone: a fall between two successive samples
        larger than :attr:`RELEASE` × the threshold rate × a quarter of the window (a GC round
        freeing a profiler's or a checkpoint's garbage, pages handed back) lifts the samples
        after it back by its size. A release is a level shift down; it says nothing of the
        growth around it, which the window's slope would otherwise lose."""
        raw = list(self._bytes)
        y = list(raw)
        bound = self.RELEASE * self.threshold * MiB * max(1, self.window // 4)
        lift = 0.0
        for i in range(1, len(y)):
            if raw[i - 1] - raw[i] > bound:
                # The level (median of three samples) on either side, so a one-sample spike and
                # its return are not a release.
                fall = statistics.median(raw[max(0, i - 3):i]) - statistics.median(raw[i:i + 3])
                if fall > bound:
                    lift += fall
            y[i] += lift
        return y

    def update(self, step: int, used_bytes: float, free_bytes: float | None = None) -> Verdict:
        """Add the sample of ``step`` (``used_bytes``) and return the verdict. ``free_bytes``: what
        the rank may still allocate (capacity minus use), for the OOM projection."""
        while self._steps and self._steps[-1] >= step:  # replayed after a restart: replace
            self._steps.pop()
            self._bytes.pop()
        self._steps.append(step)
        self._bytes.append(used_bytes)
        slope = sustained = typical = recent = None
        if len(self._steps) >= self.MIN_SAMPLES:
            x, y = list(self._steps), self._without_releases()
            slope = theil_sen_slope(x, y) / MiB
            # A one-time level shift (a new allocator pool) tilts the slope of any window that
            # holds it; a leak raises every part of the window. So the growth that counts is the
            # smallest of the slopes between the medians of successive quarters of the window: a
            # shift falls into at most two of those three steps, a leak lifts all three.
            bounds = [round(k * len(x) / 4) for k in range(5)]
            mx = [statistics.median(x[a:b]) for a, b in zip(bounds, bounds[1:])]
            my = [statistics.median(y[a:b]) for a, b in zip(bounds, bounds[1:])]
            steps = [(my[i + 1] - my[i]) / (mx[i + 1] - mx[i]) / MiB for i in range(3)]
            recent, sustained = steps[-1], min(slope, *steps)
            typical = statistics.median([slope, *steps])
        if self.state == WARMING_UP:
            flat = recent is not None and recent < self.threshold  # the newest quarter has flattened
            if step >= self.warmup_max or (len(self._steps) == self.window and flat):
                self.warmup_end = step
                self.state = STABLE
        if self.state != WARMING_UP and sustained is not None and typical is not None \
                and len(self._steps) == self.window:
            # Growing once every part of the window rises at the threshold rate; stable again
            # once the typical part rises at less than half of it (a leak near the threshold
            # would otherwise flap with the noise of one quarter).
            if sustained >= self.threshold:
                self.state = GROWING
            elif typical < self.threshold / 2:
                self.state = STABLE
        oom = None
        if self.state == GROWING and free_bytes is not None and slope and slope > 0:
            oom = step + math.ceil(max(free_bytes, 0) / (slope * MiB))
        return Verdict(self.state, slope, oom, self.source)


def leak_settings(memory: Any = None) -> dict[str, Any]:
    """Keyword arguments of :class:`LeakMonitor` from a ``[memory]`` config section
    (``ray_titan.config.Memory``; its defaults when None)."""
    if memory is None:
        from ray_titan.config.schema import Memory

        memory = Memory()
    return dict(window=memory.leak_window_steps, threshold_mib_per_step=memory.leak_threshold_mib_per_step,
                host_threshold_mib_per_step=memory.host_leak_threshold_mib_per_step,
                warmup_max_steps=memory.warmup_max_steps)


def describe_coords(rank: int, coords: dict[str, int]) -> str:
    """``"rank 3 (pp=1, dp_shard=1)"``: a rank named with its mesh coordinates (those of the
    axes the run has: ``"rank 5 (pp=0, dp_shard=1, tp=1)"`` under tensor parallel)."""
    inner = ", ".join(f"{k}={v}" for k, v in coords.items())
    return f"rank {rank} ({inner})" if inner else f"rank {rank}"


# Verdict.source -> what its rate measures, as the console line and the report say it.
SERIES_NAMES = {"device": "device allocated", "host": "host RSS - malloc free", "host_rss": "host RSS"}


def host_series(rss_bytes, heap_free_bytes):
    """``(value, source)`` of the host series the verdict watches (see the module docstring):
    ``(rss_bytes - heap_free_bytes, "host")``, or ``(rss_bytes, "host_rss")`` where malloc's
    free bytes are unknown (None). Bytes; ints or equal-shape numpy arrays alike."""
    if heap_free_bytes is None:
        return rss_bytes, "host_rss"
    return rss_bytes - heap_free_bytes, "host"


class LeakMonitor:
    """Every rank's verdict: one :class:`LeakDetector` per rank for device allocated memory
    (where the rank has a device, threshold ``threshold_mib_per_step``) and one for host RSS less
    malloc's free bytes (``host_threshold_mib_per_step``; see the module docstring).

    A rank is ``growing`` if either series grows (the growing one is reported, device first),
    ``warming_up`` while either still warms up, else ``stable`` with the slope of its device
    series where it has one, else of host RSS. :meth:`update` returns the rank's verdict and
    records changes in :attr:`changes` as console messages.
    """

    def __init__(self, window: int, threshold_mib_per_step: float, host_threshold_mib_per_step: float,
                 warmup_max_steps: int):
        self._thresholds = {"device": threshold_mib_per_step, "host": host_threshold_mib_per_step,
                            "host_rss": host_threshold_mib_per_step}
        self._args = (window, warmup_max_steps)
        self._detectors: dict[tuple[int, str], LeakDetector] = {}
        self.current: dict[int, Verdict] = {}
        self.coords: dict[int, dict[str, int]] = {}

    def _detector(self, rank: int, source: str) -> LeakDetector:
        key = (rank, source)
        if key not in self._detectors:
            window, wmax = self._args
            self._detectors[key] = LeakDetector(window, self._thresholds[source], wmax, source=source)
        return self._detectors[key]

    def update(self, step: int, row: dict[str, Any]) -> tuple[Verdict, str | None]:
        """The verdict of ``row``'s rank at ``step`` and, when it changed, a console message.

        ``row`` has ``rank``, ``coords`` (axis -> index) and the memory fields of
        ``ray_titan.metrics.memory`` (``host_rss_bytes``, ``host_heap_free_bytes``, ``host_available_bytes``,
        ``device_allocated_bytes``, ``device_capacity_bytes``; device ones None on CPU)."""
        rank = row["rank"]
        self.coords[rank] = row.get("coords", {})
        verdicts = []
        if row.get("device_allocated_bytes") is not None:
            used, cap = row["device_allocated_bytes"], row.get("device_capacity_bytes")
            free = cap - (row.get("device_reserved_bytes") or used) if cap else None
            verdicts.append(self._detector(rank, "device").update(step, used, free))
        if row.get("host_rss_bytes") is not None:
            used, source = host_series(row["host_rss_bytes"], row.get("host_heap_free_bytes"))
            verdicts.append(self._detector(rank, source).update(step, used, row.get("host_available_bytes")))
        if not verdicts:
            verdict = Verdict(WARMING_UP, None, None, "host")
        else:
            growing = [v for v in verdicts if v.verdict == GROWING]
            warming = [v for v in verdicts if v.verdict == WARMING_UP]
            verdict = (growing or warming or verdicts)[0]
        before = self.current.get(rank)
        self.current[rank] = verdict
        message = None
        if before is None or before.verdict != verdict.verdict:
            message = f"memory: {self.describe(rank)} {self.format(verdict)} at step {step}"
        return verdict, message

    def describe(self, rank: int) -> str:
        return describe_coords(rank, self.coords.get(rank, {}))

    @staticmethod
    def format(v: Verdict) -> str:
        """``growing 1.02 MiB/step (host RSS), out of memory projected at step 21000``."""
        text = v.verdict
        if v.slope_mib_per_step is not None and v.verdict != WARMING_UP:
            what = SERIES_NAMES[v.source]
            text += f" {v.slope_mib_per_step:+.3f} MiB/step ({what})"
        if v.oom_step is not None:
            text += f", out of memory projected at step {v.oom_step}"
        return text

    def summary(self) -> dict[int, dict[str, Any]]:
        """Latest verdict per rank: ``{rank: {"verdict", "slope_mib_per_step", "oom_step",
        "source", "coords"}}``."""
        return {
            r: {**v.__dict__, "coords": self.coords.get(r, {})} for r, v in sorted(self.current.items())
        }
