"""The simulated CUDA device as torch sees it: ``torch.cuda`` answered as an H100, fake tensors, shims.

A rank's ops run under :func:`_dry_run_mode` (PyTorch's ``FakeTensorMode``: shapes, dtypes and
devices, no data), which checks every collective as NCCL would, answers host reads and reports
each op to the tally (:mod:`.tally`). ``torch.cuda``'s Python functions are answered with an
H100's constants (:func:`_stub_torch_cuda`), a CPU build gets placeholder CUDA kernels
(:func:`_register_cuda_kernels`), and the shims below make torch's and ray_titan's host-side
work on fake tensors run as on a GPU (:mod:`.rank`'s docstring lists each and why). Nothing here
imports torch at module level: the rank's process loads the fake CUDA library first.
"""

from __future__ import annotations

from typing import Any

from ray_titan.dry_run.tally import _DeviceTally, _site

__all__ = ["H100", "HostCollectiveError"]

H100 = {"name": "NVIDIA H100 80GB HBM3 (simulated)", "major": 9, "minor": 0, "total_memory": 80 * 2**30,
        "multi_processor_count": 132}


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
    # A tensor used on another stream (activation offloading's copies) is marked so for the caching
    # allocator; the stub streams are not torch.Stream, and the fake device frees at once.
    _patch(torch.Tensor, "record_stream", lambda self, stream: None)
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
    both as PyTorch does). A ``CausalBias`` (context parallel's lower-right causal chunks) is a
    causal mask no kernel materialises: taken as ``is_causal`` (the same tensors saved)."""
    from torch.nn.attention.bias import CausalBias

    aten = torch.ops.aten

    def sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
             scale: float | None = None, enable_gqa: bool = False) -> Any:
        if isinstance(attn_mask, CausalBias):
            attn_mask, is_causal = None, True
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


def _install_op_shims(tally: _DeviceTally) -> None:
    """Shims of what an op computes (module docstring of :mod:`.rank`): DTensor's shape
    propagation not counted as device memory, attention on a fused kernel."""
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

    _patch(ShardingPropagator, "_propagate_tensor_meta_non_cached", shadow_propagate)
    _patch(torch.nn.functional, "scaled_dot_product_attention", _fused_attention(torch))
