"""The memory plan as a run records it, ``<run_dir>/memory_plan.json`` (written by
``ray_titan.preflight.memory_plan.write_memory_plan``): its file name and how a rank's plan is found
among its entries, for the planner that writes it and the readers of a finished run alike.

A mesh over ``ray_titan.preflight.memory_plan.LISTED_RANKS`` ranks has one entry per span of ranks
(its first ``rank``, the last it covers in ``through``); a smaller one, an entry per rank.
"""

from __future__ import annotations

import bisect
from typing import Any

__all__ = ["PLAN_FILE", "covering", "planned_rank"]

PLAN_FILE = "memory_plan.json"
"""Where a run records its plan: ``<run_dir>/memory_plan.json``."""


def covering(firsts: list[int], throughs: list[int | None], rank: int) -> int | None:
    """Index of the plan (first ranks ``firsts``, ascending; spans to ``throughs``) holding ``rank``."""
    i = bisect.bisect_right(firsts, rank) - 1
    last = firsts[i] if i < 0 or throughs[i] is None else throughs[i]
    return i if i >= 0 and rank <= last else None  # type: ignore[operator]


def planned_rank(ranks: list[dict[str, Any]], rank: int) -> dict[str, Any] | None:
    """Of a recorded plan's ``ranks`` (``memory_plan.json``, in rank order), the one holding
    ``rank``'s figures (a span's, on a mesh over ``LISTED_RANKS`` ranks), or None."""
    return None if (i := covering([r["rank"] for r in ranks], [r.get("through") for r in ranks], rank)) is None \
        else ranks[i]
