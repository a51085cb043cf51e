"""The driver's live view of a run: a progress bar on a terminal, one line per log step elsewhere.

The collector is polled (``MetricsCollector.poll``) for its console lines and its newest assembled
step (``latest``: step, total, last-stage loss, tokens/s, the rank with the most memory). On a
terminal a tqdm bar shows steps done / total, elapsed and ETA, the current loss, tokens/s and the
maximum memory over ranks, with the console lines printed above it. When the output is not a
terminal (``ray job submit`` logs, a file, a pipe) the console lines are printed as they are, each
with the ETA appended: no carriage returns or redraws end up in a log.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, TextIO, get_args

from ray_titan.config.units import MiB

__all__ = [
    "MODES", "BarDisplay", "ConsoleThread", "LineDisplay", "check_mode", "format_eta", "format_postfix", "make_display",
]

Mode = Literal["auto", "bar", "lines"]
MODES: tuple[str, ...] = get_args(Mode)


def check_mode(mode: str) -> None:
    """Raises ``ValueError`` unless ``mode`` is one of :data:`MODES`."""
    if mode not in MODES:
        raise ValueError(f"progress = {mode!r}: use 'auto', 'bar' or 'lines'")


def format_eta(seconds: float | None) -> str:
    """``H:MM:SS`` (``M:SS`` under an hour); ``?`` when unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    s = round(seconds)
    h, rem = divmod(s, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


def format_postfix(latest: dict[str, Any]) -> str:
    """The bar's right-hand side: last-stage loss (nats/token), tokens/s, and the maximum memory
    over ranks in MiB with its rank (device peak reserved on GPUs, host RSS otherwise)."""
    loss = "n/a" if latest.get("loss") is None else f"{latest['loss']:.4f}"
    parts = [f"loss {loss}", f"{latest.get('tokens_per_s') or 0:,.0f} tok/s"]
    mem = latest.get("max_memory")
    if mem:
        parts.append(f"{mem['kind']} max {mem['bytes'] / MiB:,.0f} MiB (r{mem['rank']})")
    return " | ".join(parts)


class _Eta:
    """Seconds left from the step rate since the first step seen (which includes no start-up)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.first: tuple[int, float] | None = None

    def __call__(self, step: int, total: int) -> float | None:
        now = self.clock()
        if self.first is None:
            self.first = (step, now)
        s0, t0 = self.first
        if step >= total:
            return 0.0
        if step <= s0:
            return None
        return (total - step) * (now - t0) / (step - s0)


class LineDisplay:
    """Plain mode: every console line as it comes, with ``| eta M:SS`` appended once known."""

    def __init__(self, total: int, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.total, self.stream = total, stream or sys.stdout
        self._eta = _Eta(clock)
        self._last_eta: float | None = None

    def update(self, payload: dict[str, Any]) -> None:
        """Print ``payload["lines"]``; ``payload["latest"]`` (or None) refreshes the ETA."""
        latest = payload.get("latest")
        if latest:
            self._last_eta = self._eta(latest["step"], self.total)
        for line in payload.get("lines", []):
            suffix = f" | eta {format_eta(self._last_eta)}" if self._last_eta is not None else ""
            print(line + suffix, file=self.stream, flush=True)

    def close(self) -> None:
        self.stream.flush()


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # not a terminal, or no file descriptor
        return 0


class BarDisplay:
    """Terminal mode: a tqdm bar (steps done / total, elapsed < ETA, rate) with
    :func:`format_postfix` on its right; console lines are written above the bar."""

    def __init__(self, total: int, stream: TextIO | None = None):
        from tqdm import tqdm

        self.stream = stream or sys.stdout
        # tqdm draws nothing on a terminal that reports a 0 × 0 window (a pty without one, as
        # under `script` or some CI runners): give it a fixed size instead of following the window.
        sized = _columns(self.stream) > 0
        self.bar = tqdm(total=total, unit="step", file=self.stream, dynamic_ncols=sized,
                        ncols=None if sized else 120, nrows=None if sized else 40, smoothing=0.3,
                        bar_format="{l_bar}{bar:24}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")

    def update(self, payload: dict[str, Any]) -> None:
        for line in payload.get("lines", []):
            self.bar.write(line, file=self.stream)
        latest = payload.get("latest")
        if latest:
            if latest["step"] > self.bar.n:
                self.bar.update(latest["step"] - self.bar.n)
            self.bar.set_postfix_str(format_postfix(latest), refresh=False)
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def make_display(total: int, mode: Mode = "auto", stream: TextIO | None = None) -> LineDisplay | BarDisplay:
    """``bar`` on a terminal, ``lines`` otherwise (``auto``), or the mode asked for.

    Raises ``ValueError`` for another mode.
    """
    check_mode(mode)
    stream = stream or sys.stdout
    if mode == "auto":
        mode = "bar" if getattr(stream, "isatty", lambda: False)() else "lines"
    return BarDisplay(total, stream) if mode == "bar" else LineDisplay(total, stream)


class ConsoleThread(threading.Thread):
    """Calls ``poll()`` every ``interval_s`` and hands the payload to the display. Once a second by
    default: workers send their reports once a second (``metrics.report_interval_s``), so polling
    faster shows nothing sooner, and each poll is a Ray call that costs the driver and the
    collector ~0.7 ms of CPU each.

    ``poll`` returns ``{"lines": [...], "latest": {...} | None}`` (the collector's ``poll``); a
    failing poll (the collector busy or gone) is skipped: :meth:`finish` shows what remains.
    """

    def __init__(self, poll: Callable[[], dict[str, Any]], display: LineDisplay | BarDisplay, interval_s: float = 1.0):
        super().__init__(daemon=True, name="ray_titan-console")
        self.poll, self.display, self.interval_s = poll, display, interval_s
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.interval_s):
            try:
                payload = self.poll()
            except Exception:
                continue
            self.display.update(payload)

    def finish(self, final: dict[str, Any] | None = None) -> None:
        """Stop polling, show the final payload (the collector's summary), close the display."""
        self.stop_event.set()
        if self.is_alive():
            self.join()
        if final:
            self.display.update(final)
        self.display.close()
