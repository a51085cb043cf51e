"""The stages of the first-contact GPU run (``benchmarks/gpu.py``), one per process:
``python -m benchmarks.gpu_stages STAGE --out DIR --device cuda|cpu [--small] --until T``.

Each stage appends its facts to ``DIR/facts.jsonl`` as it learns them (``benchmarks/facts.py``)
and works in ``DIR/work``. A part of a stage that fails is recorded as a fact (``... failed``,
with the error) and the stage goes on where the rest does not depend on it; a stage that raises
exits nonzero and the runner records that. ``--until``: the ``time.time()`` by which the stage
must end (the runner kills it then); the processes it starts get what is left. On ``--device
cpu`` the facts only a device has are recorded as :data:`NA`. Nothing here imports Ray.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.facts import FactLog, read_facts
from benchmarks.harness import REPO, flops_per_token, job_config, subprocess_flags
from ray_titan.callbacks import Callback, CallbackContext
from ray_titan.config.units import MiB

__all__ = ["NA", "HostSyncCounter", "StageContext", "count_host_syncs", "main"]

NA = "n/a on cpu"
DEPENDENCIES = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions",
                "tensorboardX", "crc32c", "google.protobuf", "pyarrow", "tokenizers", "numpy", "tqdm", "matplotlib",
                "safetensors", "ninja", "ray", "torchtitan")
"""Modules whose presence (and distribution version) the environment stage records."""
DEVICE_ONLY_CHECKS = ("device memory flat", "collector's device fields")
"""The checks (their names' beginnings) that judge device counters: "n/a on cpu" in the rehearsal."""
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
"""CUDA runtime calls that block the host until the device has caught up."""


@dataclass
class StageContext:
    """What a stage is given: ``out`` (the run's folder), ``work`` (its scratch folder), the
    ``device``, ``small`` (the rehearsal's shapes), ``until`` (``time.time()`` to end by) and its ``log``."""

    out: Path
    work: Path
    device: torch.device
    small: bool
    until: float
    log: FactLog

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def left(self, floor: float = 5.0) -> float:
        """Seconds left before ``until`` (at least ``floor``), a child process's timeout."""
        return max(floor, self.until - time.time())

    def attempt(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``; if it raises, the fact ``<what> failed`` (the error) and None."""
        try:
            return fn()
        except Exception as e:
            traceback.print_exc()  # the whole of it into the stage's stderr file
            self.log.add(f"{what} failed", f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:300]}")
            return None


# -- host synchronisations, counted by the profiler ------------------------------------------------
def count_host_syncs(names: Iterable[str], steps: int) -> dict[str, float]:
    """Per step over ``steps`` profiled steps, from the profiler's event ``names``: the host's
    reads of device values (``aten::_local_scalar_dense``: ``.item()``, ``.tolist()``, ``if t:``;
    the dry run counts these), the blocking runtime calls (:data:`SYNC_CALLS`) and the
    device-to-host copies (``Memcpy DtoH`` activity). Keys: ``host_reads``, ``sync_calls``,
    ``dtoh_copies``, and each of :data:`SYNC_CALLS` seen."""
    c: Counter[str] = Counter()
    for name in names:
        if name == "aten::_local_scalar_dense":
            c["host_reads"] += 1
        elif name in SYNC_CALLS:
            c["sync_calls"] += 1
            c[name] += 1
        elif name.startswith("Memcpy DtoH"):
            c["dtoh_copies"] += 1
    return {k: c[k] / steps for k in ("host_reads", "sync_calls", "dtoh_copies", *sorted(set(c) & set(SYNC_CALLS)))}


class HostSyncCounter(Callback):
    """Worker-side callback: the profiler (CPU, and CUDA on a CUDA ``device``) from the start of
    step ``first`` to the end of step ``last``; then ``counts`` is :func:`count_host_syncs`'s."""

    def __init__(self, first: int, last: int, device: torch.device):
        self.first, self.last, self.device = first, last, device
        self.counts: dict[str, float] | None = None
        self._prof: Any = None

    def on_step_begin(self, ctx: CallbackContext, step: int) -> None:
        if step == self.first:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=acts)
            self._prof.__enter__()

    def on_step_end(self, ctx: CallbackContext, step: int, report: Any) -> None:
        if step == self.last and self._prof is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._prof.__exit__(None, None, None)
            self.counts = count_host_syncs((e.name for e in self._prof.events()), self.last - self.first + 1)
            self._prof = None


# -- shared pieces ---------------------------------------------------------------------------------
def _one_rank(ctx: StageContext, name: str, steps: int, *flags: str):
    """The main job's config on one rank (``flags`` last), no checkpoints, no TensorBoard."""
    return job_config(ctx.work, name, steps, "--parallelism.pp=1", "--parallelism.dp_shard=1",
                      "--parallelism.microbatches=1", "--checkpoint.enable=false",
                      "--metrics.enable_tensorboard=false", f"--metrics.log_freq={steps}", *flags)


def _plan_peak(ctx: StageContext, cfg) -> int | None:
    """The memory plan's peak for rank 0 of ``cfg`` on CUDA (bytes), recorded; None if it fails."""
    peak = ctx.attempt("memory plan", lambda: memory_plan_peak(cfg))
    if peak is None:
        return None
    ctx.log.add("memory plan peak, rank 0", round(peak / MiB, 1), "MiB", note="the memory plan, device cuda")
    return peak


def _train(ctx: StageContext, cfg, callbacks: list | None = None) -> dict[str, Any]:
    """``cfg`` on one rank in this process (``gpu_checks.train_here``); adds the run's device
    peaks ``peak_active`` and ``peak_reserved`` (bytes; None on CPU), from :func:`run_peaks`."""
    from benchmarks.gpu_checks import train_here

    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    run = train_here(cfg, ctx.device, callbacks=callbacks)
    stats = torch.cuda.memory_stats(ctx.device) if ctx.cuda else None
    tail = (stats.get("active_bytes.all.peak", 0), stats.get("reserved_bytes.all.peak", 0)) if stats else None
    run["peak_active"], run["peak_reserved"] = run_peaks(run["steps"], tail)
    return run


def run_peaks(steps, tail: tuple[int, int] | None) -> tuple[int | None, int | None]:
    """A run's device peaks ``(active, reserved)`` in bytes: the largest of its metrics
    table's per-step ``device_peak_active_bytes`` / ``device_peak_reserved_bytes`` and ``tail``,
    the device's peak counters read after the run (``active_bytes.all.peak``,
    ``reserved_bytes.all.peak``);
    ``(None, None)`` when ``tail`` is None (CPU). The counters alone are not the run's peak: the
    memory sampler resets them at every sample, so after a run they hold only what followed the
    last one (the H100 levers table of 2026-11-27 read that tail as the peak). The per-step
    figure is the active bytes, which also count blocks freed on the compute stream that another
    stream still uses (``record_stream``), so it is at least the allocated bytes."""
    if tail is None:
        return None, None

    def most(column: str, last: int) -> int:
        seen = [v for v in steps[column].to_pylist() if v is not None] if column in steps.column_names else []
        return max([last, *seen])

    return most("device_peak_active_bytes", tail[0]), most("device_peak_reserved_bytes", tail[1])


def _tokens_per_s(cfg, table, timed: range) -> float:
    """Global batch × seq_len over the median ``step_time_s`` of the ``timed`` steps of a run's
    metrics ``table`` (tokens/s)."""
    times = [s for st, s in zip(table["step"].to_pylist(), table["step_time_s"].to_pylist()) if st in timed and s]
    return cfg.training.global_batch_size * cfg.training.seq_len / statistics.median(times)


def _report_run(ctx: StageContext, cfg, run: dict[str, Any], timed: range, plan: int | None) -> float:
    """Facts of a finished one-rank run: steps, last loss and its finiteness, tokens/s over the
    ``timed`` steps (global batch × seq_len over their median ``step_time_s``), the device peaks
    beside the ``plan``. Returns the tokens/s."""
    t = run["steps"]
    losses = [x for x in t["step_loss"].to_pylist() if x is not None]
    ctx.log.add("steps run", t.num_rows)
    ctx.log.add("last loss", losses[-1] if losses else None)
    ctx.log.add("loss finite", bool(losses) and all(math.isfinite(x) for x in losses), note=f"{len(losses)} steps")
    tps = _tokens_per_s(cfg, t, timed)
    ctx.log.add("tokens/s", round(tps, 1), "tok/s",
                note=f"median step time of steps {timed.start}-{timed.stop - 1}, "
                     f"{cfg.training.global_batch_size} × {cfg.training.seq_len} tokens per step")
    if not ctx.cuda:
        ctx.log.add("device peak active", NA)
        return tps
    for what in ("active", "reserved"):
        peak = run[f"peak_{what}"]
        ctx.log.add(f"device peak {what}", round(peak / MiB, 1), "MiB",
                    note=f"plan {plan / MiB:.1f} MiB: measured/plan {peak / plan:.3f}" if plan else "no plan")
    return tps


# -- the stages ------------------------------------------------------------------------------------
def stage_environment(ctx: StageContext) -> None:
    """Python, torch, CUDA, cuDNN and NCCL versions, the GPU, its driver and memory, the
    dependencies present, and whether ray_titan's trainer imports."""
    log = ctx.log
    log.add("python", platform.python_version(), note=sys.executable)
    log.add("torch", torch.__version__)
    log.add("torch CUDA", torch.version.cuda or "none (CPU build)")
    log.add("cuda available", torch.cuda.is_available(), note=f"{torch.cuda.device_count()} device(s)")
    deps = {}
    for mod in DEPENDENCIES:
        found = _importable(mod)
        dist = {"google.protobuf": "protobuf", "pydantic_core": "pydantic-core"}.get(mod, mod)
        deps[mod] = (_version(dist) or "present") if found else None
    log.add("dependencies", deps, note="module: version, null where absent")
    ctx.attempt("ray_titan import", lambda: log.add("ray_titan imports", bool(__import__("ray_titan.trainer"))))
    if not ctx.cuda:
        for name in ("gpu", "driver", "nccl", "device memory free"):
            log.add(name, NA)
        return
    props = torch.cuda.get_device_properties(ctx.device)
    log.add("gpu", torch.cuda.get_device_name(ctx.device), note=f"compute capability {props.major}.{props.minor}, "
                                                                f"{props.multi_processor_count} SMs")
    log.add("driver", _driver_version())
    log.add("cudnn", torch.backends.cudnn.version())
    ctx.attempt("nccl", lambda: log.add("nccl", ".".join(map(str, torch.cuda.nccl.version()))))
    free, total = torch.cuda.mem_get_info(ctx.device)
    log.add("device memory free", round(free / MiB), "MiB", note=f"of {total / MiB:.0f} MiB")


def _importable(mod: str) -> bool:
    """Whether ``mod`` can be found (a module blocked with ``sys.modules[name] = None`` cannot)."""
    try:
        return importlib.util.find_spec(mod.split(".")[0]) is not None and importlib.util.find_spec(mod) is not None
    except (ValueError, ImportError):
        return False


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version() -> str:
    """The NVIDIA driver's version, from ``nvidia-smi`` (10 s at most), or why not."""
    import subprocess

    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10)
        lines = p.stdout.strip().splitlines()
        return lines[0] if p.returncode == 0 and lines else f"nvidia-smi exit {p.returncode}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({type(e).__name__})"


