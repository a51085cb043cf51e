"""Ctrl-C, SIGTERM and SIGHUP for the driver: stop the run the same way, and always end the process.

Schedulers and Kubernetes stop a job with SIGTERM; a person with Ctrl-C (SIGINT); a closed
terminal or SSH session with SIGHUP. While a run is driven, :class:`SignalGuard` makes all three
take the graceful path (Ray Train's SIGINT handler aborts
the worker group; the driver flushes the metrics and names the last checkpoint) and guarantees
the process ends soon after, whatever its main thread is blocked in. :class:`Interrupted` carries
the signal to the CLI's exit status, ``128 + signum`` as a shell reports a process that signal
killed: 130, 143, 129 (SIGHUP keeps its own status, so a script can tell a closed terminal from a
scheduler's stop).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time

__all__ = ["Interrupted", "SignalGuard"]

# Taken over from their default (which ends the process at once, every unflushed metric lost).
_TERMINATING = (signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """The run was stopped by Ctrl-C (SIGINT), SIGTERM or SIGHUP: the workers are stopped, the
    metrics flushed, and the message names the last complete checkpoint. ``signum`` is the signal;
    the CLI exits with ``128 + signum`` (130, 143, 129)."""

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.signum = signum


class SignalGuard:
    """While the driver runs: SIGTERM (what schedulers and Kubernetes send) and SIGHUP (a closed
    terminal or SSH session; from then on writes to the gone terminal are dropped, not raised) do what Ctrl-C does
    (Ray Train's handler aborts the worker group during ``fit``; elsewhere ``KeyboardInterrupt``),
    and the process ends within ``grace_s`` seconds of the first signal, or at once on a second,
    whatever the main thread is blocked in: the C-level handler writes to a wakeup pipe
    (``signal.set_wakeup_fd``) that a watchdog thread reads, so a call that never returns to
    Python (a pyarrow request to storage that stopped answering) cannot hold it. ``note`` ends
    the watchdog's message: what was kept and where (the caller may change it as it goes on)."""

    def __init__(self, grace_s: float = 30.0, note: str = ""):
        self.grace_s = grace_s
        self.note = note
        self.signum: int | None = None
        self._r = self._w = -1

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set in the main thread
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, self._on_sigterm) for s in _TERMINATING}
        threading.Thread(target=self._watch, name="ray_titan-signals", daemon=True).start()
        return self

    def rearm(self) -> None:
        """Take SIGTERM and SIGHUP back (``ray.init`` installs a SIGTERM handler that exits at once)."""
        if self._w >= 0:
            for s in _TERMINATING:
                signal.signal(s, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self.signum = self.signum or signum
        if signum == signal.SIGHUP:  # the terminal is gone: a write to it (EIO) must not end the stop
            sys.stdout, sys.stderr = _Unbreakable(sys.stdout), _Unbreakable(sys.stderr)
        handler = signal.getsignal(signal.SIGINT)  # Ray Train's during fit: abort the worker group
        if callable(handler):
            handler(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt

    def _watch(self) -> None:
        first: float | None = None
        while True:
            timeout = None if first is None else max(0.0, first + self.grace_s - time.monotonic())
            ready, _, _ = select.select([self._r], [], [], timeout)
            if not ready:
                break  # the grace period is over
            data = os.read(self._r, 64)
            if 0 in data:  # __exit__: the run ended in time
                os.close(self._r)
                return
            signums = [b for b in data if b in (signal.SIGINT, *_TERMINATING)]
            if not signums:
                continue
            if first is not None:
                break  # a second signal: stop waiting
            first = time.monotonic()
            self.signum = self.signum or signums[0]
        signum = self.signum or signal.SIGINT
        print(f"ray_titan: still stopping {self.grace_s:g} s after {signal.Signals(signum).name} (or signalled "
              "again): exiting now" + (f"; {self.note}" if self.note else ""), file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def __exit__(self, *exc) -> None:
        if self._w < 0:
            return
        signal.set_wakeup_fd(self._old_fd)
        for s, old in self._old.items():
            signal.signal(s, old)
        os.write(self._w, b"\0")  # wakes the watchdog, which ends
        os.close(self._w)


class _Unbreakable:
    """A text stream whose writes are dropped once its file is gone (a closed terminal: EIO)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
