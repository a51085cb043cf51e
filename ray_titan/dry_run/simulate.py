"""One rank of a job on a simulated CUDA device: ``python -m ray_titan.dry_run.simulate SPEC.json``.

Run by :func:`ray_titan.dry_run.dry_run` in a child process per rank, because the fake CUDA
library (:mod:`ray_titan.dry_run.shim`) must be loaded before ``import torch``. The rank is
built and trained by ray_titan's own code (``trainer.build``, ``trainer.step.train_step``) on
fake tensors (PyTorch's ``FakeTensorMode``: shapes, dtypes and devices, no data) over a fake
process group of the job's world size (``torch.testing._internal.distributed.fake_pg``, whose
collectives return at once). What is simulated, and why:

- The few aten ops a CPU build has no CUDA kernel for but a math definition (``silu_backward``):
  a placeholder CUDA kernel, so the op reaches fake mode whole, as a GPU runs it
  (:func:`_register_cuda_kernels`).
- ``torch.cuda``'s Python functions (device properties of an H100, streams, events, rng state,
  memory counters, graph capture): answered with constants, on a CPU build, which lacks them, as
  on a CUDA build, whose own would call the CUDA runtime.
- Pipeline shape inference over the fake group: see :func:`_install_stage_meta_shims` and
  :func:`_schedules_see_nccl` (what each torch version exchanges, and how it is answered).
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
  (:func:`_plan_checkpoint`); the data loader's position is a constant.
- Device memory: the bytes of live fake CUDA storages after every op (and every storage resize,
  by which FSDP2 frees and re-gathers its unsharded parameters), their peak, and what held it,
  by the memory plan's categories (:class:`_DeviceTally`).

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
from dataclasses import dataclass
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
        "is_current_stream_capturing": lambda: False,  # the optimizers' graph-capture check
    }
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        stubs[name] = lambda *a, **k: 0
    for name, fn in stubs.items():
        setattr(cuda, name, fn)
    # Fake mode makes one real CUDA tensor before the first fake one on a device it believes
    # available (a CUDA context for backward): the fake device needs none, and a CUDA build
    # without a driver fails there.
    from torch._subclasses import fake_tensor

    if hasattr(fake_tensor, "init_gpu_context"):
        _patch(fake_tensor, "init_gpu_context", lambda device: None)


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
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _import_before_shims()
    _register_cuda_kernels(torch)
    _stub_torch_cuda(torch)
    tally = _DeviceTally()
    mode = _dry_run_mode(tally)
    _install_torch_shims(mode, tally)
    job = _Job.load(spec)
    tally.host_backend = job.host_backend
    _install_pipeline_shims(job, tally)
    dist.init_process_group("fake", store=FakeStore(), rank=job.rank, world_size=job.dims.world_size)
    return _train_and_report(spec, job, mode, tally)


_CUDA_KERNELS: list[Any] = []  # the torch.library registrations, kept alive


def _register_cuda_kernels(torch: Any) -> None:
    """On a CPU-only build, a CUDA kernel for each aten op that a CUDA build runs as one kernel
    but a CPU build, lacking it, decomposes into its math definition before fake mode sees it
    (ops with a CPU kernel and a ``CompositeImplicitAutograd`` one and no CUDA kernel:
    ``silu_backward``, whose math form made 6 f-wide temporaries at a SwiGLU's backward). Fake
    mode then handles the op whole; the kernel itself never runs (it raises if it does)."""
    if torch.backends.cuda.is_built():
        return
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    lib = torch.library.Library("aten", "IMPL")

    def never(*a: Any, **k: Any) -> Any:
        raise RuntimeError("a placeholder CUDA kernel of the dry run ran outside fake mode")

    for name in torch._C._dispatch_get_all_op_names():
        if (name.startswith("aten::") and has(name, "CPU") and has(name, "CompositeImplicitAutograd")
                and not has(name, "CUDA")):
            lib.impl(name.split("::", 1)[1], never, "CUDA")
    _CUDA_KERNELS.append(lib)


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

    import ray_titan.checkpoint.huggingface
    import ray_titan.config
    import ray_titan.models.deepseek_v2.model
    import ray_titan.parallel.dims
    import ray_titan.parallel.fsdp
    import ray_titan.trainer.build
    import ray_titan.trainer.step  # noqa: F401


class _DeviceTally:
    """What the dry run counts on the fake device (module docstring): host reads per call site
    (``syncs``), collectives (each checked as NCCL would unless ``host_backend``), the experts'
    grouped GEMMs, and the bytes of live fake CUDA storages (``current``) and their ``peak``.

    Each live storage is tagged with the phase that made it (``build``, ``forward``,
    ``backward``, ``optimizer``, ``step``: outside those) and the op. At the first free after a
    new peak (a local maximum: the peak's moment) the live storages are copied, and at the next
    op classified (:meth:`classify`) into the memory plan's categories
    (``RankPlan.categories``): the storages of parameters, gradients, optimizer state, module
    and pipeline buffers found by reference (``owners``: :func:`_owned_storages`), the rest by
    phase (forward: ``activations``; else ``temporaries``). A copy is taken only when the peak
    grew ``SNAPSHOT_STEP`` over the last copy's (a bounded number of copies), so the categories
    are of a moment within that share of the peak."""

    SNAPSHOT_STEP = 0.002

    def __init__(self) -> None:
        self.syncs: Counter[str] = Counter()
        self.routed = 0  # the tokens × top-k the current MoE dispatch routes
        self.host_backend = False  # the job's groups have a host backend beside NCCL: host tensors valid
        # Each live fake CUDA storage, by its ``_cdata``: (bytes, phase that made it, op).
        self.live: dict[int, tuple[int, str, str]] = {}
        self.current = self.peak = 0
        self.collectives = 0
        self.grouped_mm = 0
        self.shadow = 0  # > 0 while DTensor propagates shapes on global-shape fakes of its own
        self.depth = 0  # > 0 inside an op (its decomposition's parts)
        self.sites = bool(os.environ.get("RAY_TITAN_DRY_RUN_SITES"))  # tag storages with their ray_titan line
        self.phase = "build"
        self.owners: Any = None  # () -> {storage key: category}, once the rank is built
        self.pending = False  # the peak grew since the last copy: copy at the next free
        self.raw: dict[int, tuple[int, str, str]] | None = None  # the copy, not yet classified
        self.snap_bytes = 0
        self.by_category: dict[str, int] = {}
        self.top_ops: list[tuple[str, str, int]] = []

    def count(self, t: Any, op: str) -> None:
        """Count the storage of fake CUDA tensor ``t`` (made by ``op``) once, until it is freed."""
        import weakref

        import torch

        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        phase = "backward" if torch._C._current_graph_task_id() != -1 else self.phase
        if self.sites:  # where it was made (a Python stack per storage: slow, for diagnosis)
            op = f"{op}@{_site()}"
        n = st.nbytes()
        self.live[key] = (n, phase, op)
        self._grow(n)
        weakref.finalize(st, self._free, key)

    def _grow(self, n: int) -> None:
        self.current += n
        if self.current > self.peak:
            self.peak = self.current
            self.pending = self.pending or self.peak > self.snap_bytes * (1 + self.SNAPSHOT_STEP)

    def _copy(self) -> None:
        """The live storages now (at a local maximum of a grown peak), for :meth:`classify`."""
        self.raw, self.pending, self.snap_bytes = dict(self.live), False, self.current

    def _free(self, key: int) -> None:
        if self.pending:
            self._copy()
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current -= entry[0]

    def resized(self, st: Any, nbytes: int) -> None:
        """FSDP2 frees and re-allocates its unsharded parameters by resizing their storage."""
        key = st._cdata
        entry = self.live.get(key)
        if entry is not None:
            if nbytes < entry[0] and self.pending:
                self._copy()
            self.live[key] = (nbytes, entry[1], "resize_" if nbytes else entry[2])
            self._grow(nbytes - entry[0])

    def classify(self) -> None:
        """Split the pending copy of the live storages into the plan's categories (class
        docstring): ``by_category`` (bytes) and ``top_ops`` (category, ``phase:op``, bytes: the
        largest makers of each category)."""
        raw, self.raw = self.raw, None
        if raw is None:
            return
        owned = self.owners() if self.owners is not None else {}
        cats: Counter[str] = Counter()
        makers: Counter[tuple[str, str]] = Counter()
        for key, (n, phase, op) in raw.items():
            cat = owned.get(key) or ("parameters" if op == "_to_copy(parameter)" else
                                     "activations" if phase == "forward" else "temporaries")
            cats[cat] += n
            makers[(cat, f"{phase}:{op}")] += n
        self.by_category = {c: cats.get(c, 0) for c in CATEGORIES}
        top: list[tuple[str, str, int]] = []
        for c in CATEGORIES:
            top += [(c, m, n) for (cc, m), n in makers.most_common() if cc == c][:4]
        self.top_ops = top

    def finish(self) -> None:
        """Classify the last copy (and the live storages, where the peak came last)."""
        if self.pending:
            self._copy()
        self.classify()


CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
"""The memory plan's categories of a peak (``ray_titan.preflight.memory_plan.RankPlan.categories``)."""


def _owned_storages(parts: Any) -> dict[int, str]:
    """Storage key -> category of the fake CUDA storages the rank holds by reference: optimizer
    state, gradients (FSDP2's sharded and unsharded ones, its accumulated unsharded ones),
    parameters (sharded, and FSDP2's all-gathered), module buffers and pipeline receive buffers
    (``temporaries``, as the plan counts them)."""
    import torch

    out: dict[int, str] = {}

    def add(t: Any, cat: str) -> None:
        t = getattr(t, "_local_tensor", t)
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            out.setdefault(t.untyped_storage()._cdata, cat)

    for state in parts.optimizer.state.values():
        for v in state.values():
            add(v, "optimizer_state")
    for stage in parts.stages.values():
        for m in stage.modules():
            for fp in (fp for g in _fsdp_param_groups(m) for fp in g.fsdp_params):
                unsharded = getattr(fp, "_unsharded_param", None)
                add(fp.unsharded_accumulated_grad, "gradients")
                add(fp.sharded_param.grad, "gradients")
                add(getattr(unsharded, "grad", None), "gradients")
                add(fp.sharded_param, "parameters")
                add(unsharded, "parameters")
                for t in fp.all_gather_outputs:
                    add(t, "parameters")
        for p in stage.parameters():
            add(p.grad, "gradients")
            add(p, "parameters")
        for b in stage.buffers():
            add(b, "temporaries")
    sched = parts.schedule
    for pstage in getattr(sched, "_stages", None) or ([sched._stage] if sched is not None else []):
        for infos in [*pstage.args_recv_info.values(), *pstage.grad_recv_info.values()]:
            for info in infos:
                add(getattr(info, "buffer", None), "temporaries")
    return out


def _fsdp_param_groups(module: Any) -> list[Any]:
    """The FSDP2 parameter groups of ``module`` (none unless it is an ``FSDPModule``): a list in
    ``FSDPState._fsdp_param_groups`` where torch has it, else (torch 2.11) at most one in
    ``_fsdp_param_group``."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return []
    state: Any = module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def _dry_run_mode(tally: _DeviceTally) -> Any:
    """A ``FakeTensorMode`` that reports every op to ``tally``: host reads answered 0 and counted,
    host memory pinning answered as done, collectives counted and given host tensors refused with
    :class:`HostCollectiveError`, outputs on the fake CUDA device counted as device memory. The
    class is made here because torch may be imported only after the shim (:func:`main`)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils._pytree import tree_leaves

    to_copy, Parameter = torch.ops.aten._to_copy.default, torch.nn.Parameter

    class DryRunMode(FakeTensorMode):
        """Fake tensors plus the NCCL check, host-sync counting and the device-memory count."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if tally.raw is not None:  # a peak's live storages, copied at a free: classified here
                tally.classify()
            ns = func.namespace
            if func is torch.ops.aten._grouped_mm.default:  # the experts' grouped GEMM (forward and backward)
                tally.grouped_mm += 1
            if func is torch.ops.aten._local_scalar_dense.default:
                tally.syncs[_site()] += 1
                return 0.0 if args[0].is_floating_point() else 0
            if func is torch.ops.aten._pin_memory.default:  # CPU offload pins host memory; fake has no pages
                return args[0]
            if func is torch.ops.aten.is_pinned.default:
                return True
            if ns in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
                tally.collectives += 1
                for t in tree_leaves((args, kwargs)) if not tally.host_backend else ():
                    if isinstance(t, torch.Tensor) and t.device.type != "cuda":
                        raise HostCollectiveError(
                            f"{func} on a {t.device.type} tensor {tuple(t.shape)} {t.dtype} over a device "
                            f"(NCCL) group, issued at {_site()}: NCCL has no CPU backend")
            tally.depth += 1
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                tally.depth -= 1
            if tally.shadow or tally.depth:
                # An op that fake mode decomposes runs its parts through here again: a GPU runs
                # it as one kernel, whose intermediates never reach the allocator. Only the
                # outermost op's outputs are device memory.
                return out
            # An fp32 parameter cast (autocast's cached bf16 weights): the plan counts it as parameters.
            op = "_to_copy(parameter)" if func is to_copy and isinstance(args[0], Parameter) else func.__name__
            for t in tree_leaves(out):
                if isinstance(t, FakeTensor) and t.device.type == "cuda":
                    tally.count(t, op)
            return out

    return DryRunMode(allow_non_fake_inputs=True)


def _install_torch_shims(mode: Any, tally: _DeviceTally) -> None:
    """Torch-side shims (module docstring): ``torch.tensor`` from host data made fake under
    ``mode``, storage resizes counted, device meshes built on real host tensors, fake parameters
    materialised by :func:`_fake_to_empty`, host lists of fake tensors answered by
    :func:`_balanced_tolist`, the MoE dispatch's routed tokens noted in ``tally``."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    import ray_titan.models.deepseek_v2.model as moe_model
    from ray_titan.parallel.dims import ParallelDims

    new_tensor, storage_resize = torch.tensor, torch.UntypedStorage.resize_
    mesh_init, build_mesh = DeviceMesh.__init__, ParallelDims.build_mesh
    module_to_empty, host_list, route_tokens = torch.nn.Module.to_empty, torch.Tensor.tolist, moe_model.route_tokens

    def tensor(data: Any, *a: Any, device: Any = None, **k: Any) -> torch.Tensor:
        with unset_fake_temporarily():  # from host data: then made fake, then moved
            t = new_tensor(data, *a, **k)
        t = mode.from_tensor(t)
        return t.to(device) if device is not None else t

    def resize(self: Any, nbytes: int) -> Any:
        out = storage_resize(self, nbytes)
        tally.resized(self, nbytes)
        return out

    def real_mesh_init(self: Any, *a: Any, **k: Any) -> None:
        with unset_fake_temporarily():  # a mesh's rank tables are real host tensors
            mesh_init(self, *a, **k)

    def real_build_mesh(self: Any, device_type: str) -> Any:
        with unset_fake_temporarily():  # init_device_mesh's rank tensor, before DeviceMesh.__init__
            return build_mesh(self, device_type)

    def to_empty(self: torch.nn.Module, *, device: Any, recurse: bool = True) -> torch.nn.Module:
        if not any(isinstance(p, FakeTensor) for p in self.parameters(recurse=recurse)):
            return module_to_empty(self, device=device, recurse=recurse)
        return _fake_to_empty(self, device, recurse)

    def tolist(self: torch.Tensor) -> Any:
        if not isinstance(self, FakeTensor):
            return host_list(self)
        tally.syncs[_site() + " (tolist)"] += 1
        return _balanced_tolist(self, tally.routed)

    def counted_route_tokens(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, *a: Any, **k: Any):
        tally.routed = x.shape[0] * indices.shape[1]
        return route_tokens(x, weights, indices, *a, **k)

    _patch(torch, "tensor", tensor)
    _patch(torch.UntypedStorage, "resize_", resize)
    _patch(DeviceMesh, "__init__", real_mesh_init)
    _patch(ParallelDims, "build_mesh", real_build_mesh)
    _patch(torch.nn.Module, "to_empty", to_empty)
    _patch(torch.Tensor, "tolist", tolist)
    _patch(FakeTensor, "tolist", tolist)  # its own answers element by element
    _patch(moe_model, "route_tokens", counted_route_tokens)
    _install_shard_shims()


def _install_shard_shims() -> None:
    """DTensor shards' shapes and offsets computed on real host tensors (DCP's save planning,
    ``init_weights``' shard copies): index arithmetic, which under fake mode costs a fake op each."""
    import torch
    import torch.distributed.checkpoint.planner_helpers as dcp_helpers
    import torch.distributed.tensor._utils as dtensor_utils
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor import DTensor

    import ray_titan.models.decoder as decoder

    shard_offsets = dtensor_utils.compute_local_shape_and_global_offset
    copy_full_into = decoder._copy_full_into

    def host_shard_offsets(*a: Any, **k: Any) -> Any:
        # A DTensor shard's global offsets are index arithmetic on host tensors (``arange``,
        # chunks, ``tolist``); under fake mode each op dispatches as a fake one: 175 of the 70B
        # rank's 242 profiled seconds went there (DCP's save planning, tp × FSDP strided shards).
        with unset_fake_temporarily():
            return shard_offsets(*a, **k)

    def copy_shard_into(param: torch.Tensor, full: torch.Tensor) -> None:
        # init_weights slices each full (here: fake) tensor into this rank's shard. The values
        # are meaningless on the fake device and the shard's shape is host arithmetic: copy a
        # tensor of that shape (a shard that does not fit the parameter fails as it would).
        if not isinstance(param, DTensor):
            return copy_full_into(param, full)
        shape, _ = host_shard_offsets(full.shape, param.device_mesh, param.placements)
        param.to_local().copy_(torch.empty(shape, dtype=full.dtype, device=full.device))

    _patch(decoder, "_copy_full_into", copy_shard_into)
    _patch(dtensor_utils, "compute_local_shape_and_global_offset", host_shard_offsets)
    _patch(dcp_helpers, "compute_local_shape_and_global_offset", host_shard_offsets)


def _fake_to_empty(module: Any, device: Any, recurse: bool) -> Any:
    """``module.to_empty(device=device)`` for parameters made under fake mode: they carry a weakref,
    so ``Module._apply`` cannot swap them for their materialised copies ("Couldn't swap
    Embedding.weight"), and on a one-rank mesh no FSDP2 materialises them first. New Parameters
    instead (tied ones stay one object); returns ``module``."""
    import torch

    new: dict[int, torch.nn.Parameter] = {}
    with torch.no_grad():
        for mod in module.modules() if recurse else [module]:
            for name, p in mod._parameters.items():
                if p is not None:
                    if id(p) not in new:
                        new[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=device),
                                                        requires_grad=p.requires_grad)
                    mod._parameters[name] = new[id(p)]
            for name, b in mod._buffers.items():
                if b is not None:
                    mod._buffers[name] = torch.empty_like(b, device=device)
    return module


