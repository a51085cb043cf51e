"""Per-rank memory sampling, cheap enough to run every step, and memory snapshots.

Every field of the sample, its unit and how it is read, is in the one table of per-rank
fields, :data:`ray_titan.metrics.fields.FIELDS` (those of :data:`~ray_titan.metrics.fields.MEMORY_FIELDS`).

Device fields are ``None`` on CPU-only workers. The train loop samples with
:class:`MemorySampler`: RSS and the device counters every step, the ``host_heap_*`` and
``host_available_bytes`` fields every step too unless ``metrics.heap_stats_interval_s`` spaces
them (glibc's ``mallinfo2`` walks every arena's free lists: 0.55 ms in a main-job Ray worker). The cost of
each read is printed by ``benchmarks/memory_sampling.py``; a run's own cost of sampling and
reporting is in its ``metrics_time_s`` column.

:class:`MemorySnapshots` writes snapshots to ``<run_dir>/memory/``: on CUDA the allocator's
history (``torch.cuda.memory._record_memory_history``, pickled with ``_dump_snapshot``, viewable
at https://pytorch.org/memory_viz); on CPU the torch profiler's memory timeline of the step
(written by :class:`ray_titan.metrics.worker.profiling.StepProfiler`). An out-of-memory error on a
rank leaves a snapshot and becomes :class:`RankOutOfMemoryError`, also one that a pipeline
schedule re-raised wrapped in its own ``RuntimeError`` (:func:`find_oom`).
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import resource
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ray_titan.allocator import host_heap
from ray_titan.config.units import MiB
from ray_titan.metrics.fields import MEMORY_FIELDS, describe_coords

__all__ = [
    "BREAKDOWN_CATEGORIES",
    "MemorySampler",
    "MemorySnapshots",
    "RankOutOfMemoryError",
    "find_oom",
    "host_available",
    "host_heap",
    "host_memory",
    "live_storages",
    "live_tensors",
    "oom_site",
    "sample_memory",
    "timeline_breakdown",
]


_PAGE = os.sysconf("SC_PAGE_SIZE")


def host_memory() -> tuple[int, int]:
    """``(rss, peak_rss)`` of this process in bytes: resident pages of ``/proc/self/statm``
    (``VmRSS``, cheaper to read than ``/proc/self/status``) and ``ru_maxrss`` of ``getrusage``
    (``VmHWM``, KiB on Linux)."""
    with open("/proc/self/statm", "rb") as f:
        rss = _statm_rss(f.read())
    return rss, _peak_rss(rss)


def _statm_rss(statm: bytes) -> int:
    """Bytes resident, from the text of ``/proc/<pid>/statm`` (its second field, in pages)."""
    return int(statm.split()[1]) * _PAGE


def _peak_rss(rss: int) -> int:
    # The kernel's RSS counters are per-CPU and summed approximately: ru_maxrss can trail a
    # statm read taken a moment earlier by a few pages.
    return max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


_CGROUP: list[tuple[Path, Path]] | None = None


def _cgroup_files() -> list[tuple[Path, Path]]:
    """(limit, usage) files of this process's memory cgroup, v2 or v1; found once."""
    global _CGROUP
    if _CGROUP is None:
        found = []
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            lines = []
        root = Path("/sys/fs/cgroup")
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2
                cands = [(root / path.lstrip("/") / "memory.max", root / path.lstrip("/") / "memory.current")]
            elif "memory" in controllers.split(","):  # v1; a container often mounts its own at the root
                base = root / "memory"
                cg = base / path.lstrip("/")
                cands = [(cg / "memory.limit_in_bytes", cg / "memory.usage_in_bytes"),
                         (base / "memory.limit_in_bytes", base / "memory.usage_in_bytes")]
            else:
                continue
            found += [c for c in cands[:1] if c[0].exists()] or [c for c in cands[1:] if c[0].exists()]
        _CGROUP = found
    return _CGROUP


