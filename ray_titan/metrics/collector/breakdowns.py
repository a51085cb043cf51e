"""Every rank's measured memory breakdown (``memory.breakdown_step``,
``ray_titan.metrics.worker.profiling``), as the collector keeps it: one JSON line per rank in
``<run_dir>/metrics/memory_breakdown.jsonl``, written as it arrives (:class:`BreakdownLog`), read
back by a restarted collector and by ``ray-titan report`` (:func:`read_breakdowns`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["BREAKDOWN_FILE", "BreakdownLog", "read_breakdowns"]

BREAKDOWN_FILE = "memory_breakdown.jsonl"
"""Every rank's measured memory breakdown, one JSON line each, in ``<run_dir>/metrics/``."""


def read_breakdowns(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """``{rank: breakdown}`` from ``<run_dir>/metrics/memory_breakdown.jsonl`` (the newest line of
    a rank wins: a replayed step after a restart); empty if there is none."""
    path = Path(run_dir) / "metrics" / BREAKDOWN_FILE
    out: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                b = json.loads(line)
                out[b["rank"]] = b
    return dict(sorted(out.items()))


class BreakdownLog:
    """The breakdowns of the run's ranks (:attr:`by_rank`), appended to ``<run_dir>/metrics/`` as
    they arrive, so they survive a restart."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.path = run_dir / "metrics" / BREAKDOWN_FILE
        self.by_rank: dict[int, dict[str, Any]] = {}
        self._unwritten = False

    def resume(self) -> None:
        """Carry on from what an earlier life of the collector wrote."""
        self.by_rank = read_breakdowns(self.run_dir)

    def add(self, breakdown: dict[str, Any]) -> str | None:
        """Keep a rank's breakdown, on disk at once. A full disk must not cost the step its row:
        returns the failure (the file and the cause) for the caller to record, and the
        breakdowns are written again by :meth:`rewrite`; None when written."""
        self.by_rank[breakdown["rank"]] = breakdown
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(breakdown) + "\n")
        except OSError as e:
            self._unwritten = True
            return f"memory breakdown {self.path}: {e.strerror or e}"
        return None

    def rewrite(self) -> None:
        """Write the file again whole where an append failed (at the end of the run)."""
        if self._unwritten:
            try:
                self.path.write_text("".join(json.dumps(b) + "\n" for b in self.by_rank.values()), encoding="utf-8")
            except OSError:
                pass
