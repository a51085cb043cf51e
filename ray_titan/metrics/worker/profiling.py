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
  :class:`~ray_titan.metrics.worker.memory.MemorySnapshots`).

Profiling costs: the profiled step runs slower (with Python stacks and tensor shapes for the
memory timeline), and exporting takes ~0.5-3 s for the debug model's step (the memory timeline's
analysis walks every operator); that export time is left out of the step's ``step_time_s``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import gzip
import json
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ray_titan import storage
from ray_titan.metrics.worker.memory import BREAKDOWN_CATEGORIES, live_storages, timeline_breakdown

if TYPE_CHECKING:
    from torch.profiler import profile

__all__ = ["BREAKDOWN_CATEGORIES", "StepProfiler", "allocation_peak", "timeline_breakdown"]

# What torch's profiler prints on a profile that works, run on a Ray Train worker (torch 2.13):
# kineto's complaint that it is first used outside the thread that imported torch (Ray Train runs
# the loop in a thread of its own; what kineto then skips is a client init torch leaves empty) and
# its ``profiler_start`` / ``profiler_stop`` trace markers, printed at kineto's ERROR level and
# above it (so no KINETO_LOG_LEVEL hides them without hiding its real errors). Each exactly.
_KINETO_NOISE = re.compile(
    rb"(ERROR: External init callback must run in same thread as registerClient \(-?\d+ != -?\d+\)"
    rb"|USDT:[^\n]* SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop))\r?\n?")