def stage_main_job(ctx: StageContext) -> None:
    """The main job's model in bf16 on one rank: the plan first (known even if the run dies),
    then the run with the profiler over three steady steps, then the dry run's count of host
    synchronisations for the same job's rank 0."""
    batch, seq, steps = (4, 64, 8) if ctx.small else (64, 512, 30)
    cfg = _one_rank(ctx, "main_job", steps, f"--training.global_batch_size={batch}", f"--training.seq_len={seq}",
                    "--training.mixed_precision=bf16")
    plan = _plan_peak(ctx, cfg)
    first = steps - 2
    counter = HostSyncCounter(first, steps, ctx.device)
    run = _train(ctx, cfg, callbacks=[counter])
    _report_run(ctx, cfg, run, range(3, first), plan)
    counts = counter.counts or {}
    ctx.log.add("host reads per step (profiler)", counts.get("host_reads"), "per step",
                note=f"aten::_local_scalar_dense over steps {first}-{steps}"
                     + ("" if ctx.cuda else "; on CPU every tensor is a host one, so reads of host tensors count too"))
    for key, what in (("sync_calls", "CUDA sync calls per step (profiler)"),
                      ("dtoh_copies", "device-to-host copies per step (profiler)")):
        ctx.log.add(what, counts.get(key) if ctx.cuda else NA, "per step" if ctx.cuda else "",
                    note=", ".join(f"{k} {v:g}" for k, v in counts.items() if k.startswith("cuda")))
    ctx.attempt("dry run", lambda: _dry_run_syncs(ctx, cfg))


