"""One rank of a job on a simulated CUDA device: ``python -m ray_titan.dry_run.rank SPEC.json``.

Run by :func:`ray_titan.dry_run.dry_run` in a child process per rank, because the fake CUDA
library (:mod:`ray_titan.dry_run.shim`) must be loaded before ``import torch``. The rank is
built and trained by ray_titan's own code (``trainer.build``, ``trainer.step.train_step``) on
fake tensors (PyTorch's ``FakeTensorMode``: shapes, dtypes and devices, no data) over a fake
process group of the job's world size (``torch.testing._internal.distributed.fake_pg``, whose
collectives return at once). This module runs the rank; the simulation is in three others:
:mod:`.fake_device` (``torch.cuda`` answered as an H100's, the fake tensor mode, the torch-side
shims), :mod:`.fake_group` (the process group, and the pipeline neighbours that are not running)
and :mod:`.tally` (what is counted). What is simulated, and why:

- The few aten ops a CPU build has no CUDA kernel for but a math definition (``silu_backward``):
  a placeholder CUDA kernel, so the op reaches fake mode whole, as a GPU runs it
  (:func:`.fake_device._register_cuda_kernels`).
- ``torch.cuda``'s Python functions (device properties of an H100, streams, events, rng state,
  memory counters, graph capture): answered with constants, on a CPU build, which lacks them, as
  on a CUDA build, whose own would call the CUDA runtime; ``Tensor.record_stream`` a no-op (the
  streams are those stubs, one order: a tensor's memory is free when its last reference goes).
- Pipeline shape inference over the fake group: see :func:`.fake_group._install_stage_meta_shims` and
  :func:`.fake_group._schedules_see_nccl` (what each torch version exchanges, and how it is answered).
- A host read of a device value (``.item()``, ``.tolist()``): counted per call site (over the
  steps after the first, when there are several: the steady state), and answered 0 (a finite
  loss, a zero flag); a MoE routing count list is answered with the routed tokens spread evenly
  over each row (balanced routing), so the dispatch shapes are real.
- Pipeline stages exchange shape metadata with their neighbours before the first step; the
  neighbour is not running here, so its answer is the hidden state ``(microbatch, seq / tp under
  sequence parallel, dim)`` forward and this stage's own output shapes backward.
- Every collective and point-to-point op is checked as NCCL would: a host tensor on a group of
  the device mesh fails with the op, the tensor's device and the ray_titan frame that issued it
  (unless the job's groups have a host backend too: ``parallel.dims.process_group_backend``).
- Attention: the fused SDPA kernel a GPU would choose (flash, or memory-efficient with a mask or
  unequal head sizes), not the math path (``seq × seq`` probabilities) the fake device would take.
- DTensor's shape propagation runs each op on fakes of the global shapes in this fake mode: those
  are not counted as device memory (no GPU holds them; counted, a 70B rank read 4× its peak).
- A DTensor shard's global offsets (``compute_local_shape_and_global_offset``: DCP's save
  planning, tp × FSDP's strided shards) are index arithmetic on host tensors, computed on real
  ones: as fake ops they cost most of a large rank's dry run.
- ``init_weights`` copies a tensor of this rank's shard's shape (computed on the host) into each
  sharded parameter instead of slicing the full fake tensor (values are meaningless here; the
  slicing, as fake ops, cost a 70B rank more than its step).
- ``Module.to_empty`` of parameters made under fake mode: new parameters instead of torch's
  swap, which a fake tensor's weakref refuses (a one-rank mesh, where no FSDP2 materialises them).
- The checkpoint after the last step: its save and resume planned by DCP, nothing written
  (:func:`.checkpoint_plan.plan_checkpoint`); the data loader's position is a constant.
- Device memory: the bytes of live fake CUDA storages after every op (and every storage resize,
  by which FSDP2 frees and re-gathers its unsharded parameters), their peak, and what held it,
  by the memory plan's categories (:class:`.tally._DeviceTally`).

The result is one JSON object written to the spec's ``out`` path (see :func:`ray_titan.dry_run.dry_run`).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_titan.dry_run.fake_device import (
    _dry_run_mode,
    _install_op_shims,
    _install_torch_shims,
    _patch,
    _register_cuda_kernels,
    _stub_torch_cuda,
)
from ray_titan.dry_run.fake_group import _join_fake_group
from ray_titan.dry_run.tally import _device_bytes, _DeviceTally, _owned_storages

__all__ = ["main", "run_rank"]


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """Build and train ``spec["rank"]`` for ``spec["steps"]`` steps (module docstring); returns
    the report. Call only in a process where the shim was loaded before torch."""
    import torch

    _import_before_shims()
    _register_cuda_kernels(torch)
    _stub_torch_cuda(torch)
    tally = _DeviceTally()
    mode = _dry_run_mode(tally)
    _install_torch_shims(mode, tally)
    job = _Job.load(spec)
    tally.host_backend = job.host_backend
    _install_op_shims(tally)
    _join_fake_group(job)
    return _train_and_report(spec, job, mode, tally)


def _import_before_shims() -> None:
    """Import every module the simulation uses before any shim is installed (and before
    ``torch.cuda`` is stubbed), so a module that reads or binds a patched name at import time sees
    torch's own, whichever function below imports it first."""
    import numpy  # noqa: F401
    import torch.distributed.checkpoint.planner_helpers
    import torch.distributed.device_mesh
    import torch.distributed.pipelining._utils
    import torch.distributed.pipelining.stage
    import torch.distributed.tensor._sharding_prop
    import torch.utils._pytree  # noqa: F401
    from torch._subclasses import fake_tensor  # noqa: F401

    import ray_titan.checkpoint.hf_config
    import ray_titan.checkpoint.hf_import
    import ray_titan.config
    import ray_titan.models.deepseek_v2.model
    import ray_titan.parallel.dims
    import ray_titan.parallel.fsdp
    import ray_titan.trainer.build
    import ray_titan.trainer.step  # noqa: F401


