"""``memory.on_leak``: what a ``growing`` memory verdict does to the run. The policy decides; the
collector acts on its decision (keeps the reason, which every later answer to the workers
carries, so each stops) and the console says it (``console.verdict_messages``)."""

from __future__ import annotations

from dataclasses import dataclass

from ray_titan.metrics.collector.leak import GROWING, Verdict

__all__ = ["ON_LEAK", "LeakPolicy", "LeakStop"]

ON_LEAK = ("warn", "stop")
"""``warn``: a growing rank is reported (console, TensorBoard, its rows); ``stop``: and the run ends."""


@dataclass(frozen=True)
class LeakStop:
    """The decision to end the run: ``rank``'s ``verdict`` turned ``growing`` at ``step``."""

    step: int
    rank: int
    verdict: Verdict


class LeakPolicy:
    """``on_leak``: ``"warn"`` or ``"stop"`` (:data:`ON_LEAK`)."""

    def __init__(self, on_leak: str = "warn"):
        self.on_leak = on_leak

    def decide(self, step: int, changes: list[tuple[int, Verdict]]) -> LeakStop | None:
        """Of a step's verdict changes (``[(rank, Verdict)]``, in rank order), the one that ends
        the run: the first rank turned ``growing`` under ``on_leak = "stop"``; None: the run goes on."""
        if self.on_leak != "stop":
            return None
        return next((LeakStop(step, rank, v) for rank, v in changes if v.verdict == GROWING), None)