@contextlib.contextmanager
def _without_kineto_noise() -> Iterator[None]:
    """Run a profiler start or stop with the process's stderr (fd 2, where kineto's C++ writes)
    into a temporary file, then write back every line of it but :data:`_KINETO_NOISE`'s: nothing
    else is lost, only delayed by the call (milliseconds; not the step, where a crash's output
    must not wait)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                tmp.seek(0)
                if rest := _KINETO_NOISE.sub(b"", tmp.read()):
                    os.write(2, rest)
    finally:
        os.close(saved)


def _c10_log_level() -> ctypes.c_int | None:
    """torch's C++ log threshold (``FLAGS_caffe2_log_level``, what ``TORCH_CPP_LOG_LEVEL`` sets at
    start: 0 info, 1 warning, 2 error), None where this torch does not export it."""
    try:
        return ctypes.c_int.in_dll(ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")),
                                   "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None


_C10_ERROR = 2

def allocation_peak(prof: profile, census: dict[int, dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """The peak bytes of ``device`` during a profile, from its allocation events alone (no
    categories): what was alive before it (``census``, :func:`~ray_titan.metrics.worker.memory.live_storages`
    at its start) plus the running sum of the allocations and frees within it. The profiler does
    not report the free of a block allocated while no profiler ran (it never learnt its size):
    of those, the parameters' gradients (which the step's ``zero_grad`` frees first) are taken out
    at the start; any other such block freed during the step still counts, so the result is an
    upper bound, close where the step frees little of what it found.

    Returns ``{"peak_bytes", "at_peak": {"unknown": peak}, "category_peaks": {}}``."""
    from torch._C._profiler import _EventType, _ExtraFields_Allocation

    events = []
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    stack = list(results.experimental_event_tree()) if results is not None else []
    while stack:
        e = stack.pop()
        fields = e.extra_fields
        if e.tag == _EventType.Allocation and isinstance(fields, _ExtraFields_Allocation) \
                and fields.device.type == device.type:
            events.append((e.start_time_ns, fields.alloc_size, fields.ptr))
        stack.extend(e.children)
    events.sort()
    freed = {ptr for _, size, ptr in events if size < 0}
    mine = {k: v for k, v in census.items() if v["device"].split(":")[0] == device.type}
    current = most = sum(v["bytes"] for v in mine.values())
    current -= sum(v["bytes"] for k, v in mine.items() if v["grad"] and k not in freed)
    for _, size, _ in events:
        current += size
        most = max(most, current)
    peak = most
    return {"peak_bytes": peak, "at_peak": {"unknown": peak}, "category_peaks": {}}


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
        self._census: dict[int, dict[str, Any]] = {}
        self._c10_level: tuple[ctypes.c_int, int] | None = None

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
        # What is alive before the step, by storage, for the peak when the timeline's analysis
        # fails (allocation_peak); collected first so that no dead cycle's tensor counts (every
        # rank profiles the same step: a synchronized collection).
        if memory:
            gc.collect()
        self._census = live_storages() if memory else {}
        self._prof = profile(activities=activities, profile_memory=memory, record_shapes=memory,
                             with_stack=memory)
        with _without_kineto_noise():
            self._prof.start()
        # A memory profile makes torch's CPU allocator warn (c10 LOG(WARNING), once per 1000) on
        # the free of a block allocated before it began: every such step has some (last step's
        # gradients, the optimizer's state); allocation_peak accounts for them. Only C++ warnings
        # are held back, only in this process, only until stop(): errors still print, and so do
        # Python warnings (torch hands an op's warnings to Python's warnings module).
        if memory and (level := _c10_log_level()) is not None and level.value < _C10_ERROR:
            self._c10_level = (level, level.value)
            level.value = _C10_ERROR

    def stop(self, step: int) -> dict[str, Any] | None:
        """End the profile of ``step`` and write what it was for; returns its memory breakdown
        (``{"step", "rank", "coords", "device", "peak_bytes", "at_peak", "category_peaks"}``) when
        ``step`` is the breakdown step, else None."""
        prof, self._prof = self._prof, None
        if prof is None:
            return None
        try:
            with _without_kineto_noise():
                prof.stop()
        finally:
            self._restore_c10_level()
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
        head = {"step": step, "rank": self.rank, "coords": self.coords, "device": device}
        with tempfile.TemporaryDirectory() as tmp:
            timeline = Path(tmp) / "timeline.json"
            try:
                with warnings.catch_warnings():  # deprecated for CUDA in favour of the allocator history
                    warnings.simplefilter("ignore", FutureWarning)
                    prof.export_memory_timeline(str(timeline), device=device)
                _, sizes = json.loads(timeline.read_text())
                breakdown = {**head, **timeline_breakdown(sizes)}
            except Exception as e:
                # torch's data-flow analysis of the timeline asserts on some graphs (the MoE
                # experts' SplitWithSizes/Select backward under pipeline parallel; DTensor ops
                # under tensor parallel; torch 2.13), and the deprecated export or the private
                # names of its columns may be gone from a later torch (AttributeError,
                # ValueError): keep the peak, from the allocations themselves, without the
                # categories.
                fallback = {**head, **allocation_peak(prof, self._census, self.device),
                            "error": f"{type(e).__name__}: {str(e)[:200]}"}
                if step in self.snapshot_steps:
                    self.paths.append(self._write_summary(step, fallback, prof))
                return fallback if step == self.breakdown_step else None
            if step in self.snapshot_steps:
                self.paths += self._write_snapshot(timeline, breakdown, step, prof)
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

    def _write_snapshot(self, timeline: Path, breakdown: dict[str, Any], step: int,
                        prof: profile) -> list[Path | str]:
        """The CPU memory snapshot of ``step``: the timeline (gzipped) and a summary."""
        out = self._file("memory", f"rank{self.rank}-step{step}.json.gz")
        if isinstance(out, Path):
            with gzip.open(out, "wt") as f:
                f.write(timeline.read_text())
        else:  # remote: the timeline uncompressed (storage writes text)
            out = str(out)[: -len(".gz")]
            storage.write_text(out, timeline.read_text())
        return [out, self._write_summary(step, breakdown, prof)]

    def _write_summary(self, step: int, breakdown: dict[str, Any], prof: profile) -> Path | str:
        """``rank{r}-step{s}-summary.json``: the step's peak bytes, its peak over what was alive when
        it began (``peak_above_step_start_bytes``: activations, gradients and temporaries, not the
        parameters or optimizer state), and, when the timeline could be analysed, its categories
        (else ``peak_bytes_by_category`` is null and ``error`` says why)."""
        summary = self._file("memory", f"rank{self.rank}-step{step}-summary.json")
        by_category = ({**breakdown["category_peaks"], "total": breakdown["peak_bytes"]}
                       if "error" not in breakdown else None)
        text = json.dumps({"step": step, "rank": self.rank, "coords": self.coords,
                           "peak_bytes": breakdown["peak_bytes"],
                           "peak_above_step_start_bytes": allocation_peak(prof, {}, self.device)["peak_bytes"],
                           "peak_bytes_by_category": by_category,
                           "at_peak": breakdown["at_peak"], "error": breakdown.get("error")}, indent=1)
        if isinstance(summary, Path):
            summary.write_text(text)
        else:
            storage.write_text(summary, text)
        return summary

    def close(self) -> None:
        """Stop a profile left running by a failed step."""
        if self._prof is not None:
            with contextlib.suppress(Exception):
                self._prof.stop()
            self._prof = None
        self._restore_c10_level()

    def _restore_c10_level(self) -> None:
        """torch's C++ log threshold as it was before :meth:`start` raised it."""
        if self._c10_level is not None:
            level, value = self._c10_level
            level.value, self._c10_level = value, None
