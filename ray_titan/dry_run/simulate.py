"""One rank of a job on a simulated CUDA device: ``python -m ray_titan.dry_run.simulate SPEC.json``.

Run by :func:`ray_titan.dry_run.dry_run` in a child process per rank, because the fake CUDA
library (:mod:`ray_titan.dry_run.shim`) must be loaded before ``import torch``. The rank is
built and trained by ray_titan's own code (``trainer.build``, ``trainer.step.train_step``) on
fake tensors (PyTorch's ``FakeTensorMode``: shapes, dtypes and devices, no data) over a fake
process group of the job's world size (``torch.testing._internal.distributed.fake_pg``, whose
collectives return at once). What is simulated, and why:

- ``torch.cuda``'s Python functions a CPU build lacks (device properties of an H100, streams,
  events, rng state, memory counters): answered with constants.
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
- ``Module.to_empty`` of parameters made under fake mode: new parameters instead of torch's
  swap, which a fake tensor's weakref refuses (a one-rank mesh, where no FSDP2 materialises them).
- The checkpoint after the last step: its save and resume planned by DCP, nothing written
  (:func:`_plan_checkpoint`); the data loader's position is a constant.
- Device memory: the bytes of live fake CUDA storages after every op (and every storage resize,
  by which FSDP2 frees and re-gathers its unsharded parameters), and their peak.

The result is one JSON object written to the spec's ``out`` path (see :func:`ray_titan.dry_run.dry_run`).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["main"]

H100 = {"name": "NVIDIA H100 80GB HBM3 (simulated)", "major": 9, "minor": 0, "total_memory": 80 * 2**30,
        "multi_processor_count": 132}


def _site() -> str:
    """The innermost ray_titan frame of the current stack, ``path:line`` below the package."""
    frames = [f for f in traceback.extract_stack() if f"{os.sep}ray_titan{os.sep}" in f.filename
              and f"{os.sep}dry_run{os.sep}" not in f.filename]
    if not frames:
        return "(outside ray_titan)"
    f = frames[-1]
    return f"{f.filename.rsplit(os.sep + 'ray_titan' + os.sep, 1)[-1]}:{f.lineno}"


def _patch(owner: Any, name: str, value: Any) -> None:
    """Replace ``owner.<name>`` in this process (the simulation's shims; typed attributes)."""
    setattr(owner, name, value)


class HostCollectiveError(RuntimeError):
    """A collective or point-to-point op was given a host tensor on a device group (NCCL has no
    CPU backend: on a GPU this fails or hangs)."""


def _stub_torch_cuda(torch: Any) -> None:
    import contextlib
    import types

    props = types.SimpleNamespace(gcnArchName="", **H100)

    class Event:
        def __init__(self, *a: Any, **k: Any) -> None: ...
        def record(self, stream: Any = None) -> None: ...
        def wait(self, stream: Any = None) -> None: ...
        def synchronize(self) -> None: ...
        def query(self) -> bool: return True
        def elapsed_time(self, other: Any) -> float: return 0.0

    class Stream:
        device = torch.device("cuda", 0)
        device_index, device_type, stream_id = 0, 1, 0
        def __init__(self, *a: Any, **k: Any) -> None: ...
        def wait_stream(self, s: Any) -> None: ...
        def wait_event(self, e: Any) -> None: ...
        def record_event(self, e: Any = None) -> Any: return e or Event()
        def synchronize(self) -> None: ...
        def query(self) -> bool: return True
        def __enter__(self) -> Any: return self
        def __exit__(self, *a: Any) -> None: ...

    default = Stream()
    cuda = torch.cuda
    stubs: dict[str, Any] = {
        "is_available": lambda: True, "device_count": lambda: 8, "current_device": lambda: 0,
        "set_device": lambda d: None, "synchronize": lambda *a, **k: None, "_lazy_init": lambda: None,
        "is_initialized": lambda: True, "get_device_properties": lambda *a, **k: props,
        "get_device_capability": lambda *a, **k: (props.major, props.minor),
        "get_device_name": lambda *a, **k: props.name, "reset_peak_memory_stats": lambda *a, **k: None,
        "memory_stats": lambda *a, **k: {}, "mem_get_info": lambda *a, **k: (props.total_memory,) * 2,
        "empty_cache": lambda: None, "manual_seed": lambda s: None, "manual_seed_all": lambda s: None,
        "get_rng_state": lambda *a, **k: torch.zeros(16, dtype=torch.uint8),
        "set_rng_state": lambda *a, **k: None, "Stream": Stream, "Event": Event,
        "current_stream": lambda *a, **k: default, "default_stream": lambda *a, **k: default,
        "stream": lambda s: contextlib.nullcontext(s), "set_stream": lambda s: None,
    }
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        stubs[name] = lambda *a, **k: 0
    for name, fn in stubs.items():
        setattr(cuda, name, fn)


def _fused_attention(torch: Any) -> Any:
    """``F.scaled_dot_product_attention`` as a GPU runs it: a fused kernel, which saves no
    ``seq × seq`` probabilities. The fake device would take the math path (a CPU build registers
    no CUDA kernel chooser, so ``aten._fused_sdp_choice`` is never asked). Flash attention without
    a mask and with equal query and value head sizes (grouped-query heads native), else
    memory-efficient attention (a boolean mask made a float bias, grouped-query heads repeated:
    both as PyTorch does)."""
    aten = torch.ops.aten

    def sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
             scale: float | None = None, enable_gqa: bool = False) -> Any:
        if attn_mask is None and q.shape[-1] == v.shape[-1]:
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        if k.shape[-3] != q.shape[-3]:
            rep = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(~attn_mask, float("-inf"))
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, grad, dropout_p, is_causal,
                                                            scale=scale)[0]

    return sdpa


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """Build and train ``spec["rank"]`` for ``spec["steps"]`` steps (module docstring); returns
    the report. Call only in a process where the shim was loaded before torch."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import stage as pp_stage
    from torch.distributed.pipelining._utils import _StageBackwardMeta, _StageForwardMeta, extract_tensor_metas
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._pytree import tree_leaves

    import ray_titan.models.deepseek_v2.model as moe_model
    from ray_titan.checkpoint.huggingface import job_model_args
    from ray_titan.config import load_config
    from ray_titan.parallel.dims import ParallelDims, process_group_backend
    from ray_titan.parallel.fsdp import resolve_mixed_precision
    from ray_titan.trainer.build import build, parallel_dims
    from ray_titan.trainer.step import train_step

    _stub_torch_cuda(torch)
    syncs: Counter[str] = Counter()
    routed = [0]  # the tokens × top-k the current MoE dispatch routes

    class DryRunMode(FakeTensorMode):
        """Fake tensors plus the NCCL check, host-sync counting and the device-memory count."""

        def __init__(self) -> None:
            super().__init__(allow_non_fake_inputs=True)
            self.live: dict[int, int] = {}
            self.current = self.peak = 0
            self.collectives = 0
            self.grouped_mm = 0
            self.shadow = 0  # > 0 while DTensor propagates shapes on global-shape fakes of its own

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            ns = func.namespace
            if func is torch.ops.aten._grouped_mm.default:  # the experts' grouped GEMM (forward and backward)
                self.grouped_mm += 1
            if func is torch.ops.aten._local_scalar_dense.default:
                syncs[_site()] += 1
                return 0.0 if args[0].is_floating_point() else 0
            if func is torch.ops.aten._pin_memory.default:  # CPU offload pins host memory; fake has no pages
                return args[0]
            if func is torch.ops.aten.is_pinned.default:
                return True
            if ns in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
                self.collectives += 1
                for t in tree_leaves((args, kwargs)) if not host_backend else ():
                    if isinstance(t, torch.Tensor) and t.device.type != "cuda":
                        raise HostCollectiveError(
                            f"{func} on a {t.device.type} tensor {tuple(t.shape)} {t.dtype} over a device "
                            f"(NCCL) group, issued at {_site()}: NCCL has no CPU backend")
            out = super().__torch_dispatch__(func, types, args, kwargs)
            for t in tree_leaves(out) if not self.shadow else ():
                if isinstance(t, FakeTensor) and t.device.type == "cuda":
                    self._count(t)
            return out

        def _count(self, t: torch.Tensor) -> None:
            import weakref

            st = t.untyped_storage()
            key = st._cdata
            if key in self.live:
                return
            self.live[key] = st.nbytes()
            self.current += st.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(st, self._free, key)

        def _free(self, key: int) -> None:
            self.current -= self.live.pop(key, 0)

        def resized(self, st: Any, nbytes: int) -> None:
            """FSDP2 frees and re-allocates its unsharded parameters by resizing their storage."""
            key = st._cdata
            if key in self.live:
                self.current += nbytes - self.live[key]
                self.live[key] = nbytes
                self.peak = max(self.peak, self.current)

    # Torch-side shims (module docstring).
    new_tensor = torch.tensor

    def tensor(data: Any, *a: Any, device: Any = None, **k: Any) -> torch.Tensor:
        with unset_fake_temporarily():  # from host data: then made fake, then moved
            t = new_tensor(data, *a, **k)
        t = mode.from_tensor(t)
        return t.to(device) if device is not None else t

    _patch(torch, "tensor", tensor)
    storage_resize = torch.UntypedStorage.resize_

    def resize(self: Any, nbytes: int) -> Any:
        out = storage_resize(self, nbytes)
        mode.resized(self, nbytes)
        return out

    _patch(torch.UntypedStorage, "resize_", resize)
    mesh_init = DeviceMesh.__init__

    def real_mesh_init(self: Any, *a: Any, **k: Any) -> None:
        with unset_fake_temporarily():  # a mesh's rank tables are real host tensors
            mesh_init(self, *a, **k)

    _patch(DeviceMesh, "__init__", real_mesh_init)
    build_mesh = ParallelDims.build_mesh

    def real_build_mesh(self: Any, device_type: str) -> Any:
        with unset_fake_temporarily():  # init_device_mesh's rank tensor, before DeviceMesh.__init__
            return build_mesh(self, device_type)

    _patch(ParallelDims, "build_mesh", real_build_mesh)
    module_to_empty = torch.nn.Module.to_empty

    def to_empty(self: torch.nn.Module, *, device: Any, recurse: bool = True) -> torch.nn.Module:
        # Parameters made under FakeTensorMode carry a weakref, so Module._apply cannot swap them
        # for their materialised copies ("Couldn't swap Embedding.weight"): on a one-rank mesh no
        # FSDP2 materialises them first. New Parameters instead (tied ones stay one object).
        if not any(isinstance(p, FakeTensor) for p in self.parameters(recurse=recurse)):
            return module_to_empty(self, device=device, recurse=recurse)
        new: dict[int, torch.nn.Parameter] = {}
        with torch.no_grad():
            for mod in self.modules() if recurse else [self]:
                for name, p in mod._parameters.items():
                    if p is not None:
                        if id(p) not in new:
                            new[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=device),
                                                            requires_grad=p.requires_grad)
                        mod._parameters[name] = new[id(p)]
                for name, b in mod._buffers.items():
                    if b is not None:
                        mod._buffers[name] = torch.empty_like(b, device=device)
        return self

    _patch(torch.nn.Module, "to_empty", to_empty)
    host_list = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> Any:
        if not isinstance(self, FakeTensor):
            return host_list(self)
        syncs[_site() + " (tolist)"] += 1
        # Each row (the sent and the received counts of a dispatch) spread evenly.
        n = max(1, self.shape[-1] if self.dim() else 1)
        total = 0 if self.is_floating_point() else routed[0]
        flat = [total // n + (1 if i < total % n else 0) for i in range(n)] * (self.numel() // n)
        return np.array(flat).reshape(tuple(self.shape)).tolist()

    _patch(torch.Tensor, "tolist", tolist)
    _patch(FakeTensor, "tolist", tolist)  # its own answers element by element
    route_tokens = moe_model.route_tokens

    def counted_route_tokens(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, *a: Any, **k: Any):
        routed[0] = x.shape[0] * indices.shape[1]
        return route_tokens(x, weights, indices, *a, **k)

    _patch(moe_model, "route_tokens", counted_route_tokens)

    cfg = load_config(spec["config"], spec["overrides"])
    # The groups a GPU job makes: with a host backend beside NCCL, host tensors are valid.
    host_backend = spec.get("host_backend")
    if host_backend is None:
        host_backend = "cpu:" in process_group_backend(True, cfg.memory.cpu_offload)
    dims = parallel_dims(cfg)
    margs = job_model_args(cfg)
    local_batch = cfg.training.global_batch_size // dims.dp
    sp = dims.tp > 1 and cfg.parallelism.sequence_parallel
    hidden = (local_batch // cfg.parallelism.microbatches, cfg.training.seq_len // (dims.tp if sp else 1), margs.dim)
    # What a stage hands the next: bf16 where FSDP2 computes in bf16; fp32 otherwise (autocast's
    # residual stream stays fp32).
    bf16 = resolve_mixed_precision(cfg.training.mixed_precision, "cuda") == "bf16" and dims.fsdp
    hidden_dtype = torch.bfloat16 if bf16 else torch.float32

    def recv_meta(self: Any, src: int) -> Any:
        if src < self.stage_index:
            t = torch.empty(hidden, device=self.device, dtype=hidden_dtype, requires_grad=True)
            return _StageForwardMeta(forward_metas=extract_tensor_metas((t,)) or ())
        return _StageBackwardMeta(backward_metas=self._stage_meta.outputs)

    _patch(pp_stage.PipelineStage, "_send_meta", lambda self, meta, dst_stage: None)
    _patch(pp_stage.PipelineStage, "_recv_meta", recv_meta)
    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def shadow_propagate(self: Any, op_schema: Any) -> Any:
        # DTensor derives an op's output shape by running it on fakes of the *global* shapes in
        # the active fake mode (this one): no GPU ever holds those, so they are not counted.
        mode.shadow += 1
        try:
            return propagate(self, op_schema)
        finally:
            mode.shadow -= 1

    _patch(ShardingPropagator, "_propagate_tensor_meta_non_cached", shadow_propagate)
    _patch(torch.nn.functional, "scaled_dot_product_attention", _fused_attention(torch))

    rank = spec["rank"]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)

    class Shape:  # what build() reads of the data loader
        pass

    loader = Shape()
    loader.local_batch = local_batch  # type: ignore[attr-defined]
    loader.state_dict = lambda: {"epoch": 0, "doc_pos": 0, "offset": 0}  # type: ignore[attr-defined]
    mode = DryRunMode()
    t0 = time.perf_counter()
    with mode:
        parts = build(cfg, rank, margs.vocab_size, loader, torch.device("cuda", 0))  # type: ignore[arg-type]
        built_s = time.perf_counter() - t0
        after_build = mode.current
        syncs.clear()
        for step in range(1, spec["steps"] + 1):
            tokens = torch.randint(0, margs.vocab_size, (local_batch, cfg.training.seq_len)).to("cuda")
            train_step(parts, tokens, tokens, step, cfg.parallelism.microbatches, cfg.training.max_norm)
            if step == 1 and spec["steps"] > 1:
                syncs.clear()  # steady state: the schedule's one-time p2p warm-up reads a flag in step 1
                mode.grouped_mm = 0
        step_syncs = dict(syncs)
        t_ck = time.perf_counter()
        checkpoint = _plan_checkpoint(cfg, parts, loader, margs.vocab_size, spec["steps"])
        checkpoint["checkpoint_seconds"] = time.perf_counter() - t_ck
    from ray_titan.parallel import local_tensor

    def nbytes(tensors: Any) -> int:  # distinct device storages (views share one)
        storages = {local_tensor(t).untyped_storage()._cdata: local_tensor(t).untyped_storage().nbytes()
                    for t in tensors if isinstance(t, torch.Tensor) and local_tensor(t).device.type == "cuda"}
        return sum(storages.values())

    state = [v for st in parts.optimizer.state.values() for v in st.values()]
    return {
        "held_bytes": {"parameters": nbytes(parts.params), "gradients": nbytes(p.grad for p in parts.params),
                       "optimizer_state": nbytes(state)},
        "rank": rank, "coords": dims.coords(rank), "stages": sorted(parts.stages), "steps": spec["steps"],
        "build_seconds": built_s, "seconds": time.perf_counter() - t0,
        "host_syncs_per_step": {k: v / max(1, spec["steps"] - 1) if spec["steps"] > 1 else v
                                for k, v in sorted(step_syncs.items())}, **checkpoint,
        "collectives": mode.collectives, "device_bytes_after_build": after_build,
        "grouped_mm_per_step": mode.grouped_mm / max(1, spec["steps"] - 1),
        "peak_device_bytes": mode.peak,
    }


def _plan_checkpoint(cfg: Any, parts: Any, loader: Any, vocab_size: int, step: int) -> dict[str, Any]:
    """The checkpoint after ``step`` planned by DCP as ``Checkpointer.save`` would hand it over
    (:func:`ray_titan.dry_run.checkpoint_plan.plan_save`, nothing written), then its resume
    planned (``Checkpointer._load``'s state, key checks and DCP load planning) from it and from
    the same rank's save on CPU, which lacks the CUDA generator key. Returns the report's
    ``checkpoint_keys``, ``checkpoint_bytes`` (by device type) and ``resume_read_items``."""
    import dataclasses

    from ray_titan.checkpoint import Checkpointer
    from ray_titan.checkpoint.checkpointer import _check_keys, _drop_missing_device_rng
    from ray_titan.dry_run.checkpoint_plan import plan_load, plan_save

    ck = Checkpointer(cfg, parts.rank, parts.stages.values(), parts.optimizer, parts.scheduler, loader, None, None,
                      vocab_size, parts.device)
    state = ck._state(step, False, True)
    metadata, copied = plan_save(state)
    # The same rank's save on CPU: every key but the CUDA generator's. The resume's state is the
    # save's (Checkpointer._load builds the same keys and shapes; building it again costs seconds).
    cuda_rng = f"rng.rank{parts.rank}.cuda"
    on_cpu = dataclasses.replace(metadata, state_dict_metadata={
        k: v for k, v in metadata.state_dict_metadata.items() if k != cuda_rng})
    reads = []
    for saved in (metadata, on_cpu):
        sd = dict(state)
        _drop_missing_device_rng(sd, saved.state_dict_metadata, parts.rank)
        _check_keys(sd, saved, Path("(simulated checkpoint)"))
        reads.append(plan_load(sd, saved))
    return {"checkpoint_keys": len(metadata.state_dict_metadata), "checkpoint_bytes": copied,
            "resume_read_items": reads[0]}


def main(argv: list[str] | None = None) -> int:
    """``SPEC.json``: ``{"shim": path or null, "config", "overrides", "rank", "steps", "out",
    "host_backend": true, false or null (the job's own)}``;
    writes the report (or ``{"error": ...}``) to ``out``; exit 0, or 1 on an error."""
    spec = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    if spec.get("shim"):
        ctypes.CDLL(spec["shim"], mode=os.RTLD_GLOBAL)  # before torch: its registrations run now
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
