"""``ray-titan dry-run``: any rank of any mesh trained on a simulated CUDA device, on a laptop.

Before paying for a 1,000-GPU job, run its ranks here: each is built and trained for a few
steps by ray_titan's own code (build and parallelize, the pipeline schedule, forward, backward,
clipping, the optimizer and LR steps, then the checkpoint's save and resume planned by DCP,
nothing written: :mod:`ray_titan.dry_run.checkpoint_plan`) on fake CUDA tensors over a fake process group of the
job's world size, one child process per rank (:mod:`ray_titan.dry_run.rank`, whose
docstring lists what is simulated). It finds what would fail on the first GPU run without a
GPU: a host tensor given to an NCCL collective, a shape that does not fit the mesh; and it
counts the host synchronisations per step (each drains the GPU's queue) and measures each
rank's peak device memory, beside the memory plan's prediction for that rank
(:func:`ray_titan.preflight.memory_plan.memory_plan`). Losses are meaningless there (no data is
computed); correctness of values is the CPU parity tests' business.

The simulated device is a small C++ library, built once with the compiler torch's extension
builder uses, on any torch build: a CPU build has no CUDA device at all, and a CUDA build on a
machine without a GPU fails at its first call into the CUDA runtime (:mod:`ray_titan.dry_run.shim`).

Modules, each importing only those after it: :mod:`.rank` (a rank's child process: builds,
trains and reports it), :mod:`.fake_group` (the fake process group, and the pipeline neighbours
that are not running), :mod:`.fake_device` (``torch.cuda`` as an H100's, the fake tensor mode
that checks collectives as NCCL would, the torch-side shims), :mod:`.tally` (what is counted:
host reads, collectives, device memory and its peak by category); beside them
:mod:`.checkpoint_plan` (the checkpoint planned by DCP) and :mod:`.shim` (the fake CUDA library).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray_titan.config.schema import JobConfig

__all__ = ["DryRunError", "RankResult", "dry_run", "format_results", "representative_ranks"]


class DryRunError(RuntimeError):
    """A simulated rank failed: the message names the rank and the error (for a host tensor on
    an NCCL group: the op, the tensor's device and the ray_titan frame that issued it)."""


@dataclass
class RankResult:
    """One simulated rank: ``coords`` on the mesh, the pipeline ``stages`` it holds, ``steps``
    run, ``build_seconds`` and ``seconds`` (build and steps; wall), ``host_syncs_per_step`` (call site ->
    synchronisations per step, after the first step when there are several),
    ``collectives`` checked, ``peak_device_bytes`` (live fake CUDA
    storages at their peak, bytes), ``device_bytes_after_build``, ``held_bytes`` (the rank's
    parameters, gradients and optimizer state on the device after the last step), the memory plan's
    ``plan_peak_bytes`` for the rank, ``grouped_mm_per_step``: ``torch._grouped_mm`` calls per
    step, forward and backward (the routed experts' grouped GEMM; 0 where they loop), and the
    checkpoint after the last step as DCP planned its
    save (nothing written): ``checkpoint_keys``, ``checkpoint_bytes`` (the tensors' bytes by device
    type: ``cuda``, ``cpu``), ``resume_read_items`` (the items DCP plans to read resuming it) and
    ``checkpoint_seconds`` (wall, that planning's); ``peak_by_category``: the live storages at the
    peak of the build and the steps by the plan's categories (bytes; tagged as
    :class:`ray_titan.dry_run.tally._DeviceTally` says), ``peak_top_ops``: their largest
    makers, ``[category, "phase:op", bytes]``, and ``plan_by_category``: the plan's
    (``RankPlan.categories``)."""

    rank: int
    coords: dict[str, int]
    stages: list[int]
    steps: int
    build_seconds: float
    seconds: float
    host_syncs_per_step: dict[str, float]
    collectives: int
    peak_device_bytes: int
    device_bytes_after_build: int
    held_bytes: dict[str, int]
    plan_peak_bytes: int | None = None
    checkpoint_keys: int = 0
    checkpoint_bytes: dict[str, int] = field(default_factory=dict)
    resume_read_items: int = 0
    checkpoint_seconds: float = 0.0
    grouped_mm_per_step: float = 0.0
    peak_by_category: dict[str, int] = field(default_factory=dict)
    peak_top_ops: list[list[Any]] = field(default_factory=list)
    plan_by_category: dict[str, int] = field(default_factory=dict)


def dry_run(config: str | None, overrides: list[str], ranks: list[int] | None = None, steps: int = 2,
            timeout: float = 600.0, host_backend: bool | None = None) -> list[RankResult]:
    """Simulate ``ranks`` (default: rank 0) of the job ``config`` + ``overrides`` for ``steps``
    steps each, one child process per rank, in turn: the job a run would train, ``memory.fit =
    "auto"`` applied (its line printed on stdout, as a run prints it). ``host_backend``: whether the process
    groups accept host tensors (None: as the job would make them,
    ``ray_titan.parallel.dims.process_group_backend``; False: NCCL only). Raises ``ConfigError`` for a bad job,
    a rank off the mesh or ``steps`` < 1 (before anything runs), :class:`~ray_titan.dry_run.shim.ShimError`
    when the simulated device cannot be built, :class:`DryRunError` for the first rank that fails or
    runs past ``timeout`` seconds."""
    from ray_titan.checkpoint import job_model_args
    from ray_titan.config import ConfigError, load_config
    from ray_titan.dry_run.shim import build_shim
    from ray_titan.preflight.checks import _check_vocab, validate_job
    from ray_titan.preflight.memory_plan import memory_plan
    from ray_titan.preflight.prepare import fit_memory

    if steps < 1:  # zero steps would simulate nothing and say it ran
        raise ConfigError(f"steps = {steps}: simulate at least 1 training step")
    # The data and the tokenizer are never read here: the ranks build the flavor's vocabulary, and
    # it is what the mesh must split (tp, loss parallel), not the tokenizer's.
    cfg = validate_job(load_config(config, overrides), check_data=False)
    _check_vocab(cfg, job_model_args(cfg).vocab_size)
    world = cfg.world_size
    ranks = ranks if ranks is not None else [0]
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ConfigError(f"rank {bad[0]} is not on the mesh of {world} ranks; valid: 0 to {world - 1}")
    # Planned with the vocabulary the simulation builds (the flavor's), not the tokenizer's.
    vocab = job_model_args(cfg).vocab_size
    cfg, fitted, line = fit_memory(cfg, "cuda", vocab_size=vocab, check_data=False)
    if line:
        print(f"ray_titan: {line}", flush=True)
    plan = fitted if fitted is not None else memory_plan(cfg, device="cuda", levers=False, vocab_size=vocab)
    shim = build_shim()
    results = []
    with tempfile.TemporaryDirectory(prefix="rt_dry_run_") as tmp:
        for rank in ranks:
            spec = {"shim": str(shim) if shim else None, "job": cfg.model_dump(mode="json"), "rank": rank,
                    "steps": steps, "out": str(Path(tmp) / f"rank{rank}.json"), "host_backend": host_backend}
            spec_file = Path(tmp) / f"spec{rank}.json"
            spec_file.write_text(json.dumps(spec))
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            try:
                proc = subprocess.run([sys.executable, "-m", "ray_titan.dry_run.rank", str(spec_file)],
                                      capture_output=True, text=True, timeout=timeout, env=env)
            except subprocess.TimeoutExpired:  # subprocess.run has killed the child
                raise DryRunError(f"rank {rank}: the simulation ran past its time limit of {timeout:g} s "
                                  f"(steps = {steps}); simulate fewer steps or a smaller model") from None
            out = Path(tmp) / f"rank{rank}.json"
            if not out.is_file():
                raise DryRunError(f"rank {rank}: the simulation died (exit {proc.returncode}): {proc.stderr[-2000:]}")
            got: dict[str, Any] = json.loads(out.read_text())
            if "error" in got:
                raise DryRunError(f"rank {rank}: {got['error']}\n{got['traceback']}")
            planned = plan.for_rank(rank)
            results.append(RankResult(**got, plan_peak_bytes=planned.peak if planned else None,
                                      plan_by_category=planned.categories() if planned else {}))
    return results


def representative_ranks(cfg: JobConfig) -> list[int]:
    """One rank per distinct role of ``cfg``'s mesh: for every pipeline rank its first rank
    (every other coordinate 0) and its last (every coordinate at its largest: the last FSDP
    shard, which pads an uneven split, the last tp and ep ranks). Ranks that differ only in
    coordinates that change no shape are the same computation."""
    from ray_titan.trainer.build import parallel_dims

    dims = parallel_dims(cfg)
    per_pp = dims.world_size // dims.pp
    return sorted({r for p in range(dims.pp) for r in (p * per_pp, (p + 1) * per_pp - 1)})


def format_results(results: list[RankResult]) -> str:
    """A table, one line per simulated rank, then each rank's peak by the plan's categories
    (simulated / planned), its checkpoint's planning and its host synchronisation sites."""
    from ray_titan.config.units import format_bytes

    lines = [f"{'rank':>5}  {'coords':<28} {'stages':<8} {'steps':>5} {'seconds':>8} {'syncs/step':>10} "
             f"{'collectives':>11} {'peak device':>12} {'plan peak':>10}"]
    for r in results:
        coords = ", ".join(f"{k}={v}" for k, v in r.coords.items())
        plan = format_bytes(r.plan_peak_bytes) if r.plan_peak_bytes is not None else "-"
        lines.append(f"{r.rank:>5}  {coords:<28} {','.join(map(str, r.stages)):<8} {r.steps:>5} {r.seconds:>8.1f} "
                     f"{sum(r.host_syncs_per_step.values()):>10.1f} {r.collectives:>11} "
                     f"{format_bytes(r.peak_device_bytes):>12} {plan:>10}")
    for r in results:
        if r.peak_by_category:
            cells = ", ".join(f"{c} {format_bytes(n)} / {format_bytes(r.plan_by_category.get(c, 0))}"
                              for c, n in r.peak_by_category.items())
            lines.append(f"rank {r.rank} peak by category, simulated / planned: {cells}")
    for r in results:
        saved = ", ".join(f"{format_bytes(n)} on {d}" for d, n in sorted(r.checkpoint_bytes.items()))
        lines.append(f"rank {r.rank} checkpoint (DCP save planned, nothing written): {r.checkpoint_keys} keys, "
                     f"{saved}; resume planned: {r.resume_read_items} reads")
    for r in results:
        sites = ", ".join(f"{site} ×{n:g}" for site, n in r.host_syncs_per_step.items())
        lines.append(f"rank {r.rank} host synchronisations per step: {sites or 'none'}")
    return "\n".join(lines)
