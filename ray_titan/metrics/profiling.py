"""The torch profiler around chosen steps: Chrome traces, the measured memory breakdown and CPU
memory snapshots.

torch runs one profiler at a time, so :class:`StepProfiler` starts one per chosen step and
serves every request of that step from it:

- ``profiling.trace_steps``: a Chrome trace of the step per rank,
  ``<run_dir>/profile/rank{r}-step{s}.json`` (``export_chrome_trace``; open it in Perfetto,
  https://ui.perfetto.dev, or ``chrome://tracing``): every operator of forward and backward, the
  pipeline schedule's ``Forward i`` / ``Backward i`` ranges, the collectives (gloo or NCCL) and,
  on GPUs, the kernels.
- ``memory.breakdown_step`` (default 2, the first step with optimizer state): the rank's memory
  split by category at the moment of the step's peak, from the profiler's memory timeline
  (``torch.profiler`` ``export_memory_timeline``, which tags every tensor as a parameter,
  gradient, optimizer state, activation, temporary, input or unknown from the data flow it
  records): :func:`timeline_breakdown`. It travels in that step's report to the collector
  (``metrics/memory_breakdown.jsonl``, ``RunResult.memory_breakdown``, ``ray-titan report``).
- ``memory.snapshot_steps`` on CPU: the memory timeline itself and its summary, in
  ``<run_dir>/memory/`` (on CUDA the allocator's history is the snapshot:
  :class:`~ray_titan.metrics.memory.MemorySnapshots`).

Profiling costs: the profiled step runs slower (with Python stacks and tensor shapes for the
memory timeline), and exporting takes ~0.5-3 s for the debug model's step (the memory timeline's
analysis walks every operator); that export time is left out of the step's ``step_time_s``.
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import json
import os
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ray_titan import storage

if TYPE_CHECKING:
    from torch.profiler import profile

__all__ = ["BREAKDOWN_CATEGORIES", "StepProfiler", "timeline_breakdown"]

BREAKDOWN_CATEGORIES = (
    "parameters", "gradients", "optimizer_state", "activations", "temporaries", "inputs", "unknown",
)
"""The categories of a measured breakdown. ``activations``: tensors saved for backward;
``temporaries``: tensors that live within an operator, and the gradients of activations in
backward (the profiler's ``TEMPORARY`` and ``AUTOGRAD_DETAIL``); ``inputs``: the step's data;
``unknown``: what the profiler could not attribute (communication buffers, tensors created
before the profiled step and never used in it)."""

# torch.profiler._memory_profiler.Category name -> breakdown category.
_CATEGORY = {
    "PARAMETER": "parameters", "GRADIENT": "gradients", "OPTIMIZER_STATE": "optimizer_state",
    "ACTIVATION": "activations", "TEMPORARY": "temporaries", "AUTOGRAD_DETAIL": "temporaries",
    "INPUT": "inputs", None: "unknown",
}


def timeline_breakdown(sizes: list[list[int]]) -> dict[str, Any]:
    """The breakdown of a memory timeline's ``sizes`` (``export_memory_timeline``'s second list:
    one row per time point; row ``[0]`` unused, then bytes per ``torch.profiler`` memory category
    in the order of ``_memory_profiler._CATEGORY_TO_INDEX``, offset by one).

    Returns ``{"peak_bytes": the largest total, "at_peak": {category: bytes at that moment}
    (summing to it), "category_peaks": {category: its own largest}}``, categories as
    :data:`BREAKDOWN_CATEGORIES`.
    """
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

    columns = {i + 1: _CATEGORY[c.name if c is not None else None] for c, i in _CATEGORY_TO_INDEX.items()}
    if not sizes:
        zero = dict.fromkeys(BREAKDOWN_CATEGORIES, 0)
        return {"peak_bytes": 0, "at_peak": zero, "category_peaks": dict(zero)}
    totals = [sum(row) for row in sizes]
    at = max(range(len(sizes)), key=totals.__getitem__)
    at_peak = dict.fromkeys(BREAKDOWN_CATEGORIES, 0)
    peaks = dict.fromkeys(BREAKDOWN_CATEGORIES, 0)
    for col, name in columns.items():
        at_peak[name] += sizes[at][col]
    for name in BREAKDOWN_CATEGORIES:
        cols = [c for c, n in columns.items() if n == name]
        peaks[name] = max(sum(row[c] for c in cols) for row in sizes)
    return {"peak_bytes": totals[at], "at_peak": at_peak, "category_peaks": peaks}


class StepProfiler:
    """The torch profiler around the steps that ask for it, on one rank (module docstring).

    Args:
        run_dir: the run directory (a local path or a URI; None: nothing is written, the
            breakdown is still measured).
        rank, coords: this rank and its mesh coordinates (in file names and the breakdown).
        device: where the rank computes (CUDA activity is recorded on a CUDA device).
        trace_steps: steps to write a Chrome trace of.
        breakdown_step: the step whose memory breakdown to measure (0 or None: none).
        snapshot_steps: steps to write the CPU memory timeline of (``<run_dir>/memory/``).

    Use: :meth:`start` before a step, :meth:`stop` after it (returns the breakdown of that step,
    or None), :meth:`close` at the end. ``paths`` lists the files written.
    """

    def __init__(self, run_dir: str | Path | None, rank: int, coords: dict[str, int], device: torch.device,
                 trace_steps: Iterable[int] = (), breakdown_step: int | None = None,
                 snapshot_steps: Iterable[int] = ()):
        self.run_dir = run_dir
        self.rank, self.coords, self.device = rank, coords, device
        self.trace_steps = set(trace_steps) if run_dir is not None else set()
        self.snapshot_steps = set(snapshot_steps) if run_dir is not None else set()
        self.breakdown_step = breakdown_step or None
        self.paths: list[Path | str] = []
        self._prof: profile | None = None

    def _wanted(self, step: int) -> tuple[bool, bool]:
        """(trace, memory) for ``step``."""
        memory = step == self.breakdown_step or step in self.snapshot_steps
        return step in self.trace_steps, memory

    def start(self, step: int) -> None:
        trace, memory = self._wanted(step)
        if not (trace or memory):
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        # The memory timeline needs shapes and Python stacks (it finds parameters and optimizer
        # state through the modules and optimizers on the stack).
        self._prof = profile(activities=activities, profile_memory=memory, record_shapes=memory,
                             with_stack=memory)
        self._prof.start()

    def stop(self, step: int) -> dict[str, Any] | None:
        """End the profile of ``step`` and write what it was for; returns its memory breakdown
        (``{"step", "rank", "coords", "device", "peak_bytes", "at_peak", "category_peaks"}``) when
        ``step`` is the breakdown step, else None."""
        prof, self._prof = self._prof, None
        if prof is None:
            return None
        prof.stop()
        try:
            return self._export(prof, step)
        finally:
            # The profile's events and the memory timeline's graph are reference cycles (~60 MiB
            # for the debug model's step): freed now, not at the next synchronized GC, where
            # their release would look like a drop in the rank's memory. Every rank profiles
            # the same steps, so this collection is synchronized too.
            del prof
            gc.collect()

    def _export(self, prof: profile, step: int) -> dict[str, Any] | None:
        trace, memory = self._wanted(step)
        if trace:
            self.paths.append(self._write_trace(prof, step))
        if not memory:
            return None
        device = str(self.device) if self.device.type != "cuda" else f"cuda:{self.device.index or 0}"
        with tempfile.TemporaryDirectory() as tmp:
            timeline = Path(tmp) / "timeline.json"
            with warnings.catch_warnings():  # deprecated for CUDA in favour of the allocator history
                warnings.simplefilter("ignore", FutureWarning)
                prof.export_memory_timeline(str(timeline), device=device)
            _, sizes = json.loads(timeline.read_text())
            breakdown = {"step": step, "rank": self.rank, "coords": self.coords, "device": device,
                         **timeline_breakdown(sizes)}
            if step in self.snapshot_steps:
                self.paths += self._write_snapshot(timeline, breakdown, step)
        return breakdown if step == self.breakdown_step else None

    def _file(self, folder: str, name: str) -> Path | str:
        assert self.run_dir is not None
        local = storage.local_path(self.run_dir)
        if local is None:
            return storage.join(self.run_dir, folder, name)
        (local / folder).mkdir(parents=True, exist_ok=True)
        return local / folder / name

    def _write_trace(self, prof: profile, step: int) -> Path | str:
        dest = self._file("profile", f"rank{self.rank}-step{step}.json")
        if isinstance(dest, Path):
            prof.export_chrome_trace(str(dest))
        else:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "trace.json")
                prof.export_chrome_trace(path)
                storage.write_text(dest, Path(path).read_text())
        return dest

    def _write_snapshot(self, timeline: Path, breakdown: dict[str, Any], step: int) -> list[Path | str]:
        """The CPU memory snapshot of ``step``: the timeline (gzipped) and a summary."""
        out = self._file("memory", f"rank{self.rank}-step{step}.json.gz")
        summary = self._file("memory", f"rank{self.rank}-step{step}-summary.json")
        text = json.dumps({"step": step, "rank": self.rank, "coords": self.coords,
                           "peak_bytes_by_category": {**breakdown["category_peaks"], "total": breakdown["peak_bytes"]},
                           "at_peak": breakdown["at_peak"]}, indent=1)
        if isinstance(out, Path):
            with gzip.open(out, "wt") as f:
                f.write(timeline.read_text())
            Path(summary).write_text(text)
        else:  # remote: the timeline uncompressed (storage writes text)
            out = str(out)[: -len(".gz")]
            storage.write_text(out, timeline.read_text())
            storage.write_text(summary, text)
        return [out, summary]

    def close(self) -> None:
        """Stop a profile left running by a failed step."""
        if self._prof is not None:
            with contextlib.suppress(Exception):
                self._prof.stop()
            self._prof = None