def _dry_run_syncs(ctx: StageContext, cfg) -> None:
    """``ray-titan dry-run`` of ``cfg``'s rank 0 (3 steps): its host synchronisations per step."""
    from ray_titan.dry_run import dry_run

    (r,) = dry_run(str(REPO / "configs" / "debug_llama.toml"), subprocess_flags(cfg), ranks=[0], steps=3,
                   timeout=ctx.left())
    ctx.log.add("dry run host syncs per step", sum(r.host_syncs_per_step.values()), "per step",
                note=", ".join(f"{k} ×{v:g}" for k, v in r.host_syncs_per_step.items()) or "none")
    ctx.log.add("dry run peak", round(r.peak_device_bytes / MiB, 1), "MiB",
                note=f"plan {r.plan_peak_bytes / MiB:.1f} MiB" if r.plan_peak_bytes else "")


def _llama_1b(ctx: StageContext, steps: int):
    """The 1B stage's config (``--small``: the debug flavor at a small batch, a stand-in)."""
    flavor, batch, seq = ("debug", 2, 64) if ctx.small else ("3.2-1B", 4, 2048)
    return _one_rank(ctx, "llama_1b", steps, f"--model.flavor={flavor}", f"--training.global_batch_size={batch}",
                     f"--training.seq_len={seq}", "--training.mixed_precision=bf16")