def host_available() -> int:
    """Bytes this process could still allocate on the host: ``MemAvailable`` of
    ``/proc/meminfo``, lowered to the room left in its memory cgroup where that is tighter."""
    avail = 0
    with open("/proc/meminfo", "rb") as f:
        for line in f:
            if line.startswith(b"MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    for limit_file, usage_file in _cgroup_files():
        try:
            limit = limit_file.read_text().strip()
            if limit != "max" and int(limit) < (1 << 62):
                avail = min(avail, int(limit) - int(usage_file.read_text()))
        except (OSError, ValueError):
            pass
    return avail


def sample_memory(device: torch.device) -> dict[str, int | None]:
    """One sample of every field of :data:`MEMORY_FIELDS`, all read now; resets the device peak
    statistics. Per step, :class:`MemorySampler` bounds the cost of the slow fields."""
    sampler = MemorySampler(device, 0.0)
    try:
        return sampler.sample()
    finally:
        sampler.close()


class MemorySampler:
    """Samples every field of :data:`MEMORY_FIELDS`, once per step, at a bounded cost.

    Every :meth:`sample`: host RSS (``/proc/self/statm``, kept open and re-read with ``pread``,
    ~2 µs), peak RSS (``getrusage``), the device counters (resetting the device peaks) and, under
    jemalloc, malloc's statistics (``mallctl``, ~20 µs). At most every ``slow_interval_s``
    seconds (the first sample always; 0, the default: every sample): glibc's malloc statistics
    (``host_heap_in_use_bytes``, ``host_heap_free_bytes``) and ``host_available_bytes``; samples
    in between carry the last values. glibc's ``mallinfo2`` walks every arena's free lists under
    the arena's lock: 0.55 ms per call in a main-job Ray worker (its threads each get an arena),
    ``/proc/meminfo`` 0.1 ms. Spacing them saves that, at the price of a host leak series that
    pairs a fresh RSS with older free bytes (``metrics.heap_stats_interval_s``).
    """

    def __init__(self, device: torch.device, slow_interval_s: float = 0.0):
        from ray_titan.allocator import active_allocator, jemalloc_muzzy_decay_ms

        self.device, self.slow_interval_s = device, slow_interval_s
        self._slow: dict[str, int | None] = {}
        self._slow_at = -math.inf
        self._fd, self._pid = -1, -1
        # jemalloc's statistics cost ~20 µs: read with RSS every step, so the host series
        # (RSS less malloc's free bytes) never pairs RSS after a purge with free bytes before it.
        # (Not where pages go back lazily: then the free bytes need /proc/self/smaps_rollup.)
        self._heap_every_step = active_allocator() == "jemalloc" and not jemalloc_muzzy_decay_ms()

    def _rss(self) -> int:
        if self._pid != os.getpid():  # opened by a parent before a fork: /proc/self was its
            self.close()
            self._fd, self._pid = os.open("/proc/self/statm", os.O_RDONLY), os.getpid()
        return _statm_rss(os.pread(self._fd, 256, 0))

    def sample(self) -> dict[str, int | None]:
        """``{field: bytes or count or None}`` for every field of :data:`MEMORY_FIELDS`."""
        out: dict[str, int | None] = dict.fromkeys(MEMORY_FIELDS)
        out["host_rss_bytes"] = rss = self._rss()
        out["host_peak_rss_bytes"] = _peak_rss(rss)
        now = time.monotonic()
        if now - self._slow_at >= self.slow_interval_s:
            in_use, free = host_heap()
            self._slow = {"host_heap_in_use_bytes": in_use, "host_heap_free_bytes": free,
                          "host_available_bytes": host_available()}
            self._slow_at = now
        out.update(self._slow)
        if self._heap_every_step and now != self._slow_at:
            out["host_heap_in_use_bytes"], out["host_heap_free_bytes"] = host_heap()
        if self.device.type != "cpu":
            out.update(_device_memory(self.device))
        return out

    def close(self) -> None:
        """Close the held ``/proc/self/statm``; the next :meth:`sample` opens it again."""
        if self._fd >= 0 and self._pid == os.getpid():
            os.close(self._fd)
        self._fd, self._pid = -1, -1


def _device_memory(device: torch.device) -> dict[str, int]:
    """The ``device_*`` fields; resets the device peak statistics."""
    acc = _accelerator()
    s = acc.memory_stats(device)
    out = dict(
        device_allocated_bytes=s.get("allocated_bytes.all.current", 0),
        device_active_bytes=s.get("active_bytes.all.current", 0),
        device_reserved_bytes=s.get("reserved_bytes.all.current", 0),
        device_peak_active_bytes=s.get("active_bytes.all.peak", 0),
        device_peak_reserved_bytes=s.get("reserved_bytes.all.peak", 0),
        device_alloc_retries=s.get("num_alloc_retries", 0),
        device_ooms=s.get("num_ooms", 0),
        device_capacity_bytes=_capacity(device),
    )
    acc.reset_peak_memory_stats(device)
    return out


def _accelerator():
    """``torch.accelerator`` where it has the memory API (torch >= 2.9: CUDA, XPU, ...), else
    ``torch.cuda``; both return the caching allocator's ``memory_stats`` keys used above."""
    acc = getattr(torch, "accelerator", None)
    return acc if acc is not None and hasattr(acc, "memory_stats") else torch.cuda


_CAPACITY: dict[str, int] = {}


def _capacity(device: torch.device) -> int:
    key = str(device)
    if key not in _CAPACITY:
        acc = getattr(torch, "accelerator", None)
        if acc is not None and hasattr(acc, "get_memory_info"):
            _CAPACITY[key] = acc.get_memory_info(device)[1]
        else:
            _CAPACITY[key] = torch.cuda.get_device_properties(device).total_memory
    return _CAPACITY[key]


class RankOutOfMemoryError(RuntimeError):
    """A rank ran out of memory. The message names the rank, its mesh coordinates, the step,
    its peak memory and where the snapshot was written."""


def find_oom(error: BaseException) -> BaseException | None:
    """The out-of-memory error behind ``error``: ``error`` itself when it is a
    ``torch.OutOfMemoryError`` or ``MemoryError``, else the first one found through its
    ``__cause__`` / ``__context__`` chains (and the members of an exception group); None when
    there is none.

    Needed because ``torch.distributed.pipelining`` re-raises any exception of a stage's forward
    as ``RuntimeError("[Stage s] failed to run forward ...") from e`` (``stage.py``) and of its
    backward as ``RuntimeError("Failed to run stage backward ...") from e`` (``_backward.py``).
    """
    return next((e for e in _chain(error) if isinstance(e, (torch.OutOfMemoryError, MemoryError))), None)


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and every exception behind it (``__cause__``, ``__context__``, an exception
    group's members), breadth first, each once (chains can loop)."""
    todo: list[BaseException | None] = [error]
    seen: set[int] = set()
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        if isinstance(e, BaseExceptionGroup):
            todo += list(e.exceptions)


_STAGE_FORWARD = re.compile(r"\[Stage (\d+)\] failed to run forward")
_STAGE_BACKWARD = re.compile(r"Failed to run stage backward")


def oom_site(error: BaseException, stages: Iterable[int] = ()) -> str | None:
    """Where in the pipeline schedule the out-of-memory error behind ``error`` was raised, as
    the pipelining wrappers of its chain tell (see :func:`find_oom`): ``"in the forward of
    pipeline stage 1"``, ``"in the backward of pipeline stage 1"`` (the backward wrapper names no
    stage: ``stages``, this rank's stage indices, name it when the rank holds one, else all are
    listed), or None outside a schedule's forward and backward."""
    stages = sorted(stages)
    for e in _chain(error):
        if isinstance(e, RuntimeError):
            if m := _STAGE_FORWARD.search(str(e)):
                return f"in the forward of pipeline stage {m.group(1)}"
            if _STAGE_BACKWARD.search(str(e)):
                if len(stages) == 1:
                    return f"in the backward of pipeline stage {stages[0]}"
                which = f" of one of pipeline stages {', '.join(map(str, stages))}" if stages else ""
                return f"in the backward{which}"
    return None


def live_storages() -> dict[int, dict[str, Any]]:
    """Every tensor storage alive in this process (found through the garbage collector), by its
    data pointer: ``{"shape", "dtype", "device", "bytes", "grad"}`` of a tensor viewing it
    (``grad``: it is a parameter's ``.grad``). Storages shared by several tensors appear once;
    meta tensors and tensor subclasses without a storage are left out."""
    import warnings

    seen: dict[int, dict[str, Any]] = {}
    grads: set[int] = set()
    with warnings.catch_warnings():  # isinstance() on deprecated module proxies warns
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        tensors = [o for o in objects if isinstance(o, torch.Tensor)]
        del objects
    for obj in tensors:
        try:
            if obj.device.type == "meta":
                continue
            if isinstance(obj, torch.nn.Parameter) and obj.grad is not None:
                grads.add(obj.grad.untyped_storage().data_ptr())
            storage = obj.untyped_storage()
            key = storage.data_ptr() or id(storage)
            if key not in seen:
                seen[key] = {"shape": list(obj.shape), "dtype": str(obj.dtype),
                             "device": str(obj.device), "bytes": storage.nbytes()}
        except Exception:  # tensor subclasses without storage (DTensor wrappers, fakes)
            continue
    return {k: {**v, "grad": k in grads} for k, v in seen.items()}


def live_tensors(limit: int = 50) -> dict[str, Any]:
    """The tensors alive in this process (:func:`live_storages`), largest storage first:
    ``{"count", "bytes", "tensors": [{"shape", "dtype", "device", "bytes"}, ...]}``."""
    items = sorted(live_storages().values(), key=lambda t: -t["bytes"])
    return {"count": len(items), "bytes": sum(t["bytes"] for t in items), "tensors": items[:limit]}


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


def _timeline_columns() -> dict[int, str] | None:
    """``{column of a memory timeline's row: breakdown category}``, from the order torch writes
    them in (the private ``torch.profiler._memory_profiler._CATEGORY_TO_INDEX``, the only place
    that names them); None where this torch has no such mapping or names a category unknown here."""
    try:
        from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX
    except ImportError:
        return None
    try:
        return {i + 1: _CATEGORY[c.name if c is not None else None] for c, i in _CATEGORY_TO_INDEX.items()}
    except (AttributeError, KeyError):
        return None


def timeline_breakdown(sizes: list[list[int]]) -> dict[str, Any]:
    """The breakdown of a memory timeline's ``sizes`` (``export_memory_timeline``'s second list:
    one row per time point; row ``[0]`` unused, then bytes per ``torch.profiler`` memory category
    in the order of ``_memory_profiler._CATEGORY_TO_INDEX``, offset by one).

    Returns ``{"peak_bytes": the largest total, "at_peak": {category: bytes at that moment}
    (summing to it), "category_peaks": {category: its own largest}}``, categories as
    :data:`BREAKDOWN_CATEGORIES`. Raises ``ValueError`` where this torch's columns cannot be
    named (the private mapping gone or changed, or rows wider than it): callers fall back to
    the allocations' peak without categories (``ray_titan.metrics.worker.profiling``).
    """
    columns = _timeline_columns()
    if columns is None or any(len(row) > len(columns) + 1 for row in sizes):
        raise ValueError("this torch's memory timeline has columns ray_titan cannot name "
                         "(torch.profiler._memory_profiler._CATEGORY_TO_INDEX is gone or changed)")
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


class MemorySnapshots:
    """Memory snapshots of one rank, on request (``steps``, on CUDA; on CPU the profiler's
    memory timeline is the snapshot: :class:`ray_titan.metrics.worker.profiling.StepProfiler`) and on
    out-of-memory.

    Args:
        run_dir: the run directory; files go to ``<run_dir>/memory/`` (no snapshots if None).
        rank, coords: this rank and its mesh coordinates (named in file names and errors).
        device: where the rank computes.
        steps: steps after which to write a snapshot.
        on_oom: on CUDA, record from the start where each live allocation was made, so that an
            OOM can be dumped (``torch.cuda.memory._record_memory_history("state")``).
        max_entries: allocation events the CUDA history of a requested step keeps.

    What is recorded on CUDA, and what it costs on the host (docs/memory.md): from the start,
    with ``on_oom``, only the Python stack of each live allocation (``enabled="state"``,
    ``stacks="python"``): bounded by the live blocks, it flattens with device memory, so the leak
    verdict does not read it as growth. The event history (``enabled="all"``, a ring of
    ``max_entries`` events with their Python stacks) only during the ``steps`` asked for, from
    the step's start to its snapshot, then dropped.

    Use: :meth:`start` once, :meth:`before_step` / :meth:`after_step` around every step,
    :meth:`oom` when a step raised an out-of-memory error, :meth:`close` at the end.
    ``paths`` lists what was written.
    """

    def __init__(self, run_dir: str | Path | None, rank: int, coords: dict[str, int], device: torch.device,
                 steps: Iterable[int] = (), on_oom: bool = True, max_entries: int = 100_000):
        self.dir = Path(run_dir) / "memory" if run_dir is not None else None
        self.rank, self.coords, self.device = rank, coords, device
        self.steps = set(steps) if self.dir is not None else set()
        self.cuda = device.type == "cuda"
        self.on_oom = self.cuda and self.dir is not None and on_oom
        self.max_entries = max_entries
        self._history = False  # the event ring is on (a requested step is running)
        self.paths: list[Path] = []

    def _path(self, what: str) -> Path:
        assert self.dir is not None
        self.dir.mkdir(parents=True, exist_ok=True)
        return self.dir / f"rank{self.rank}-{what}"

    def _record(self, mode: str | None) -> None:
        """Switch the CUDA recorder: ``"state"`` (live allocations' stacks), ``"all"`` (and the
        event ring) or None (off; drops what was recorded)."""
        record = torch.cuda.memory._record_memory_history
        if mode == "all":
            record("all", context="all", stacks="python", max_entries=self.max_entries)
        elif mode == "state":  # torch keeps a ring of one event in this mode
            record("state", context="state", stacks="python")
        else:
            record(None)

    def start(self) -> None:
        """Start recording the live allocations' stacks on CUDA when OOM snapshots are wanted."""
        if self.on_oom:
            self._record("state")

    def before_step(self, step: int) -> None:
        """Start the CUDA event history for a requested step (CPU steps are the profiler's)."""
        if self.cuda and step in self.steps:
            self._record("all")
            self._history = True

    def after_step(self, step: int) -> list[Path]:
        """Write the CUDA snapshot of ``step`` if one was requested, then drop its history;
        returns the files written."""
        if step not in self.steps or not self.cuda:
            return []
        written = [self._path(f"step{step}.pickle")]
        torch.cuda.memory._dump_snapshot(str(written[0]))
        self.paths += written
        if self._history:
            self._record(None)  # frees the ring: turning modes alone would keep its entries
            self._history = False
            if self.on_oom:
                self._record("state")
        return written

    def oom(self, step: int, error: BaseException, site: str | None = None) -> RankOutOfMemoryError:
        """Write the out-of-memory snapshot and return the error to raise (the caller raises it
        ``from error``). ``error``: the out-of-memory error itself (:func:`find_oom`); ``site``:
        the place in the step it was raised, named in the message (:func:`oom_site`)."""
        _, peak_rss = host_memory()
        parts = [f"peak host RSS {peak_rss / MiB:.0f} MiB"]
        path = None
        try:
            if self.cuda:
                s = _accelerator().memory_stats(self.device)
                cap = _capacity(self.device)
                parts.insert(0, f"peak device allocated {s.get('allocated_bytes.all.peak', 0) / MiB:.0f} MiB, "
                                f"reserved {s.get('reserved_bytes.all.peak', 0) / MiB:.0f} MiB of "
                                f"{cap / MiB:.0f} MiB")
                if self.on_oom or self._history:
                    path = self._path(f"oom-step{step}.pickle")
                    torch.cuda.memory._dump_snapshot(str(path))
            elif self.dir is not None:
                path = self._path(f"oom-step{step}.json")
                path.write_text(json.dumps({"step": step, "rank": self.rank, "coords": self.coords,
                                            "peak_host_rss_bytes": peak_rss, "error": str(error)[:2000],
                                            "live_tensors": live_tensors()}, indent=1))
        except Exception as e:  # the OOM itself is the error to report
            print(f"ray_titan: could not write the OOM snapshot: {e}", file=sys.stderr, flush=True)
            path = None
        if path is not None:
            self.paths.append(path)
        where = f"; memory snapshot: {path}" if path else ""
        return RankOutOfMemoryError(
            f"{describe_coords(self.rank, self.coords)} ran out of memory at step {step}"
            f"{' ' + site if site else ''}: "
            f"{', '.join(parts)}{where} ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        )

    def close(self) -> None:
        if self.on_oom or self._history:
            self._record(None)
            self._history = False
