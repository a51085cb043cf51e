"""Activation offloading: the tensors chosen transformer blocks save for backward live in host memory
between their forward and their backward (``memory.activation_offload``; docs/memory.md).

Built on autograd's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``), the
mechanism of torch's own ``torch.autograd.graph.save_on_cpu``, which copies synchronously; here,
as torchtune's ``OffloadActivations`` does (torchtune 0.6, ``training/_activation_offloading.py``,
read for the design, not copied), on CUDA:

- **pack** (forward, each tensor a block saves): the copy into a pinned host tensor runs on a side
  stream that first waits for the compute stream, so it overlaps the compute that follows; the
  device tensor is marked as used by the side stream (``Tensor.record_stream``) and dropped, so
  the caching allocator reuses its memory once the copy is done. Parameters, buffers (their
  storages: FSDP2's unsharded weights, the rotary tables) and tensors under
  :data:`MIN_OFFLOAD_BYTES` stay where they are.
- **prefetch**: when the gradient of a block's output arrives (its backward is next), that
  block's tensors and those of the block before it (the next backward) are copied back on the
  side stream, so the copy of block ``k − 1`` overlaps block ``k``'s backward.
- **unpack** (backward): the compute stream waits for the prefetch's event and takes the device
  tensor (marked as used by the compute stream); a tensor not prefetched is copied back on the
  compute stream. The host copy stays until autograd drops the saved tensor (a graph kept with
  ``retain_graph``, the zero-bubble schedules' split backward, unpacks twice).

Pinned host memory comes from torch's caching host allocator, which keeps freed blocks for the
next step: host memory rises over the first step and then stays flat (no leak for the verdict of
``ray_titan.metrics.collector.leak``). On a host device (CPU) the hooks run and count what they
would move (:class:`OffloadStats`) but move nothing.

Composition with activation checkpointing (``ray_titan.parallel.ac``): the hooks are installed
around the (checkpointed) forward of the block, so they see what autograd saves outside
``torch.utils.checkpoint``'s own hooks: under ``full`` AC the block's input only (the
recomputation's tensors exist only in backward), under selective ``op`` the block input as well,
while the op outputs selective checkpointing caches stay on the device.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

__all__ = ["MIN_OFFLOAD_BYTES", "ActivationOffloader", "OffloadStats", "apply_activation_offload", "offloads"]

MIN_OFFLOAD_BYTES = 1024
"""Saved tensors smaller than this stay on the device (a copy's fixed cost outweighs them;
torchtune's ``min_offload_size``)."""


@dataclass
class OffloadStats:
    """What the hooks did since the last :meth:`ActivationOffloader.reset`: tensors packed (to be
    moved: saves, a tensor saved by several ops counted each time) and the bytes copied (each
    tensor once per block forward: ``copies``), tensors left on the device, tensors unpacked,
    copies prefetched and block backwards announced (the output-gradient hook)."""

    packed: int = 0
    copies: int = 0
    packed_bytes: int = 0
    kept: int = 0
    unpacked: int = 0
    prefetched: int = 0
    backward_hooks: int = 0


class _Handle:
    """One saved tensor moved to the host: the pinned copy, the device it came from, the saves
    that share it (``uses``, the unpacks still to come), and, once prefetched, the device copy and
    the event that ends its copy."""

    __slots__ = ("__weakref__", "device", "event", "host", "nbytes", "on_device", "uses")

    def __init__(self, host: torch.Tensor, device: torch.device, nbytes: int) -> None:
        self.host = host
        self.device = device
        self.nbytes = nbytes
        self.uses = 1
        self.on_device: torch.Tensor | None = None
        self.event: Any = None

    def take(self) -> torch.Tensor | None:
        """The prefetched device copy for one unpack (None: not prefetched), dropped after the
        last of its saves' unpacks."""
        t = self.on_device
        self.uses -= 1
        if self.uses <= 0:
            self.on_device = None
        return t


class _Group:
    """The handles of one forward call of one block (weak: autograd owns them), its layer index,
    and the group made just before it (weak), the next block to run backward."""

    def __init__(self, layer: int, prev: _Group | None) -> None:
        self.layer = layer
        self.handles: list[weakref.ref[_Handle]] = []
        self.prev = weakref.ref(prev) if prev is not None else None
        self.fetched = False  # prefetched once: a second backward (retain_graph) copies on demand
        # While the block's forward runs: the tensors copied so far, by storage and view, with a
        # weak reference to the tensor (alive: the storage is not another's yet), so that a
        # tensor several ops save (a norm's output, the input of q, k and v) is copied once.
        self.seen: dict[tuple, tuple[weakref.ref[torch.Tensor], _Handle]] = {}


class ActivationOffloader:
    """The hooks of one stage module (module docstring): saved tensors on a CUDA device move to
    pinned host memory and back, those on a host device are counted only. ``min_bytes``: smaller
    tensors stay. ``copy_on_host``: copy host tensors too (into a new host tensor, and back into
    another), so that the handles, the prefetch and the unpack run on a CPU (the tests)."""

    def __init__(self, min_bytes: int = MIN_OFFLOAD_BYTES, copy_on_host: bool = False) -> None:
        self.min_bytes = min_bytes
        self.copy_on_host = copy_on_host
        self.stats = OffloadStats()
        self._stream: Any = None
        self._last: weakref.ref[_Group] | None = None

    def reset(self) -> OffloadStats:
        """Return the counts so far and start new ones."""
        stats, self.stats = self.stats, OffloadStats()
        return stats

    def _side_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _pack(self, group: _Group, skip: set[int], t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or _storage_key(t) in skip:
            self.stats.kept += 1
            return t
        self.stats.packed += 1
        key = (_storage_key(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        ref, seen = group.seen.get(key, (None, None))
        if ref is not None and seen is not None and ref() is not None:
            seen.uses += 1
            return seen
        self.stats.copies += 1
        self.stats.packed_bytes += nbytes
        if t.device.type != "cuda":
            if not self.copy_on_host:
                group.seen[key] = (weakref.ref(t), _Handle(t, t.device, 0))  # counted once; never returned
                return t  # on a host device there is nowhere to move it
            handle = _Handle(torch.empty_like(t).copy_(t), t.device, nbytes)
        else:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                host = torch.empty_like(t, device="cpu", pin_memory=True)
                host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # its memory is reused only once the copy is done
            handle = _Handle(host, t.device, nbytes)
        group.handles.append(weakref.ref(handle))
        group.seen[key] = (weakref.ref(t), handle)
        return handle

    def _unpack(self, packed: Any) -> torch.Tensor:
        self.stats.unpacked += 1
        if not isinstance(packed, _Handle):
            return packed
        t = packed.take()
        if packed.device.type != "cuda":  # copy_on_host
            return t if t is not None else torch.empty_like(packed.host).copy_(packed.host)
        current = torch.cuda.current_stream()
        if t is not None:
            current.wait_event(packed.event)
            t.record_stream(current)
            return t
        current.wait_stream(self._side_stream())  # the copy to the host is done
        return packed.host.to(packed.device, non_blocking=True)

    def _prefetch(self, group: _Group | None) -> None:
        if group is None or group.fetched:
            return
        # Once: a second backward over the graph (a zero-bubble schedule's weight step) may not
        # unpack every tensor, and a copy no unpack takes would stay until the graph dies.
        group.fetched = True
        for ref in group.handles:
            handle = ref()
            if handle is None or handle.on_device is not None:
                continue
            self.stats.prefetched += 1
            if handle.device.type != "cuda":  # copy_on_host
                handle.on_device = torch.empty_like(handle.host).copy_(handle.host)
                continue
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                handle.on_device = handle.host.to(handle.device, non_blocking=True)
                handle.event = stream.record_event()

    def _backward_starts(self, group: _Group) -> None:
        """The gradient of ``group``'s block output arrived: bring back its tensors and those of
        the block before it (the next backward)."""
        self.stats.backward_hooks += 1
        self._prefetch(group)
        prev = group.prev() if group.prev is not None else None
        if prev is not None and prev.layer < group.layer:
            self._prefetch(prev)

    def _on_output_grad(self, group: _Group, grad: torch.Tensor) -> None:
        self._backward_starts(group)

    def wrap(self, block: nn.Module, layer: int, root: nn.Module) -> None:
        """Install the hooks around ``block``'s forward (replaced on the instance, as activation
        checkpointing does, so parameter names stay); ``root``: the stage module, whose buffers
        outside the blocks (the rotary tables) stay on the device too."""
        inner = block.forward
        outer = weakref.ref(root)

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            last = self._last() if self._last is not None else None
            group = _Group(layer, last)
            self._last = weakref.ref(group)
            skip = {_storage_key(t) for t in [*block.parameters(), *block.buffers()]}
            stage = outer()
            if stage is not None:
                skip |= {_storage_key(b) for name, b in stage.named_buffers() if not name.startswith("layers.")}
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, group, skip), self._unpack):
                out = inner(*args, **kwargs)
            group.seen.clear()
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(functools.partial(self._on_output_grad, group))
            return out

        block.forward = forward


def _storage_key(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage (a DTensor's local shard's): the same for every view of it."""
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        t = local
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):  # no storage (e.g. a nested or sparse tensor)
        return id(t)


def offloads(setting: str | int, layer: int) -> bool:
    """Whether ``memory.activation_offload = setting`` moves the saved activations of block
    ``layer`` (its index in the whole model) to host memory: never (``none``), always (``all``),
    or for the first ``setting`` blocks."""
    return setting == "all" or (setting != "none" and layer < int(setting))


def apply_activation_offload(model: nn.Module, setting: str | int, min_bytes: int = MIN_OFFLOAD_BYTES,
                             copy_on_host: bool = False) -> ActivationOffloader | None:
    """Offload the saved activations of the blocks of ``model.layers`` (a ``ModuleDict`` keyed by
    the layer's index in the whole model) that ``setting`` (``memory.activation_offload``,
    :func:`offloads`) chooses, in place: tensors on a CUDA device move, others are only counted.
    ``min_bytes``, ``copy_on_host``: as :class:`ActivationOffloader`'s. Returns the hooks' owner
    (its ``stats``), or None where no block of this stage is chosen.
    Apply after activation checkpointing and before FSDP2."""
    layers = cast(nn.ModuleDict, model.layers)
    blocks = [(int(k), b) for k, b in layers.items() if offloads(setting, int(k))]
    if not blocks:
        return None
    offloader = ActivationOffloader(min_bytes=min_bytes, copy_on_host=copy_on_host)
    for layer, block in blocks:
        offloader.wrap(block, layer, model)
    return offloader
