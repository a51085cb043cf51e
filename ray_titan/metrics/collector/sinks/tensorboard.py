"""TensorBoard: the step's scalars and texts as event files in ``<run_dir>/tb``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ray_titan.metrics.collector.sinks.base import Sink, StepRecord
from ray_titan.metrics.collector.sinks.scalars import expert_load_scalars

__all__ = ["TensorBoardSink"]


class TensorBoardSink(Sink):
    """Scalars to ``<run_dir>/tb`` with tensorboardX: ``loss``, ``loss_max``, ``tokens_per_s``,
    ``lr``, ``grad_norm``, ``step_time_s``, ``val/loss`` and ``val/perplexity`` at evaluations,
    ``memory/rank{r}/<field>`` (MiB),
    ``memory/rank{r}/verdict`` (:data:`~ray_titan.metrics.fields.VERDICT_CODES`), ``memory/rank{r}/slope_mib_per_step``,
    ``gc/rank{r}/pause_s`` at steps with a GC, text ``memory/verdict`` when a verdict changes,
    text ``mesh/ranks`` (every rank's mesh coordinates, at the first step recorded), and,
    for MoE models, ``moe/aux_loss``, ``moe/layer{L}/load_max_over_mean`` and
    ``moe/layer{L}/expert{e}_share``.

    Events are written by the calling thread with tensorboardX's ``EventsWriter`` (TensorBoard's
    event-file format), not by ``SummaryWriter``'s background thread: a failed write (a full disk)
    raises here, with the path, instead of killing that thread and leaving its bounded queue to
    block every later call. A failed write gives TensorBoard up for the collector's life (the
    Parquet rows hold the same figures): :meth:`gives_up`."""

    def __init__(self, tb_dir: str | Path, purge_step: int | None = None):
        self.tb_dir = tb_dir
        self._mesh_written = False
        self._events = self._writer(purge_step)

    def _writer(self, purge_step: int | None) -> Any:
        """An event file writer; from ``purge_step`` on, TensorBoard drops the earlier writers'
        events (steps replayed after a restart)."""
        from tensorboardX.event_file_writer import EventsWriter

        Path(self.tb_dir).mkdir(parents=True, exist_ok=True)
        # A new file name even within the same second (tensorboardX names files by the second).
        suffix = "" if purge_step is None else f".{time.time_ns()}"
        events = EventsWriter(os.path.join(str(self.tb_dir), "events"), suffix)
        if purge_step is not None:
            from tensorboardX.proto.event_pb2 import Event, SessionLog

            events.write_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        return events

    def log(self, record: StepRecord) -> None:
        """The step's scalars, its MoE layers' load, the mesh (``mesh/ranks``: what ``rank{r}`` in
        the tags is, once) and its texts (``memory/verdict``)."""
        self.add_scalars(record.step, record.scalars())
        if record.load:
            self.add_expert_load(record.step, record.load, record.per_rank)
        if not self._mesh_written and record.mesh is not None:
            self.add_text("mesh/ranks", record.mesh, record.step)
            self._mesh_written = True
        for tag, text in record.texts:
            self.add_text(tag, text, record.step)

    def replay_from(self, step: int) -> None:
        """A new event file that purges the earlier ones' events from ``step`` on."""
        self._events.close()
        self._events = self._writer(step)

    def gives_up(self, error: OSError) -> str | None:
        return f"TensorBoard events in {self.tb_dir}: {error}; TensorBoard stops here"

    def _write(self, step: int, summary: Any) -> None:
        from tensorboardX.proto.event_pb2 import Event

        self._events.write_event(Event(wall_time=time.time(), step=step, summary=summary))

    def add_scalars(self, step: int, values: list[tuple[str, float]]) -> None:
        """All of a step's scalars as one event: one Summary with a value per tag, which
        TensorBoard reads as separate series (as TF1's merged summaries). ``add_scalar`` would
        make an event per tag: about 25 of them per step, each pickled through tensorboardX's
        multiprocessing queue, took most of the collector's CPU time outside Ray."""
        from tensorboardX.proto.summary_pb2 import Summary

        if values:
            self._write(step, Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in values]))

    def add_text(self, tag: str, text: str, step: int) -> None:
        """A text entry (Markdown) at ``step``, shown in TensorBoard's Text tab."""
        from tensorboardX.summary import text as text_summary

        self._write(step, text_summary(tag, text))

    def add_expert_load(self, step: int, load: dict[int, list[int]], shares: bool = True) -> None:
        """:func:`expert_load_scalars` at ``step``."""
        self.add_scalars(step, expert_load_scalars(load, shares))

    def flush(self) -> None:
        """Write what is buffered and fsync it. Raises ``OSError`` (a full disk)."""
        self._events.flush()

    def close(self) -> None:
        self._events.close()