def stage_llama_1b(ctx: StageContext) -> None:
    """A Llama 3.2 1B-shaped model, bf16, one rank: tokens/s, MFU against the datasheet peak and a
    bf16 matmul peak measured here, the device peaks beside the plan."""
    from ray_titan.metrics.flops import gpu_peak_flops, measure_matmul_peak_flops

    steps = 6 if ctx.small else 20
    cfg = _llama_1b(ctx, steps)
    ctx.log.add("shape", f"{cfg.model.flavor}, {cfg.training.global_batch_size} × {cfg.training.seq_len}, bf16",
                note="--small: the debug flavor stands in for 3.2-1B" if ctx.small else "")
    plan = _plan_peak(ctx, cfg)
    tps = _report_run(ctx, cfg, _train(ctx, cfg), range(3, steps + 1), plan)
    fpt = flops_per_token(cfg)
    ctx.log.add("model FLOPs per token", fpt, "FLOP", note="PaLM formula, ray_titan.metrics.flops")
    sheet = gpu_peak_flops(torch.cuda.get_device_name(ctx.device)) if ctx.cuda else None
    ctx.log.add("MFU vs datasheet", round(100 * tps * fpt / sheet, 2) if sheet else (NA if not ctx.cuda else
                "GPU not in GPU_PEAK_FLOPS"), "%" if sheet else "", note=f"peak {sheet:.4g} FLOP/s" if sheet else "")
    n = 256 if ctx.small else 8192
    measured = measure_matmul_peak_flops(ctx.device, torch.bfloat16, n=n, repeats=5)
    ctx.log.add("bf16 matmul peak (measured)", round(measured / 1e12, 3), "TFLOP/s", note=f"{n}³ matmuls")
    ctx.log.add("MFU vs measured matmul peak", round(100 * tps * fpt / measured, 2), "%")


# The memory levers at the 1B shape: (name, flags). Offloading's copies and their overlap exist
# only on a GPU (on a CPU its hooks move nothing), so this is where its cost is measured. The
# "128K vocab" pair widens the byte tokenizer to Llama 3's vocabulary size (a model whose logits
# dominate: wide_vocab), where the chunked loss is meant to act.
WIDE_VOCAB = 128256
LEVERS = (("none", ()), ("none again", ()), ("offload all", ("--memory.activation_offload=all",)),
          ("offload half", ("HALF",)),
          ("full AC", ("--activation_checkpoint.mode=full",)),
          ("selective op", ("--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=op")),
          ("full AC + offload all", ("--activation_checkpoint.mode=full", "--memory.activation_offload=all")),
          ("128K vocab", ("WIDE",)),
          ("128K vocab + chunked loss", ("WIDE", "--training.loss_chunk_tokens=2048")),
          ("128K vocab + chunked loss without snapshot", ("WIDE", "NOSNAP", "--training.loss_chunk_tokens=2048")))
LEVER_BASE: dict[str, str | None] = {"128K vocab": None, "128K vocab + chunked loss": "128K vocab",
                                     "128K vocab + chunked loss without snapshot": "128K vocab"}
"""The lever each is compared with (``none`` unless named here; None: none)."""