@dataclass
class _Job:
    """The job a rank simulates and the shapes the shims answer with: ``hidden`` is the hidden state
    a pipeline stage hands the next, ``(microbatch, seq / tp under sequence parallel, dim)``, in
    ``hidden_dtype``; ``host_backend``: the job's groups have a host backend beside NCCL."""

    rank: int
    cfg: Any
    dims: Any
    margs: Any
    local_batch: int
    host_backend: bool
    hidden: tuple[int, int, int]
    hidden_dtype: Any

    @classmethod
    def load(cls, spec: dict[str, Any]) -> _Job:
        """The job of ``spec`` (the validated job, as ``JobConfig.model_dump(mode="json")``;
        ``host_backend`` None: the job's own)."""
        import torch

        from ray_titan.checkpoint import job_model_args
        from ray_titan.config.schema import JobConfig
        from ray_titan.parallel.dims import process_group_backend
        from ray_titan.parallel.fsdp import resolve_mixed_precision
        from ray_titan.trainer.build import parallel_dims

        cfg = JobConfig.from_dict(spec["job"])
        # The groups a GPU job makes: with a host backend beside NCCL, host tensors are valid.
        host_backend = spec.get("host_backend")
        if host_backend is None:
            host_backend = "cpu:" in process_group_backend(True, cfg.memory.cpu_offload)
        dims = parallel_dims(cfg)
        margs = job_model_args(cfg)
        local_batch = cfg.training.global_batch_size // dims.dp
        sp = dims.tp > 1 and cfg.parallelism.sequence_parallel
        # A stage's share of each sequence: 1/cp under context parallel, 1/tp of that under sequence parallel.
        hidden = (local_batch // cfg.parallelism.microbatches,
                  cfg.training.seq_len // dims.cp // (dims.tp if sp else 1), margs.dim)
        # What a stage hands the next: bf16 where FSDP2 computes in bf16; fp32 otherwise (autocast's
        # residual stream stays fp32).
        bf16 = resolve_mixed_precision(cfg.training.mixed_precision, "cuda") == "bf16" and dims.fsdp
        return cls(spec["rank"], cfg, dims, margs, local_batch, host_backend, hidden,
                   torch.bfloat16 if bf16 else torch.float32)


class _LoaderShape:
    """What ``build()`` and the checkpoint read of the data loader: the local batch and a constant
    position."""

    def __init__(self, local_batch: int) -> None:
        self.local_batch = local_batch

    def state_dict(self) -> dict[str, int]:
        """The loader's position (a constant: no data is read)."""
        return {"epoch": 0, "doc_pos": 0, "offset": 0}


def _train_and_report(spec: dict[str, Any], job: _Job, mode: Any, tally: _DeviceTally) -> dict[str, Any]:
    """Build the rank under ``mode``, train ``spec["steps"]`` steps and plan the checkpoint; returns
    the report: host syncs and grouped GEMMs per step counted over the steps after the first when
    there are several (the steady state), held and peak device bytes, times in seconds."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    import ray_titan.trainer.step as step_mod
    from ray_titan.dry_run.checkpoint_plan import plan_checkpoint
    from ray_titan.trainer.build import build
    from ray_titan.trainer.step import train_step

    forward_backward = step_mod._forward_backward

    def tagged_forward_backward(*a: Any, **k: Any) -> Any:
        out = forward_backward(*a, **k)
        tally.phase = "step"  # clipping and the rest of the step until the optimizer's hooks
        return out

    _patch(step_mod, "_forward_backward", tagged_forward_backward)

    cfg, steps = job.cfg, spec["steps"]
    loader = _LoaderShape(job.local_batch)
    t0 = time.perf_counter()
    with mode:
        parts = build(cfg, job.rank, job.margs.vocab_size, loader, torch.device("cuda", 0))  # type: ignore[arg-type]
        built_s = time.perf_counter() - t0
        after_build = tally.current
        tally.syncs.clear()
        tally.owners = lambda: _owned_storages(parts)
        tally.phase = "forward"  # the step's ops outside backward (by autograd's graph task) and the optimizer
        pre = register_optimizer_step_pre_hook(lambda *a: setattr(tally, "phase", "optimizer"))
        post = register_optimizer_step_post_hook(lambda *a: setattr(tally, "phase", "step"))
        for step in range(1, steps + 1):
            tally.phase = "step"
            tokens = torch.randint(0, job.margs.vocab_size, (job.local_batch, cfg.training.seq_len)).to("cuda")
            # training.document_mask: positions as the loader's (one document a sequence; the
            # block-causal mask costs the same whatever the documents).
            positions = (torch.arange(cfg.training.seq_len).expand(job.local_batch, -1).to("cuda")
                         if cfg.training.document_mask else None)
            tally.phase = "forward"
            train_step(parts, tokens, tokens, step, cfg.parallelism.microbatches, cfg.training.max_norm,
                       positions=positions)
            if step == 1 and steps > 1:
                tally.syncs.clear()  # steady state: the schedule's one-time p2p warm-up reads a flag in step 1
                tally.grouped_mm = 0
        pre.remove()
        post.remove()
        tally.phase = "checkpoint"
        tally.finish()
        step_peak = tally.peak  # of the build and the steps, as planned (not the checkpoint's planning)
        step_syncs = dict(tally.syncs)
        t_ck = time.perf_counter()
        checkpoint = plan_checkpoint(cfg, parts, loader, job.margs.vocab_size, steps)
        checkpoint["checkpoint_seconds"] = time.perf_counter() - t_ck
    state = [v for st in parts.optimizer.state.values() for v in st.values()]
    return {
        "held_bytes": {"parameters": _device_bytes(parts.params),
                       "gradients": _device_bytes(p.grad for p in parts.params),
                       "optimizer_state": _device_bytes(state)},
        "rank": job.rank, "coords": job.dims.coords(job.rank), "stages": sorted(parts.stages), "steps": steps,
        "build_seconds": built_s, "seconds": time.perf_counter() - t0,
        "host_syncs_per_step": {k: v / max(1, steps - 1) if steps > 1 else v
                                for k, v in sorted(step_syncs.items())}, **checkpoint,
        "collectives": tally.collectives, "device_bytes_after_build": after_build,
        "grouped_mm_per_step": tally.grouped_mm / max(1, steps - 1),
        "peak_device_bytes": step_peak, "peak_by_category": tally.by_category,
        "peak_top_ops": [list(t) for t in tally.top_ops],
    }


def main(argv: list[str] | None = None) -> int:
    """``SPEC.json``: ``{"shim": path or null, "job", "rank", "steps", "out",
    "host_backend": true, false or null (the job's own)}``;
    writes the report (or ``{"error": ...}``) to ``out``; exit 0, or 1 on an error."""
    spec = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    if spec.get("shim"):
        shim = ctypes.CDLL(spec["shim"], mode=os.RTLD_GLOBAL)  # before torch: its registrations run now
        import torch  # noqa: F401  (a CUDA build registers its own device guard here)

        shim.rt_fake_cuda_install()  # the fake device guard, over a CUDA build's real one
    try:
        result = run_rank(spec)
        code = 0
    except Exception as e:
        result = {"rank": spec["rank"], "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc()[-4000:]}
        code = 1
    Path(spec["out"]).write_text(json.dumps(result))
    return code


if __name__ == "__main__":
    sys.exit(main())
