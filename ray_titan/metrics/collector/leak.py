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
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from ray_titan.config.units import MiB
from ray_titan.metrics.fields import VERDICT_CODES, VERDICTS, describe_coords

__all__ = [
    "GROWING",
    "SERIES_NAMES",
    "STABLE",
    "WARMING_UP",
    "LeakDetector",
    "LeakMonitor",
    "SeriesBank",
    "Verdict",
    "host_series",
    "leak_settings",
    "theil_sen_slope",
]

WARMING_UP, STABLE, GROWING = VERDICTS
"""The verdicts (:data:`~ray_titan.metrics.fields.VERDICTS`, whose index is a verdict's code in
the arrays here: ``SeriesBank.state``, :meth:`LeakMonitor.update_many`'s ``code``)."""
_WARMING, _STABLE, _GROWING = (VERDICT_CODES[v] for v in VERDICTS)  # in that order: a later one outranks


def _median_rows(a: np.ndarray) -> np.ndarray:
    """The median of each row of ``a`` (2-D): ``np.median(a, axis=1)`` in one ``np.partition``,
    without ``np.median``'s Python overhead (~20 µs a call, a dozen calls a step)."""
    k = a.shape[1]
    if k % 2:
        return np.partition(a, k // 2, axis=1)[:, k // 2]
    p = np.partition(a, (k // 2 - 1, k // 2), axis=1)
    return (p[:, k // 2 - 1] + p[:, k // 2]) / 2


def _quarter_medians(a: np.ndarray, bounds: list[int]) -> np.ndarray:
    """The median of each row's quarters ``a[:, bounds[q]:bounds[q + 1]]``, ``(rows, 4)``: one
    partition when the quarters are of one length (a full window of a multiple of 4 steps)."""
    q = bounds[1]
    if all(b - a_ == q for a_, b in zip(bounds, bounds[1:])) and q:
        return _median_rows(a[:, :4 * q].reshape(-1, q)).reshape(len(a), 4)
    return np.stack([_median_rows(a[:, lo:hi]) for lo, hi in zip(bounds, bounds[1:])], axis=1)


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


class SeriesBank:
    """The verdicts of one memory series (one ``source``) of many ranks at once, as arrays indexed
    by rank: the algorithm of the module docstring, vectorised over ranks with numpy so the
    collector judges 16,384 ranks a step in milliseconds instead of one Theil–Sen per rank.

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
        self.x = np.zeros((0, window))  # steps of each rank's window, oldest first; ``n`` valid
        self.y = np.zeros((0, window))  # bytes
        self.n = np.zeros(0, np.int64)
        self.state = np.zeros(0, np.int8)  # index into VERDICTS
        self.slope = np.zeros(0)  # MiB/step of the last evaluation, NaN: none yet
        self.oom = np.zeros(0)  # projected OOM step, NaN: none
        self.warmup_end = np.zeros(0, np.int64)  # 0: still warming up

    def grow(self, size: int) -> None:
        """Make room for ranks ``0 .. size - 1``."""
        extra = size - len(self.n)
        if extra > 0:
            self.x = np.vstack([self.x, np.zeros((extra, self.window))])
            self.y = np.vstack([self.y, np.zeros((extra, self.window))])
            self.n = np.concatenate([self.n, np.zeros(extra, np.int64)])
            self.state = np.concatenate([self.state, np.zeros(extra, np.int8)])
            self.slope = np.concatenate([self.slope, np.full(extra, np.nan)])
            self.oom = np.concatenate([self.oom, np.full(extra, np.nan)])
            self.warmup_end = np.concatenate([self.warmup_end, np.zeros(extra, np.int64)])

    def update(self, ranks: np.ndarray, step: int, used: np.ndarray, free: np.ndarray,
               fit: np.ndarray | None = None) -> None:
        """Add the samples of ``step`` (``used``, bytes, shape ``(k,)``, one per rank of ``ranks``;
        distinct ranks) and judge every one of them. ``free``: what each rank may still allocate
        (bytes; NaN: unknown), for the OOM projection. ``fit`` (bool ``(k,)``; default all): the
        ranks whose Theil–Sen slope is refitted now; the others keep their last one in
        :attr:`slope` unless their verdict needs it (see :meth:`_evaluate`). A sample of a step
        at or before one already held (a step replayed after a restart) replaces the held ones
        from there."""
        self.grow(int(ranks.max()) + 1 if len(ranks) else 0)
        w = self.window
        valid = np.arange(w) < self.n[ranks, None]
        n = ((self.x[ranks] < step) & valid).sum(axis=1)  # steps are increasing within a window
        full = n == w
        if full.any():
            f = ranks[full]
            self.x[f, :-1] = self.x[f, 1:]
            self.y[f, :-1] = self.y[f, 1:]
            n[full] -= 1
        self.x[ranks, n] = step
        self.y[ranks, n] = used
        self.n[ranks] = n + 1
        if len(ranks):
            self._evaluate(ranks, step, free, np.ones(len(ranks), bool) if fit is None else fit)

    def _evaluate(self, ranks: np.ndarray, step: int, free: np.ndarray, fit: np.ndarray) -> None:
        """Judge ``ranks``. The Theil–Sen slope (the costly part: a median of window² / 2 slopes
        per rank) is fitted where ``fit`` says and wherever it can decide the verdict: a rank whose
        three quarter-to-quarter rates all reach the threshold (it may be growing) or a growing
        one whose rates do not all fall below half of it (it may stay growing). Elsewhere the
        verdict is the same whatever the slope, so every rank's verdict is exact at every step."""
        n = self.n[ranks]
        k = len(ranks)
        slope, recent, sustained, typical = (np.full(k, np.nan) for _ in range(4))
        old = self.slope[ranks]
        thr = self.threshold
        for m in np.unique(n[n >= self.MIN_SAMPLES]):  # one group but after a replay or a late rank
            at = np.nonzero(n == m)[0]
            x, y = self.x[ranks[at], :m], self._without_releases(self.y[ranks[at], :m])
            # A one-time level shift (a new allocator pool) tilts the slope of any window that
            # holds it; a leak raises every part of the window. So the growth that counts is the
            # smallest of the slopes between the medians of successive quarters of the window: a
            # shift falls into at most two of those three steps, a leak lifts all three.
            bounds = [round(q * int(m) / 4) for q in range(5)]
            mx, my = np.split(_quarter_medians(np.concatenate([x, y]), bounds), 2)
            steps = np.diff(my, axis=1) / np.diff(mx, axis=1) / MiB
            lo, hi = steps.min(axis=1), steps.max(axis=1)
            need = fit[at] | (lo >= thr) | ((self.state[ranks[at]] == _GROWING) & ~(hi < thr / 2))
            s = old[at].copy()
            if need.any():
                i, j = _pairs(int(m))
                xn, yn = x[need], y[need]
                s[need] = _median_rows((yn[:, j] - yn[:, i]) / (xn[:, j] - xn[:, i])) / MiB  # Theil–Sen
            # Where the slope was not fitted it cannot decide: lo < thr, so not growing; and a
            # growing rank's rates all under thr / 2 make it stable whatever the slope is.
            sd = np.where(need, s, lo)
            slope[at], recent[at] = s, steps[:, -1]
            sustained[at] = np.minimum(sd, lo)
            typical[at] = _median_rows(np.column_stack([sd, steps]))
        state = self.state[ranks]
        with np.errstate(invalid="ignore"):
            warm = state == _WARMING
            flat = recent < thr  # the newest quarter has flattened (NaN: not yet known)
            end = warm & ((step >= self.warmup_max) | ((n == self.window) & flat))
            state[end] = _STABLE
            self.warmup_end[ranks[end]] = step
            # Growing once every part of the window rises at the threshold rate; stable again
            # once the typical part rises at less than half of it (a leak near the threshold
            # would otherwise flap with the noise of one quarter).
            judged = (state != _WARMING) & (n == self.window) & ~np.isnan(sustained)
            grows = judged & (sustained >= thr)
            state[grows] = _GROWING
            state[judged & ~grows & (typical < thr / 2)] = _STABLE
            oom = np.full(k, np.nan)
            proj = (state == _GROWING) & ~np.isnan(free) & (slope > 0)
            oom[proj] = step + np.ceil(np.maximum(free[proj], 0) / (slope[proj] * MiB))
        self.state[ranks], self.slope[ranks], self.oom[ranks] = state, slope, oom

    def _without_releases(self, raw: np.ndarray) -> np.ndarray:
        """The windows' samples (``(ranks, m)`` bytes) with every release undone: a fall between
        two successive samples larger than :attr:`RELEASE` × the threshold rate × a quarter of
        the window (a GC round freeing a profiler's or a checkpoint's garbage, pages handed back)
        lifts the samples after it back by its size. A release is a level shift down; it says
        nothing of the growth around it, which the window's slope would otherwise lose."""
        bound = self.RELEASE * self.threshold * MiB * max(1, self.window // 4)
        rows, cols = np.nonzero(raw[:, :-1] - raw[:, 1:] > bound)
        if not len(rows):
            return raw
        lift = np.zeros_like(raw)
        for r, c in zip(rows.tolist(), cols.tolist()):  # rare: a handful of ranks at a step
            i = c + 1
            # The level (median of three samples) on either side, so a one-sample spike and its
            # return are not a release.
            fall = np.median(raw[r, max(0, i - 3):i]) - np.median(raw[r, i:i + 3])
            if fall > bound:
                lift[r, i] = fall
        return raw + np.cumsum(lift, axis=1)

    def verdict(self, rank: int) -> Verdict:
        """The verdict of ``rank`` as of its last evaluation."""
        slope, oom = self.slope[rank], self.oom[rank]
        return Verdict(VERDICTS[self.state[rank]], None if np.isnan(slope) else float(slope),
                       None if np.isnan(oom) else int(oom), self.source)


class LeakDetector:
    """Verdict of one memory series of one rank (a :class:`SeriesBank` of one rank). Feed it with
    :meth:`update` once per step. Arguments as :class:`SeriesBank`'s."""

    MIN_SAMPLES = SeriesBank.MIN_SAMPLES
    RELEASE = SeriesBank.RELEASE

    def __init__(self, window: int, threshold_mib_per_step: float, warmup_max_steps: int, source: str):
        self._bank = SeriesBank(window, threshold_mib_per_step, warmup_max_steps, source)
        self.window, self.threshold, self.source = window, threshold_mib_per_step, source

    @property
    def state(self) -> str:
        return VERDICTS[self._bank.state[0]] if len(self._bank.n) else WARMING_UP

    @property
    def warmup_end(self) -> int | None:
        """The step at which warm-up ended (None while warming up)."""
        return int(self._bank.warmup_end[0]) or None if len(self._bank.n) else None

    def update(self, step: int, used_bytes: float, free_bytes: float | None = None) -> Verdict:
        """Add the sample of ``step`` (``used_bytes``) and return the verdict. ``free_bytes``: what
        the rank may still allocate (capacity minus use), for the OOM projection."""
        free = np.nan if free_bytes is None else float(free_bytes)
        self._bank.update(np.zeros(1, np.int64), step, np.array([float(used_bytes)]), np.array([free]))
        return self._bank.verdict(0)


def leak_settings(memory: Any = None) -> dict[str, Any]:
    """Keyword arguments of :class:`LeakMonitor` from a ``[memory]`` config section
    (``ray_titan.config.schema.Memory``; its defaults when None)."""
    if memory is None:
        from ray_titan.config.schema import Memory

        memory = Memory()
    return dict(window=memory.leak_window_steps, threshold_mib_per_step=memory.leak_threshold_mib_per_step,
                host_threshold_mib_per_step=memory.host_leak_threshold_mib_per_step,
                warmup_max_steps=memory.warmup_max_steps)


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
    """Every rank's verdict: a :class:`SeriesBank` for device allocated memory (where a rank has a
    device, threshold ``threshold_mib_per_step``) and one for host RSS less malloc's free bytes
    (``host_threshold_mib_per_step``; RSS alone where malloc's free bytes are unknown; see the
    module docstring), each indexed by rank.

    A rank is ``growing`` if either series grows (the growing one is reported, device first),
    ``warming_up`` while either still warms up, else ``stable`` with the slope of its device
    series where it has one, else of host RSS. :meth:`update_many` judges a step's ranks at once;
    :meth:`update` one rank.
    """

    def __init__(self, window: int, threshold_mib_per_step: float, host_threshold_mib_per_step: float,
                 warmup_max_steps: int):
        self.banks = {
            "device": SeriesBank(window, threshold_mib_per_step, warmup_max_steps, "device"),
            "host": SeriesBank(window, host_threshold_mib_per_step, warmup_max_steps, "host"),
            "host_rss": SeriesBank(window, host_threshold_mib_per_step, warmup_max_steps, "host_rss"),
        }
        self._code = np.full(0, -1, np.int8)  # each rank's current verdict (-1: none yet)
        self._source = np.zeros(0, np.int8)  # index into SOURCES of the series it comes from
        self.coords: dict[int, dict[str, int]] = {}

    SOURCES = ("device", "host", "host_rss")

    def update_many(self, step: int, ranks: np.ndarray, mem: dict[str, np.ndarray],
                    every: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, Verdict]]]:
        """Judge the ranks of ``step``.

        ``ranks``: distinct ranks, int ``(k,)``. ``mem``: the memory fields of
        ``ray_titan.metrics.fields.MEMORY_FIELDS`` by name, float ``(k,)`` in bytes, NaN where a
        rank's report had None (device fields on CPU; malloc's free bytes without glibc).
        ``every``: refit each rank's Theil–Sen slope (the ``slope`` reported) every this many
        steps (rank ``r`` at steps where ``(r + step) % every == 0``), so the cost per step stays
        flat however many ranks there are; the verdict itself is exact at every step
        (:meth:`SeriesBank._evaluate` fits the slope wherever it could decide); 1: every step.

        Returns ``(code, slope, oom, changes)``: each rank's verdict (index into ``WARMING_UP,
        STABLE, GROWING``), slope (MiB/step, NaN: none) and projected OOM step (NaN: none), and
        ``[(rank, Verdict)]`` for the ranks whose verdict changed.
        """
        ranks = np.asarray(ranks, np.int64)
        k = len(ranks)
        size = int(ranks.max()) + 1 if k else 0
        if size > len(self._code):
            self._code = np.concatenate([self._code, np.full(size - len(self._code), -1, np.int8)])
            self._source = np.concatenate([self._source, np.zeros(size - len(self._source), np.int8)])
        fit = None if every <= 1 else (ranks + step) % every == 0
        nan = np.full(k, np.nan)
        states = np.full((3, k), -1, np.int8)  # per source, -1: the rank has no such series
        dev = mem.get("device_allocated_bytes", nan)
        has = ~np.isnan(dev)
        if has.any():
            cap, reserved = mem.get("device_capacity_bytes", nan), mem.get("device_reserved_bytes", nan)
            free = cap - np.where(np.isnan(reserved), dev, reserved)  # NaN without a capacity
            self._feed(0, ranks, has, step, dev, free, fit, states)
        rss = mem.get("host_rss_bytes", nan)
        heap_free = mem.get("host_heap_free_bytes", nan)
        avail = mem.get("host_available_bytes", nan)
        with_free = ~np.isnan(rss) & ~np.isnan(heap_free)
        if with_free.any():
            used, _ = host_series(rss, heap_free)
            self._feed(1, ranks, with_free, step, used, avail, fit, states)
        rss_only = ~np.isnan(rss) & np.isnan(heap_free)
        if rss_only.any():
            self._feed(2, ranks, rss_only, step, rss, avail, fit, states)
        host = np.where(states[1] >= 0, 1, 2)
        hstate = np.maximum(states[1], states[2])
        d = states[0]
        # growing first (device first), then warming up, then device, then host.
        # (np.select's own overhead is ~100 µs a call: the cascade as nested wheres.)
        src = np.where(d == _GROWING, 0, np.where(hstate == _GROWING, host, np.where(d == _WARMING, 0, np.where(
            hstate == _WARMING, host, np.where(d >= 0, 0, np.where(hstate >= 0, host, -1))))))
        code = np.where(src == 0, d, np.where(src >= 1, hstate, _WARMING)).astype(np.int8)
        slope, oom = np.full(k, np.nan), np.full(k, np.nan)
        for i, name in enumerate(self.SOURCES):
            at = src == i
            if at.any():
                slope[at], oom[at] = self.banks[name].slope[ranks[at]], self.banks[name].oom[ranks[at]]
        source = np.where(src < 0, 1, src).astype(np.int8)
        changed = np.nonzero(self._code[ranks] != code)[0]
        self._code[ranks], self._source[ranks] = code, source
        changes = [(int(ranks[i]), self._verdict(int(ranks[i]))) for i in changed.tolist()]
        return code, slope, oom, changes

    def _feed(self, i: int, ranks, mask, step, used, free, fit, states) -> None:
        bank = self.banks[self.SOURCES[i]]
        r = ranks[mask]
        bank.update(r, step, used[mask], free[mask], None if fit is None else fit[mask])
        states[i, mask] = bank.state[r]

    def _verdict(self, rank: int) -> Verdict:
        code = self._code[rank]
        if code < 0:
            return Verdict(WARMING_UP, None, None, "host")
        bank = self.banks[self.SOURCES[self._source[rank]]]
        v = bank.verdict(rank) if rank < len(bank.n) and bank.n[rank] else Verdict(WARMING_UP, None, None, bank.source)
        v.verdict = VERDICTS[code]  # a rank without any series reads warming_up
        return v

    def update(self, step: int, row: dict[str, Any]) -> tuple[Verdict, str | None]:
        """The verdict of ``row``'s rank at ``step`` and, when it changed, a console message.

        ``row`` has ``rank``, ``coords`` (axis -> index) and the memory fields of
        ``ray_titan.metrics.worker.memory`` (``host_rss_bytes``, ``host_heap_free_bytes``, ``host_available_bytes``,
        ``device_allocated_bytes``, ``device_capacity_bytes``; device ones None on CPU)."""
        rank = row["rank"]
        self.coords[rank] = row.get("coords", {})
        mem = {k: np.array([np.nan if row.get(k) is None else float(row[k])]) for k in (
            "device_allocated_bytes", "device_capacity_bytes", "device_reserved_bytes", "host_rss_bytes",
            "host_heap_free_bytes", "host_available_bytes")}
        _, _, _, changes = self.update_many(step, np.array([rank]), mem)
        verdict = self._verdict(rank)
        message = f"memory: {self.describe(rank)} {self.format(verdict)} at step {step}" if changes else None
        return verdict, message

    @property
    def current(self) -> dict[int, Verdict]:
        """Latest verdict per rank seen."""
        return {r: self._verdict(r) for r in np.nonzero(self._code >= 0)[0].tolist()}

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
        return {r: {**v.__dict__, "coords": self.coords.get(r, {})} for r, v in sorted(self.current.items())}