@contextlib.contextmanager
def wide_vocab(vocab_size: int = WIDE_VOCAB) -> Iterator[None]:
    """Within: the byte tokenizer declares ``vocab_size`` ids (those above 257 unused), so the
    model's embedding and head, the logits and the plan are that wide; this process only (the
    levers run in it). A stand-in for a real tokenizer of that size: the node may lack
    ``tokenizers``, and its wheel does not fit beside the wheelhouse in one command's carry."""
    from ray_titan.data.tokenizer import ByteTokenizer

    before = ByteTokenizer.vocab_size
    ByteTokenizer.vocab_size = vocab_size
    try:
        yield
    finally:
        ByteTokenizer.vocab_size = before


def largest_gap(a: list[float | None], b: list[float | None]) -> float | None:
    """The largest ``|a[i] − b[i]|`` over the steps both logged (None: none in common)."""
    gaps = [abs(x - y) for x, y in zip(a, b) if x is not None and y is not None]
    return max(gaps) if gaps else None


def _owner(frames: list[dict[str, Any]]) -> str:
    """Who made an allocation: its innermost frame in ray_titan (``file.py:function``), else its
    innermost Python frame, else ``"no Python frame"`` (the autograd engine's device thread:
    backward)."""
    for f in frames:
        name = f.get("filename", "")
        if "ray_titan/" in name and "ray_titan/metrics/" not in name:
            return f"{name.rsplit('ray_titan/', 1)[1]}:{f.get('name', '?')}"
    for f in frames:
        if f.get("filename", "").endswith(".py"):
            return f"{f['filename'].rsplit('/', 1)[-1]}:{f.get('name', '?')}"
    return "no Python frame"


def peak_owners(snapshot: dict[str, Any], top: int = 8) -> dict[str, Any]:
    """Where the device memory peak of a recorded window (a step's
    ``torch.cuda.memory._snapshot()``, ``memory.snapshot_steps``) comes from, by replaying
    device 0's allocation events: ``peak_bytes`` (the memory allocated before the window, from
    the segments at its end less the window's net change, plus the window's largest rise),
    ``before_bytes``, ``at`` (the peak's event index of ``events``), ``maker`` (the owner,
    :func:`_owner`, of the allocation that made the peak) and ``owners``: the ``top`` owners of
    the window's allocations still live at the peak, ``[owner, bytes]``, largest first.
    An allocation counts until its ``free_completed`` (as the allocator's active bytes do); one
    freed in the window but made before it lowers the rise from there on."""
    trace = (snapshot.get("device_traces") or [[]])[0]
    live: dict[int, tuple[int, str]] = {}
    rise = best = 0
    at = -1
    best_live: dict[int, tuple[int, str]] = {}
    maker = ""
    for i, e in enumerate(trace):
        action = e.get("action")
        if action == "alloc":
            who = _owner(e.get("frames") or [])
            live[e["addr"]] = (e["size"], who)
            rise += e["size"]
            if rise > best:
                best, at, maker, best_live = rise, i, who, dict(live)
        elif action == "free_completed":  # of the window's allocation, or of one made before it
            rise -= live.pop(e["addr"])[0] if e["addr"] in live else e["size"]
    # Active at the end: allocated, or freed but waiting for another stream (record_stream).
    end = sum(b["size"] for seg in snapshot.get("segments", []) if seg.get("device", 0) == 0
              for b in seg.get("blocks", []) if b.get("state") in ("active_allocated", "active_pending_free"))
    before = end - rise
    owners: Counter[str] = Counter()
    for size, who in best_live.values():
        owners[who] += size
    return {"peak_bytes": before + best, "before_bytes": before, "at": at, "events": len(trace), "maker": maker,
            "owners": [[who, n] for who, n in owners.most_common(top)]}


def _ring_note(found: dict[str, Any], max_entries: int) -> str:
    """A warning where the replayed window filled the history's ring (its start was overwritten)."""
    return f"; the ring's {max_entries} events are full: the step's start is lost" if found["events"] >= max_entries \
        else ""


@contextlib.contextmanager
def offloaders() -> Iterator[list[Any]]:
    """Within: every ``ActivationOffloader`` made in this process, in order (its ``stats`` are
    the run's, from its first step: the trainer never resets them)."""
    from ray_titan.parallel.offload import ActivationOffloader

    made: list[Any] = []
    init = ActivationOffloader.__init__

    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    ActivationOffloader.__init__ = record  # type: ignore[method-assign]
    try:
        yield made
    finally:
        ActivationOffloader.__init__ = init  # type: ignore[method-assign]


SNAPSHOT_STEP = 3


