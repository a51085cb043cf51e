"""A collector restarted by Ray (``max_restarts``) carries on from what its previous life flushed:
which steps of which attempt are on disk, the run's progress so far, and the memory verdicts,
which go on from the flushed rows instead of warming up again."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute

from ray_titan.metrics.collector.leak import LeakMonitor
from ray_titan.metrics.collector.sinks.parquet import latest_rows, read_raw_parts
from ray_titan.metrics.fields import MEMORY_FIELDS

__all__ = ["Flushed", "read_flushed", "reconstructed", "replay_verdicts"]


@dataclass
class Flushed:
    """The flushed parts of an earlier life: the ``attempts`` and ``steps`` of every row as
    written, and ``rows``, one per (step, rank), the newest attempt's (``latest_rows``)."""

    attempts: list[float]
    steps: list[int]
    rows: pa.Table

    @property
    def assembled(self) -> int:
        return len(set(self.rows["step"].to_pylist()))

    @property
    def last_step(self) -> int:
        return max(self.rows["step"].to_pylist())

    @property
    def final_loss(self) -> float | None:
        return self.rows.filter(pa.compute.equal(self.rows["step"], self.last_step))["step_loss"][0].as_py()


def read_flushed(parts: Path) -> Flushed | None:
    """What the parts in ``parts`` hold; None when there are none (a first life)."""
    raw = read_raw_parts(parts)
    if raw.num_rows == 0:
        return None
    return Flushed(raw["attempt_start_time"].to_pylist(), raw["step"].to_pylist(), latest_rows(raw))


def replay_verdicts(leak: LeakMonitor, rows: pa.Table) -> None:
    """Feed ``leak`` the flushed rows' memory of the last window of steps (a window is all a
    verdict holds), and the ranks' coordinates."""
    for r in rows.select(["rank", "pp", "dp_shard", "ep"]).to_pylist():
        leak.coords[r["rank"]] = {a: r[a] for a in ("pp", "dp_shard", "ep")}
    steps = rows["step"].to_numpy()
    for step in np.unique(steps)[-leak.banks["host"].window:].tolist():
        t = rows.filter(pa.array(steps == step))
        leak.update_many(step, t["rank"].to_numpy(), {
            k: t[k].to_numpy(zero_copy_only=False).astype(float) for k in MEMORY_FIELDS})


def reconstructed() -> bool:
    """Whether this is a Ray actor restarted after its process died (False outside Ray)."""
    ray = sys.modules.get("ray")  # an actor has Ray imported; the launcher (no Ray) must not import it
    try:
        if ray is None or not ray.is_initialized():
            return False
        # The property reads Ray's own deprecated ``RuntimeContext.actor_id`` (Ray 2.60), which
        # printed a RayDeprecationWarning on every run's console; only that warning is ignored,
        # and only here: nothing of ours calls the deprecated API.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"(?s).*\nUse get_actor_id\(\) instead$")
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # not in an actor
        return False
