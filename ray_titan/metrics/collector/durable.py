"""What of each attempt is on disk: the watermark the collector's answers carry to the workers,
which forget a report only once it is under it (:class:`DurableSteps`).

Every report names its worker group's attempt (``attempt_start_time``). A step is assembled by
one attempt, flushed later; per attempt, the watermark is the step up to which every step of it
is flushed. The per-step records are forgotten once a watermark covers them, so the
bookkeeping stays as small as the unflushed part of the run.
"""

from __future__ import annotations

__all__ = ["DurableSteps"]


class DurableSteps:
    """The steps assembled and flushed, per attempt."""

    def __init__(self) -> None:
        self._done: dict[int, float] = {}  # step -> newest attempt assembled for it (until a watermark covers it)
        self._unflushed: list[tuple[float, int]] = []
        self._flushed: dict[float, set[int]] = {}  # attempt -> flushed steps above its watermark
        self._durable: dict[float, int] = {}  # attempt -> every step from _first[attempt] to this is on disk
        self._first: dict[float, int] = {}

    @property
    def watermarks(self) -> dict[float, int]:
        """``{attempt_start_time: step}``: every step of that attempt up to ``step`` is on disk."""
        return dict(self._durable)

    def pending(self) -> int:
        """Per-step records held: steps not yet under a watermark (a test of the bound)."""
        return len(self._done) + sum(map(len, self._flushed.values()))

    def assembled(self, step: int, attempt: float) -> None:
        """``attempt`` assembled ``step``; it is on disk once :meth:`flushed` is called."""
        self._done[step] = attempt
        self._unflushed.append((attempt, step))

    def flushed(self) -> None:
        """What was assembled since the last flush is on disk now."""
        for attempt, step in self._unflushed:
            self._flushed.setdefault(attempt, set()).add(step)
        for attempt in {a for a, _ in self._unflushed}:
            self._advance(attempt)
        self._unflushed = []

    def restore(self, attempts: list[float], steps: list[int]) -> float:
        """A restarted collector's start: the (attempt, step) of every flushed row. Returns the
        newest attempt."""
        for attempt, step in zip(attempts, steps):
            self._done[step] = max(self._done.get(step, float("-inf")), attempt)
            self._flushed.setdefault(attempt, set()).add(step)
        for attempt in self._flushed:
            self._advance(attempt)
        return max(self._flushed)

    def _advance(self, attempt: float) -> None:
        """Move ``attempt``'s watermark over its newly flushed steps, and forget the per-step
        records it now covers."""
        done = self._flushed[attempt]
        if attempt not in self._durable:
            self._durable[attempt] = min(done) - 1
            self._first[attempt] = min(done)
        wm = self._durable[attempt]
        while wm + 1 in done:
            wm += 1
            done.discard(wm)
            if self._done.get(wm) == attempt:
                del self._done[wm]
        self._durable[attempt] = wm

    def assembled_by(self, step: int) -> float:
        """The newest attempt whose report of ``step`` was assembled (-inf: none)."""
        newest = self._done.get(step, float("-inf"))
        for attempt, wm in self._durable.items():
            if attempt > newest and self._first[attempt] <= step <= wm:
                newest = attempt
        return newest