def stage_memory_levers(ctx: StageContext) -> None:
    """The 1B stage's shape (``--small``: its stand-in) under each of :data:`LEVERS`, one rank:
    (``GPU_LEVERS``, a comma-separated list of their names, picks some) per lever its tokens/s
    (median of steps 3 on), device peaks active and reserved, the plan's
    peak, the last loss and the largest per-step loss gap to its base lever (:data:`LEVER_BASE`;
    same seed and data: 0 on a CPU for the levers that only move or recompute tensors, the
    backward kernels' nondeterminism on a GPU, which ``none again`` measures), as facts named
    ``<lever>: ...``; then its tokens/s and peaks against the base's."""
    from ray_titan.models.registry import get_model_args

    steps = 4 if ctx.small else 10
    shape = _llama_1b(ctx, steps)
    seen: dict[str, dict[str, Any]] = {}
    only = [n.strip() for n in os.environ.get("GPU_LEVERS", "").split(",") if n.strip()]
    for name, flags in LEVERS:
        if only and name not in only:
            continue
        vocab = wide_vocab() if "WIDE" in flags else contextlib.nullcontext()
        snapshot = [] if "NOSNAP" in flags else [f"--memory.snapshot_steps=[{SNAPSHOT_STEP}]"]
        flags = tuple(f for f in flags if f not in ("WIDE", "NOSNAP"))
        if "HALF" in flags:  # the first half of the blocks (8 of the 1B shape's 16)
            n_layers = get_model_args(shape.model.name, shape.model.flavor).n_layers
            flags = (f"--memory.activation_offload={n_layers // 2}",)
        cfg = shape.with_overrides([*flags, *snapshot])
        if ctx.cuda:  # what the run before left (train_here collects its reference cycles)
            ctx.log.add(f"{name}: device allocated before the run", round(torch.cuda.memory_allocated() / MiB, 1),
                        "MiB")
        with vocab, offloaders() as made:
            plan = ctx.attempt(f"{name}: memory plan", lambda cfg=cfg: memory_plan_peak(cfg))
            run = ctx.attempt(f"{name}: run", lambda cfg=cfg: _train(ctx, cfg))
        if run is None:
            continue
        if made:
            ctx.log.add(f"{name}: offloader", dataclasses.asdict(made[-1].stats), note=f"over {steps} steps")
        _snapshot_facts(ctx, name, run, cfg)
        t = run["steps"]
        tps = _tokens_per_s(cfg, t, range(3, steps + 1))
        losses = t["step_loss"].to_pylist()
        seen[name] = {"tps": tps, "losses": losses, "active": run["peak_active"], "reserved": run["peak_reserved"]}
        ctx.log.add(f"{name}: tokens/s", round(tps, 1), "tok/s")
        ctx.log.add(f"{name}: last loss", next((x for x in reversed(losses) if x is not None), None))
        if plan is not None:
            ctx.log.add(f"{name}: plan peak", round(plan / MiB, 1), "MiB")
        if ctx.cuda:
            for what in ("active", "reserved"):
                ctx.log.add(f"{name}: device peak {what}", round(run[f"peak_{what}"] / MiB, 1), "MiB",
                            note=f"measured/plan {run[f'peak_{what}'] / plan:.3f}" if plan else "")
        base_name = LEVER_BASE.get(name, "none")
        base = seen.get(base_name) if base_name else None
        if base is None or base is seen[name]:
            continue
        ctx.log.add(f"{name}: largest loss gap to {base_name}",
                    largest_gap(losses, base["losses"]), note=f"over {len(losses)} steps, same seed and data")
        ctx.log.add(f"{name}: tokens/s / base's", round(tps / base["tps"], 3))
        if ctx.cuda:
            for what in ("active", "reserved"):
                ctx.log.add(f"{name}: peak {what} / base's", round(run[f"peak_{what}"] / base[what], 3))


FAMILY_STEPS = 3


