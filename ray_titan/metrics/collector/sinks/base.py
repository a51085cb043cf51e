"""The one interface of the collector's sinks (torchtitan's ``BaseLogger`` in
``torchtitan/components/metrics.py`` is the pattern): :class:`Sink`, an abstract base with
:meth:`~Sink.log` (one assembled step, a :class:`StepRecord`) and :meth:`~Sink.close`, and
:class:`SinkSet`, which hands a step to several and gives up the ones that give up on a failed
write."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ray_titan.metrics.collector.columns import Columns
from ray_titan.metrics.collector.sinks.scalars import expert_load_scalars, memory_summary_scalars, step_scalars
from ray_titan.metrics.collector.sinks.step_table import StepColumns

__all__ = ["SCALARS", "Sink", "SinkSet", "StepRecord"]

SCALARS = ("loss", "loss_max", "tokens_per_s", "lr", "grad_norm", "step_time_s", "moe/aux_loss", "val/loss",
           "val/perplexity")
"""The step's figures logged as scalars by TensorBoard and W&B (a figure that is None is left out)."""


@dataclass
class StepRecord:
    """One assembled step, as every sink gets it. ``table``: the step's rows in columns (Parquet);
    ``figures``: the step's figures (``summary.step_summary``); ``columns`` and ``code``: the
    ranks' reports and verdict codes; ``rows``: the ranks whose own series are logged (every rank
    when ``per_rank``, else the ``growing`` ones), as dicts; ``load``: the expert load per MoE
    layer; ``mesh``: every rank's mesh coordinates, where this step knows them (what ``rank{r}``
    in the tags is); ``texts``: ``[(tag, text)]`` (TensorBoard's Text tab)."""

    step: int
    table: StepColumns
    figures: dict[str, Any]
    columns: Columns
    code: np.ndarray
    rows: list[dict[str, Any]]
    load: dict[int, list[int]]
    per_rank: bool
    mesh: str | None = None
    texts: list[tuple[str, str]] = field(default_factory=list)
    _scalars: list[tuple[str, float]] | None = field(default=None, init=False, repr=False)

    def scalars(self) -> list[tuple[str, float]]:
        """The step's scalars by tag: :data:`SCALARS`, each logged rank's memory, verdict, slope
        and GC pause, and beyond ``per_rank`` the per-stage and overall memory summaries. Computed
        once, by the first sink that asks."""
        if self._scalars is None:
            self._scalars = step_scalars({k: self.figures[k] for k in SCALARS}, self.rows) + (
                [] if self.per_rank else memory_summary_scalars(self.columns, self.code))
        return self._scalars

    def expert_load_scalars(self) -> list[tuple[str, float]]:
        """Per MoE layer its max / mean load and, with ``per_rank``, each expert's share."""
        return expert_load_scalars(self.load, shares=self.per_rank)


class Sink(abc.ABC):
    """Where assembled steps go. A sink writes in the caller's thread; a failed write raises
    ``OSError`` naming the file."""

    @abc.abstractmethod
    def log(self, record: StepRecord) -> None:
        """Take one assembled step."""

    def flush(self) -> None:  # noqa: B027 (a sink that writes at once has nothing to flush)
        """Write what is buffered."""

    def replay_from(self, step: int) -> None:  # noqa: B027 (most sinks keep a replayed step's newest record)
        """A worker group restarted: steps from ``step`` on are logged again."""

    def gives_up(self, error: OSError) -> str | None:
        """Whether a failed write ends this sink for the collector's life (its figures are in the
        Parquet rows too): the message to record, or None to let the error go on."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Write the rest; the sink takes nothing after."""


class SinkSet:
    """Sinks each step goes to, in order. A sink whose :meth:`Sink.gives_up` on a failed write is
    closed and dropped, the message handed to ``on_give_up``; the others' errors go on."""

    def __init__(self, sinks: list[Sink], on_give_up: Callable[[str], None]):
        self.sinks, self.on_give_up = sinks, on_give_up

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def log(self, record: StepRecord) -> None:
        for sink in list(self.sinks):
            self._guarded(sink, sink.log, record)

    def flush(self) -> None:
        for sink in list(self.sinks):
            self._guarded(sink, sink.flush)

    def replay_from(self, step: int) -> None:
        for sink in list(self.sinks):
            self._guarded(sink, sink.replay_from, step)

    def close(self) -> None:
        for sink in list(self.sinks):
            self._guarded(sink, sink.close)

    def _guarded(self, sink: Sink, call: Callable[..., None], *args: Any) -> None:
        try:
            call(*args)
        except OSError as e:
            message = sink.gives_up(e)
            if message is None:
                raise
            self.sinks.remove(sink)
            self.on_give_up(message)
            try:
                sink.close()
            except OSError:
                pass
