"""The check at the end of a run: every rank has a row at every step of ``steps.parquet``
(:func:`check_complete`), and what the table counts: steps run, updates skipped, restarts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute

__all__ = ["Completeness", "check_complete"]


@dataclass
class Completeness:
    """What :func:`check_complete` found: ``steps_run`` (distinct steps, each one optimizer
    update), ``skipped_steps`` (those whose update was dropped, by their newest attempt),
    ``restarts`` (worker-group restarts), and ``missing``: ``[(step, ranks without a row)]``."""

    steps_run: int = 0
    skipped_steps: int = 0
    restarts: int = 0
    missing: list[tuple[int, list[int]]] = field(default_factory=list)

    def errors(self) -> list[str]:
        return [f"step {s}: the metrics table has no row for rank(s) {ranks}" for s, ranks in self.missing]


def check_complete(steps_path: Path, world_size: int, first_step: int | None) -> Completeness:
    """Every rank has a row at every step from the run's first (``first_step``, else the first
    recorded) to the last recorded (``world_size``: a step's group size where its rows do not
    name one). Reads the table in batches of four int columns, counting rows per step in numpy:
    memory is one batch plus a few integers per step, whatever the ranks (a 16,384-rank,
    10k-step table has 164M rows)."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(steps_path)
    # One row per step and rank, the newest attempt's (consolidate): a step a restart ran again counts once.
    n = np.zeros(0, np.int64)  # rows per step of ranks the step's worker group holds
    size = np.zeros(0, np.int64)
    skipped = np.zeros(0, np.int64)
    out = Completeness()
    columns = ["step", "rank", "skipped_update", "attempt", "world_size"]
    for b in pf.iter_batches(batch_size=1 << 20, columns=columns):
        step = b["step"].to_numpy()
        if not len(step):
            continue
        ws = pa.compute.fill_null(b["world_size"], 0).to_numpy()
        ws = np.where(ws > 0, ws, world_size)
        if step.max() >= len(n):
            grow = int(step.max()) + 1 - len(n)
            n, size, skipped = (np.concatenate([a, np.zeros(grow, np.int64)]) for a in (n, size, skipped))
        n += np.bincount(step, weights=b["rank"].to_numpy() < ws, minlength=len(n)).astype(np.int64)
        np.maximum.at(size, step, ws)
        skipped += np.bincount(step, weights=b["skipped_update"].to_numpy(zero_copy_only=False),
                               minlength=len(n)).astype(np.int64)
        out.restarts = max(out.restarts, int(pa.compute.max(b["attempt"]).as_py() or 0))
    seen = np.nonzero(size)[0]
    out.skipped_steps = int(np.count_nonzero(skipped))
    out.steps_run = len(seen)
    if not len(seen):
        return out
    start = int(seen[0]) if first_step is None else max(0, min(first_step, int(seen[0])))
    size[size == 0] = world_size  # a step with no row at all
    short = [int(x) for x in np.nonzero(n[start:] < size[start:])[0] + start]
    if short:
        out.missing = _missing_rows(pf, short, size)
    return out


def _missing_rows(pf: Any, short: list[int], size: np.ndarray) -> list[tuple[int, list[int]]]:
    """The ranks with no row at each step of ``short`` (a second pass, reading those steps' ranks only)."""
    have: dict[int, set[int]] = {s: set() for s in short}
    for b in pf.iter_batches(batch_size=1 << 20, columns=["step", "rank"]):
        keep = pa.compute.is_in(b["step"], pa.array(short, pa.int64()))
        for s, r in zip(b["step"].filter(keep).to_pylist(), b["rank"].filter(keep).to_pylist()):
            have[s].add(r)
    return [(s, [r for r in range(int(size[s])) if r not in have[s]]) for s in short]