def stage_families(ctx: StageContext) -> None:
    """Every registered family's ``debug`` flavor (with one multi-token-prediction depth where the
    family has them), fp32, one rank, :data:`FAMILY_STEPS` steps on the device and then on the
    host CPU, same seed and data: per family the largest per-step loss gap between the two (the
    device's kernels against the CPU's, TF32 off), the device's tokens/s and peak active
    memory. Qwen3.5's Gated DeltaNet runs its plain PyTorch path unless flash-linear-attention is
    installed (a fact says which)."""
    from benchmarks.gpu_checks import train_here
    from ray_titan.models.registry import FAMILIES, MODELS

    ctx.log.add("flash-linear-attention present", _importable("fla"))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for family in FAMILIES:
        flags = [f"--model.name={family}", "--model.flavor=debug", "--training.global_batch_size=4",
                 "--training.seq_len=256", "--training.mixed_precision=fp32"]
        if MODELS[family].mtp:
            flags.append("--model.mtp_layers=1")
        cfg = _one_rank(ctx, f"family-{family}", FAMILY_STEPS, *flags)
        here = ctx.attempt(f"{family}: run on {ctx.device.type}", lambda cfg=cfg: _train(ctx, cfg))
        there = ctx.attempt(f"{family}: run on cpu", lambda cfg=cfg: train_here(cfg, "cpu")) if ctx.cuda else here
        if here is None or there is None:
            continue
        losses = here["steps"]["step_loss"].to_pylist()
        ctx.log.add(f"{family}: losses finite", all(x is not None and math.isfinite(x) for x in losses),
                    note=f"{len(losses)} steps" + (", 1 MTP depth" if MODELS[family].mtp else ""))
        ctx.log.add(f"{family}: largest loss gap, {ctx.device.type} vs cpu",
                    largest_gap(losses, there["steps"]["step_loss"].to_pylist()), note="fp32, same seed and data")
        ctx.log.add(f"{family}: tokens/s", round(_tokens_per_s(cfg, here["steps"], range(2, FAMILY_STEPS + 1)), 1),
                    "tok/s", note="median of steps 2 on")
        if ctx.cuda:
            ctx.log.add(f"{family}: device peak active", round(here["peak_active"] / MiB, 1), "MiB")


def _snapshot_facts(ctx: StageContext, name: str, run: dict[str, Any], cfg) -> None:
    """``peak_owners`` of the run's step-:data:`SNAPSHOT_STEP` snapshot (CUDA only), as facts."""
    import pickle

    paths = sorted(Path(run["run_dir"]).glob(f"memory/rank0-step{SNAPSHOT_STEP}.pickle"))
    if not ctx.cuda or not paths:
        return
    with open(paths[0], "rb") as f:
        found = peak_owners(pickle.load(f))
    ctx.log.add(f"{name}: step {SNAPSHOT_STEP} peak", round(found["peak_bytes"] / MiB, 1), "MiB",
                note=f"{found['before_bytes'] / MiB:.0f} MiB before the step; the peak at event {found['at']} of "
                     f"{found['events']}, made by {found['maker']}"
                     + _ring_note(found, cfg.memory.history_max_entries))
    ctx.log.add(f"{name}: step {SNAPSHOT_STEP} peak's owners", [[w, round(n / MiB, 1)] for w, n in found["owners"]],
                "MiB", note="the step's allocations live at the peak, by their innermost ray_titan frame")


def memory_plan_peak(cfg) -> int:
    """The memory plan's rank-0 peak of ``cfg`` on CUDA (bytes)."""
    from ray_titan.preflight.memory_plan import memory_plan

    return memory_plan(cfg, device="cuda", levers=False).ranks[0].peak


def stage_torchtitan(ctx: StageContext) -> None:
    """torchtitan 0.3.0 at the 1B stage's shape, batch and dtype (absent: said, and done), and
    the ratio of ray_titan's tokens/s (the ``llama_1b`` stage's fact) to torchtitan's."""
    from benchmarks.harness import run_torchtitan

    if not _importable("torchtitan"):
        ctx.log.add("torchtitan present", False, note="not installed: bring its wheels "
                    "(python -m benchmarks.wheelhouse --torchtitan) to compare")
        return
    ctx.log.add("torchtitan present", _version("torchtitan"))
    steps = 6 if ctx.small else 20
    theirs = run_torchtitan(ctx.work, _llama_1b(ctx, steps), ctx.device.type, timeout=ctx.left())["tokens_per_s"]
    ctx.log.add("torchtitan tokens/s", round(theirs, 1), "tok/s")
    ours = [f["value"] for f in read_facts(ctx.out) if f["stage"] == "llama_1b" and f["name"] == "tokens/s"]
    ctx.log.add("ray_titan / torchtitan tokens/s", round(ours[-1] / theirs, 3) if ours else "no llama_1b tokens/s",
                note="ratio ≥ 1: ray_titan is as fast or faster")


