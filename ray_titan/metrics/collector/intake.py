"""Reports in: a packed batch's reports filed under their steps until every rank of a step's
worker group has reported it (:class:`Intake`).

A step's reports are of one attempt only: a restarted worker group's replay supersedes the lost
attempt's pending reports, and reports of a step already assembled by that attempt or a newer
one (resent, or superseded) are dropped. The reports each rank (and each metrics aggregator)
says it had to drop are counted, for the errors at the end.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ray_titan.metrics.collector.columns import INDEX
from ray_titan.metrics.collector.console import span
from ray_titan.metrics.collector.durable import DurableSteps

__all__ = ["Intake"]


class Intake:
    """The steps not yet complete. ``world_size``: the ranks of a step whose reports do not name
    their group's size; ``durable``: what is assembled and on disk (resent reports of those steps
    are dropped)."""

    def __init__(self, world_size: int, durable: DurableSteps):
        self.world_size, self.durable = world_size, durable
        self.newest_attempt = float("-inf")
        self._parts: dict[int, list[dict[str, Any]]] = {}  # step -> packed parts (pack_reports)
        self._seen: dict[int, set[int]] = {}  # step -> ranks with a pending report
        self._sizes: dict[int, int] = {}  # step -> ranks of its worker group
        self._attempt: dict[int, float] = {}  # step -> attempt of its pending reports
        self.dropped: dict[int, int] = {}  # rank -> reports it dropped
        self.aggregator_dropped: dict[str, int] = {}  # sender -> reports that metrics aggregator dropped

    def accept(self, packed: dict[str, Any]) -> list[tuple[float, int]]:
        """File a packed batch's reports under their steps. Returns the restarts it shows,
        ``[(attempt, its first step)]``: attempts newer than the newest seen (a worker group
        restarted; the first attempt is no restart)."""
        v = packed["values"]
        step_col, attempt_col, rank_col = v[:, INDEX["step"]], v[:, INDEX["attempt_start_time"]], v[:, INDEX["rank"]]
        drops = v[:, INDEX["dropped"]]
        for r in np.nonzero(drops > 0)[0].tolist():
            self.dropped[int(rank_col[r])] = int(drops[r])
        if (step_col == step_col[0]).all() and (attempt_col == attempt_col[0]).all():
            pairs = [(float(attempt_col[0]), float(step_col[0]))]  # an aggregator's batch: one step
        else:  # sorted by attempt, then step
            pairs = np.unique(np.column_stack([attempt_col, step_col]), axis=0).tolist()
        restarts = []
        for attempt, fstep in pairs:
            step = int(fstep)
            if attempt > self.newest_attempt:
                if self.newest_attempt > float("-inf"):
                    restarts.append((attempt, step))
                self.newest_attempt = attempt
            if self.durable.assembled_by(step) >= attempt:
                continue  # resent or superseded reports of a step already assembled
            if self._attempt.get(step, attempt) < attempt:  # a restarted worker group replays this step
                self._parts.pop(step, None)
                self._seen.pop(step, None)
            elif self._attempt.get(step, attempt) > attempt:
                continue
            at = np.nonzero((step_col == fstep) & (attempt_col == attempt))[0]
            part = at if len(at) < len(v) else slice(None)
            self._attempt[step] = attempt
            self._parts.setdefault(step, []).append(
                {"values": v[part], "null": packed["null"][part], "axes": packed["axes"],
                 "moe": None if packed.get("moe") is None else (packed["moe"][0][part], packed["moe"][1][part]),
                 "objects": packed["objects"] if isinstance(part, slice) else [packed["objects"][i] for i in at]})
            self._seen.setdefault(step, set()).update(rank_col[part].astype(np.int64).tolist())
            size = v[at[0], INDEX["world_size"]]
            self._sizes[step] = self.world_size if np.isnan(size) or size <= 0 else int(size)
        return restarts

    def complete(self) -> list[tuple[int, list[dict[str, Any]]]]:
        """The steps every rank has reported, ``[(step, its packed parts)]`` in step order, taken out."""
        out = []
        for step in sorted(s for s, seen in self._seen.items() if len(seen) == self._sizes[s]):
            self._attempt.pop(step)
            del self._seen[step], self._sizes[step]
            out.append((step, self._parts.pop(step)))
        return out

    def pending(self) -> int:
        """Steps waiting for a report."""
        return len(self._parts)

    def close(self) -> list[str]:
        """The errors at the end: each step still waiting (naming the ranks it waits for), and
        the reports ranks and aggregators dropped. Forgets the waiting steps."""
        errors = []
        for step in sorted(self._parts):
            missing = sorted(set(range(self._sizes[step])) - self._seen[step])
            errors.append(f"step {step}: no report from rank(s) {span(missing) if len(missing) > 16 else missing}")
        self._parts.clear()
        self._seen.clear()
        self._sizes.clear()
        if self.aggregator_dropped:
            errors.append(f"the metrics aggregators dropped {sum(self.aggregator_dropped.values())} report(s): "
                          "the collector was too slow")
        for rank, n in sorted(self.dropped.items()):
            errors.append(f"rank {rank} dropped {n} report(s) before they were on disk: the collector was too "
                          "slow or restarted (raise metrics.max_buffered_reports or lower metrics.flush_every_steps)")
        return errors
