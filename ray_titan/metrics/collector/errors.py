"""The errors a collector records: bounded, each appended to ``<run_dir>/metrics/errors.jsonl``
as it happens (so a restarted collector has them), and returned by ``finish()``."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["ERRORS_FILE", "ErrorLog"]

ERRORS_FILE = "errors.jsonl"
"""The collector's errors, one JSON string a line, in ``<run_dir>/metrics/``."""


class ErrorLog:
    """The errors of a run, kept in :attr:`messages` and on disk at ``path``; after
    :data:`MAX` of them only :attr:`total` counts (a systematic error would otherwise add one
    message per step). A write that fails (a full disk) is tried again by :meth:`rewrite`."""

    MAX = 1000

    def __init__(self, path: Path):
        self.path = path
        self.messages: list[str] = []
        self.total = 0
        self._unwritten = False
        self._write_failures: set[str] = set()

    def resume(self) -> None:
        """Carry on from what an earlier life of the collector wrote."""
        if self.path.is_file():
            self.messages = [json.loads(line) for line in self.path.read_text().splitlines()]
            self.total = len(self.messages)

    def add(self, message: str) -> None:
        self.total += 1
        if len(self.messages) > self.MAX:
            return
        if len(self.messages) == self.MAX:
            message = "... further errors are counted in errors_total only"
        self.messages.append(message)
        try:
            with open(self.path, "a", encoding="utf-8") as f:  # survives a collector restart
                f.write(json.dumps(message) + "\n")
        except OSError:  # a full disk: written again at the end, and the driver gets it in finish()
            self._unwritten = True

    def write_failed(self, message: str) -> bool:
        """Record a failed write (``message``: the file and the cause) once: a full disk fails
        every flush alike. True when it is new (the caller then says it on the console)."""
        if message in self._write_failures:
            return False
        self._write_failures.add(message)
        self.add(f"metrics: {message}")
        return True

    def rewrite(self) -> None:
        """Write the file again whole where an append failed (at the end of the run)."""
        if self._unwritten:
            try:
                self.path.write_text("".join(json.dumps(e) + "\n" for e in self.messages), encoding="utf-8")
            except OSError:
                pass