def stage_gpu_checks(ctx: StageContext) -> None:
    """``benchmarks/gpu_checks.py``'s checks, one fact each (PASS/FAIL and its reason), the
    long run 200 steps (``--small``: 16). On CPU the ranks' collectives go through host copies
    as on one shared GPU, so the rehearsal runs that code too."""
    from benchmarks.gpu_checks import run_checks

    failed: list[str] = []

    def record(c: Any) -> None:
        if not ctx.cuda and c.name.startswith(DEVICE_ONLY_CHECKS):  # CPU has no device counters to judge
            ctx.log.add(c.name, NA, note=c.reason)
        else:
            ctx.log.add(c.name, "PASS" if c.passed else "FAIL", "pass/fail", note=c.reason)
            if not c.passed:
                failed.append(c.name)

    run_checks(ctx.work / "checks", ctx.device.type, steps=16 if ctx.small else 200, stage=not ctx.cuda,
               until=ctx.until - 1, on_check=record)
    # A FAIL fails the stage: the first GPU contact's "7 of 7 stages ok" hid four failed checks.
    if failed:
        raise SystemExit(f"{len(failed)} check(s) failed: {', '.join(failed)}")


def stage_main_mesh(ctx: StageContext) -> None:
    """The main job as it ships (pp=2 × dp_shard=2, 1F1B, 4 ranks) on the one device through
    ``gpu_checks.launch_ranks``: exit status, loss, tokens/s, the collectives staged."""
    from benchmarks.gpu_checks import failure_line, launch_ranks, staged_counts
    from benchmarks.harness import tokens_per_s
    from ray_titan.metrics.reading.steps import read_steps
    from ray_titan.metrics.worker.timing import read_timings

    steps = 4 if ctx.small else 30
    cfg = job_config(ctx.work, "main_mesh", steps, "--checkpoint.enable=false", "--metrics.enable_tensorboard=false",
                     f"--metrics.log_freq={steps}")
    proc, run_dir = launch_ranks(ctx.device.type, cfg, stage=not ctx.cuda, timeout=ctx.left())
    ctx.log.add("ranks exit status", proc.returncode, note="" if proc.returncode == 0 else failure_line(proc.stderr))
    ctx.log.add("collectives staged through host", staged_counts(proc.stderr))
    if proc.returncode or run_dir is None:
        raise SystemExit(1)
    t = read_steps(run_dir)
    losses = [x for x in t["step_loss"].to_pylist() if x is not None]
    ctx.log.add("last loss", losses[-1] if losses else None)
    ctx.log.add("loss finite", bool(losses) and all(math.isfinite(x) for x in losses))
    ranks = [v for k, v in sorted(read_timings(run_dir).items()) if k.startswith("rank")]
    ctx.log.add("tokens/s", round(tokens_per_s(cfg, ranks), 1), "tok/s", note=f"{len(ranks)} ranks, {steps} steps")


def stage_compile(ctx: StageContext) -> None:
    """The main job's model with ``training.compile = true``, bf16, one rank: the first step's
    seconds (which hold the compile), loss and tokens/s after it."""
    import os

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(ctx.work / "inductor")  # cold: the compile a user pays once
    batch, seq, steps = (4, 64, 5) if ctx.small else (64, 512, 30)
    cfg = _one_rank(ctx, "compile", steps, f"--training.global_batch_size={batch}", f"--training.seq_len={seq}",
                    "--training.mixed_precision=bf16", "--training.compile=true")
    run = _train(ctx, cfg)
    ctx.log.add("first step", round(run["steps"]["step_time_s"][0].as_py(), 2), "s", note="holds the compile")
    _report_run(ctx, cfg, run, range(3, steps + 1), None)


STAGE_FUNCS: dict[str, Callable[[StageContext], None]] = {
    "environment": stage_environment, "main_job": stage_main_job, "llama_1b": stage_llama_1b,
    "torchtitan": stage_torchtitan, "gpu_checks": stage_gpu_checks, "main_mesh": stage_main_mesh,
    "compile": stage_compile, "memory_levers": stage_memory_levers, "families": stage_families,
}


def main(argv: list[str] | None = None) -> int:
    """Run one stage (module docstring); returns 0, or raises what the stage raised."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_stages")
    ap.add_argument("stage", choices=sorted(STAGE_FUNCS))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--until", type=float, default=float("inf"))
    a = ap.parse_args(argv)
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    work = a.out / "work" / a.stage
    work.mkdir(parents=True, exist_ok=True)
    STAGE_FUNCS[a.stage](StageContext(a.out, work, device, a.small, a.until, FactLog(a.out, a.stage)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