def _balanced_tolist(t: Any, routed: int) -> Any:
    """The host list of fake tensor ``t`` (nested as its shape): 0.0 for a floating tensor, else
    ``routed`` tokens spread evenly over each row (the sent and the received counts of a MoE
    dispatch: balanced routing)."""
    import numpy as np

    n = max(1, t.shape[-1] if t.dim() else 1)
    total = 0 if t.is_floating_point() else routed
    flat = [total // n + (1 if i < total % n else 0) for i in range(n)] * (t.numel() // n)
    return np.array(flat).reshape(tuple(t.shape)).tolist()


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
        """The job of ``spec`` (config and overrides; ``host_backend`` None: the job's own)."""
        import torch

        from ray_titan.checkpoint.huggingface import job_model_args
        from ray_titan.config import load_config
        from ray_titan.parallel.dims import process_group_backend
        from ray_titan.parallel.fsdp import resolve_mixed_precision
        from ray_titan.trainer.build import parallel_dims

        cfg = load_config(spec["config"], spec["overrides"])
        # The groups a GPU job makes: with a host backend beside NCCL, host tensors are valid.
        host_backend = spec.get("host_backend")
        if host_backend is None:
            host_backend = "cpu:" in process_group_backend(True, cfg.memory.cpu_offload)
        dims = parallel_dims(cfg)
        margs = job_model_args(cfg)
        local_batch = cfg.training.global_batch_size // dims.dp
        sp = dims.tp > 1 and cfg.parallelism.sequence_parallel
        hidden = (local_batch // cfg.parallelism.microbatches, cfg.training.seq_len // (dims.tp if sp else 1),
                  margs.dim)
        # What a stage hands the next: bf16 where FSDP2 computes in bf16; fp32 otherwise (autocast's
        # residual stream stays fp32).
        bf16 = resolve_mixed_precision(cfg.training.mixed_precision, "cuda") == "bf16" and dims.fsdp
        return cls(spec["rank"], cfg, dims, margs, local_batch, host_backend, hidden,
                   torch.bfloat16 if bf16 else torch.float32)


def _install_pipeline_shims(job: _Job, tally: _DeviceTally) -> None:
    """Shims that need the job (module docstring): a pipeline stage's shape metadata answered
    without its neighbour (:func:`_install_stage_meta_shims`), DTensor's shape propagation not
    counted as device memory, attention on a fused kernel."""
    import torch
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def shadow_propagate(self: Any, op_schema: Any) -> Any:
        # DTensor derives an op's output shape by running it on fakes of the *global* shapes in
        # the active fake mode (this one): no GPU ever holds those, so they are not counted.
        tally.shadow += 1
        try:
            return propagate(self, op_schema)
        finally:
            tally.shadow -= 1

    _install_stage_meta_shims(job)
    _patch(ShardingPropagator, "_propagate_tensor_meta_non_cached", shadow_propagate)
    _patch(torch.nn.functional, "scaled_dot_product_attention", _fused_attention(torch))


def _install_stage_meta_shims(job: _Job) -> None:
    """A pipeline stage's shape metadata, which it exchanges with its neighbours before the first
    step, answered without them: ``job.hidden`` forward, the stage's own outputs backward. Torch
    exchanges it through ``PipelineStage._send_meta``/``_recv_meta`` where those exist; before
    them (torch 2.11) the stage's ``_shape_inference`` receives its inputs' metadata with
    ``dist.recv_object_list`` and sends its outputs' with ``dist.send_object_list`` (backward: its
    own outputs, nothing received), answered here in ``stage.py``'s namespace only."""
    import importlib

    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.pipelining import stage as pp_stage

    def hidden(device: Any) -> torch.Tensor:
        return torch.empty(job.hidden, device=device, dtype=job.hidden_dtype, requires_grad=True)

    _schedules_see_nccl()
    if hasattr(pp_stage.PipelineStage, "_recv_meta"):
        utils: Any = importlib.import_module("torch.distributed.pipelining._utils")

        def recv_meta(self: Any, src: int) -> Any:
            if src < self.stage_index:
                metas = utils.extract_tensor_metas((hidden(self.device),))
                return utils._StageForwardMeta(forward_metas=metas or ())
            return utils._StageBackwardMeta(backward_metas=self._stage_meta.outputs)

        _patch(pp_stage.PipelineStage, "_send_meta", lambda self, meta, dst_stage: None)
        _patch(pp_stage.PipelineStage, "_recv_meta", recv_meta)
        return

    def recv_object_list(objects: list[Any], *a: Any, **k: Any) -> None:
        with unset_fake_temporarily():  # what the neighbour sends: its outputs moved to ``meta``
            objects[0] = (hidden("meta").detach(),)

    _patch(pp_stage, "dist", _Overlay(pp_stage.dist, recv_object_list=recv_object_list,
                                      send_object_list=lambda *a, **k: None))


def _schedules_see_nccl() -> None:
    """The pipeline schedules see the job's groups as NCCL, not the fake backend they run on:
    where the schedules read the backend (torch 2.15) they refuse shape inference over a fake
    group, which the stage shims above answer, and skip the steps a GPU job takes at its first
    step (the stages' vote on the inference mode, warming up the point-to-point links); run over
    the fake group, those are simulated and checked as the rest."""
    from torch.distributed.pipelining import schedules

    real = schedules.dist

    def get_backend(group: Any = None) -> Any:
        backend = real.get_backend(group)
        return "nccl" if str(backend) == "fake" else backend

    _patch(schedules, "dist", _Overlay(real, get_backend=get_backend))


class _Overlay:
    """``base``'s attributes, but those given as keywords replaced (a module seen through it)."""

    def __init__(self, base: Any, **replaced: Any) -> None:
        self._base = base
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


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
            tally.phase = "forward"
            train_step(parts, tokens, tokens, step, cfg.parallelism.microbatches, cfg.training.max_norm)
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
        checkpoint = _plan_checkpoint(cfg, parts, loader, job.margs.vocab_size, steps)
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


def _device_bytes(tensors: Any) -> int:
    """Bytes of the distinct device storages of ``tensors`` (views share one; DTensors by their
    local shard; host tensors and ``None`` not counted)."""
    import torch

    from ray_titan.parallel import local_tensor

    storages = {local_tensor(t).untyped_storage()._cdata: local_tensor(t).untyped_storage().nbytes()
                for t in tensors if isinstance(t, torch.Tensor) and local_tensor(t).device.type == "cuda"}
    return sum(storages.values())


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
