"""Activation offloading: the tensors chosen transformer blocks save for backward live in host memory
between their forward and their backward (``memory.activation_offload``; docs/memory.md).

Built on autograd's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``), the
mechanism of torch's own ``torch.autograd.graph.save_on_cpu``, which copies synchronously; here,
as torchtune's ``OffloadActivations`` does (torchtune 0.6, ``training/_activation_offloading.py``,
read for the design, not copied), on CUDA:

- **pack** (forward, each tensor a block saves): the copy into a pinned host tensor runs on a side
  stream that first waits for the compute stream, so it overlaps the compute that follows. The
  device tensor stays referenced by its block's group until the compute stream has waited for the
  group's copies, which it does when the block ``FORWARD_LAG + 1`` blocks later starts its forward
  (any block of the stage, offloaded or not): at most ``FORWARD_LAG + 1`` blocks' saved tensors
  are still on the device in forward, whatever the host link's speed. Marking the tensor as used by the side
  stream (``Tensor.record_stream``), as a first version did, bounds nothing: where the copies are
  slower than the compute, the freed blocks wait for them while compute allocates new ones. torchtune
  bounds its forward stash the same way (``max_fwd_stash_size``). Parameters, buffers (their
  storages: FSDP2's unsharded weights, the rotary tables), autocast's copies of the weights
  (:func:`_weight_copy`) and tensors under :data:`MIN_OFFLOAD_BYTES` stay where they are.
- **prefetch**: when the gradient of a block's output arrives (its backward is next), that
  block's tensors and those of the block before it (the next backward) are copied back on the
  side stream into device tensors allocated on the compute stream (the caching allocator keeps a
  pool per stream: tensors allocated on the side stream would return to its pool, which compute
  never reuses), so the copy of block ``k − 1`` overlaps block ``k``'s backward. The compute
  stream waits for the copy before it uses the tensor, so freeing it after use is safe without
  ``record_stream``; a copy no unpack takes makes the compute stream wait for it when its handle
  ends. (``record_stream`` held every freed copy until the side stream had caught up with the
  host, which queues the whole backward ahead of the device: on an H200 the copies back of all 14
  copied blocks, 14,407 MiB, were live at once, the peak 1.08× no offloading;
  benchmarks/results/2026-11-28-gpu-levers-h200.md.)
  A block whose device tensors are still held (the last ones of the forward) hands those over
  without a copy.
- **unpack** (backward): the compute stream waits for the prefetch's event and takes the device
  tensor; a tensor not prefetched is copied back on the compute stream. The host copy stays
  until autograd drops the saved tensor (a graph kept with ``retain_graph``, the zero-bubble
  schedules' split backward, unpacks twice).

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

import collections
import functools
import weakref
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

__all__ = ["FORWARD_LAG", "MIN_OFFLOAD_BYTES", "ActivationOffloader", "OffloadStats", "apply_activation_offload",
           "offloads"]

MIN_OFFLOAD_BYTES = 1024
"""Saved tensors smaller than this stay on the device (a copy's fixed cost outweighs them;
torchtune's ``min_offload_size``)."""

FORWARD_LAG = 1
"""Blocks whose copies to the host may still run when a block's forward starts: block ``k``'s
forward (offloaded or not) first waits for the copies of the blocks up to ``k − 1 − FORWARD_LAG``
and lets go of their device tensors. 1 lets block ``k − 1``'s copies overlap block ``k``'s compute."""


@dataclass
class OffloadStats:
    """What the hooks did since the last :meth:`ActivationOffloader.reset`: tensors packed (to be
    moved: saves, a tensor saved by several ops counted each time) and the bytes copied (each
    tensor once per block forward: ``copies``), tensors left on the device, tensors unpacked,
    copies prefetched, device tensors handed back without a copy (still held from the forward),
    block backwards announced (the output-gradient hook) and the most blocks whose device tensors
    the forward held at once (``held_blocks``: :data:`FORWARD_LAG` + 1 at most)."""

    packed: int = 0
    copies: int = 0
    packed_bytes: int = 0
    kept: int = 0
    unpacked: int = 0
    prefetched: int = 0
    reused: int = 0
    backward_hooks: int = 0
    held_blocks: int = 0


class _Handle:
    """One saved tensor moved to the host: the pinned copy, the device it came from, the saves
    that share it (``uses``, the unpacks still to come), the device tensor while its copy may
    still run (``held``), and, once prefetched, the device copy and the event that ends its copy
    (None: nothing to wait for)."""

    __slots__ = ("__weakref__", "device", "event", "held", "host", "nbytes", "on_device", "stream", "uses")

    def __init__(self, host: torch.Tensor, device: torch.device, nbytes: int, held: torch.Tensor | None = None) -> None:
        self.host = host
        self.device = device
        self.nbytes = nbytes
        self.uses = 1
        self.held = held  # the device tensor, until the compute stream has waited for its copy
        self.on_device: torch.Tensor | None = None
        self.event: Any = None
        self.stream: Any = None  # the stream whose pool the device copy returns to (compute's)

    def __del__(self) -> None:
        # A prefetched copy no unpack took (the graph died first) may still be being written by
        # the side stream: the compute stream, which may reuse its memory now, waits for that
        # copy first. (Marking it used by the side stream instead, record_stream, kept every
        # prefetched block from reuse until the side stream caught up with the host, which in
        # backward runs far ahead: on an H200 the whole stage's activations were back at once.)
        if self.on_device is not None and self.event is not None and self.stream is not None:
            try:
                self.stream.wait_event(self.event)
            except Exception:  # interpreter shutdown: nothing runs on the device any more
                pass

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
        self.copied: Any = None  # the side stream's event after this block's last copy to the host
        self.order = 0  # the stage's block forward it belongs to (ActivationOffloader._started)
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
        self._holding: collections.deque[_Group] = collections.deque()  # forward's groups, oldest first
        self._started = 0  # block forwards started on this stage (offloaded or not), in order

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
        if nbytes < self.min_bytes or _storage_key(t) in skip or _weight_copy(t):
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
            host = torch.empty_like(t).copy_(t)
        else:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                host = torch.empty_like(t, device="cpu", pin_memory=True)
                host.copy_(t, non_blocking=True)
                group.copied = stream.record_event()
        handle = _Handle(host, t.device, nbytes, held=t)
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
            if packed.event is not None:
                current.wait_event(packed.event)
            return t
        if packed.held is not None:  # not prefetched, still on the device
            return packed.held
        current.wait_stream(self._side_stream())  # the copy to the host is done
        return packed.host.to(packed.device, non_blocking=True)

    def _block_starts(self) -> None:
        """A block's forward starts (any block of the stage): let go of the device tensors of the
        groups more than :data:`FORWARD_LAG` block forwards old, once the compute stream has
        waited for their copies to the host."""
        self._started += 1
        while self._holding and self._holding[0].order < self._started - FORWARD_LAG:
            group = self._holding.popleft()
            if group.copied is not None:
                torch.cuda.current_stream().wait_event(group.copied)
            for ref in group.handles:
                handle = ref()
                if handle is not None:
                    handle.held = None

    def _prefetch(self, group: _Group | None) -> None:
        if group is None or group.fetched:
            return
        # Once: a second backward over the graph (a zero-bubble schedule's weight step) may not
        # unpack every tensor, and a copy no unpack takes would stay until the graph dies.
        group.fetched = True
        if group in self._holding:  # its device tensors are handed over below
            self._holding.remove(group)
        for ref in group.handles:
            handle = ref()
            if handle is None or handle.on_device is not None:
                continue
            if handle.held is not None:  # still on the device: no copy back
                # Its copy to the host may still read it: the unpack waits for that copy.
                handle.on_device, handle.held, handle.event = handle.held, None, group.copied
                handle.stream = torch.cuda.current_stream() if handle.device.type == "cuda" else None
                self.stats.reused += 1
                continue
            self.stats.prefetched += 1
            if handle.device.type != "cuda":  # copy_on_host
                handle.on_device = torch.empty_like(handle.host).copy_(handle.host)
                continue
            # Allocated on the compute stream, so that its memory returns to compute's pool.
            on_device = torch.empty_like(handle.host, device=handle.device)
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                on_device.copy_(handle.host, non_blocking=True)
                handle.event = stream.record_event()
            handle.on_device = on_device  # freed untaken: the handle's end waits for the copy
            handle.stream = torch.cuda.current_stream()

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

    def count(self, block: nn.Module) -> None:
        """Count ``block``'s forwards (a block of the stage whose tensors stay) among the block
        forwards that release the held groups (:data:`FORWARD_LAG`): replaced on the instance,
        as :meth:`wrap` does, so a recomputing backward, which calls the inner forward, counts none."""
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            self._block_starts()
            return inner(*args, **kwargs)

        block.forward = forward

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
            self._block_starts()
            group.order = self._started
            self._holding.append(group)
            self.stats.held_blocks = max(self.stats.held_blocks, len(self._holding))
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


_CAST_OR_VIEW = frozenset({"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0",
                           "ViewBackward0", "UnsafeViewBackward0", "ExpandBackward0", "AliasBackward0"})
"""Autograd nodes of a cast or a view: what ``torch.autocast`` does to a weight before a matmul."""


def _weight_copy(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter cast or viewed (``torch.autocast``'s bf16 copy of a weight, its
    transpose): its autograd history is casts and views down to a parameter's gradient
    accumulator. Those stay on the device: autocast's cache holds them through the forward anyway,
    and the memory plan counts them there (on an H200 they were 1.95 of the 17.3 GB a step's
    offloading of the 1B shape moved, benchmarks/results/2026-11-28-gpu-levers-h200.md)."""
    fn = t.grad_fn
    for _ in range(4):
        if fn is None:
            return False
        if type(fn).__name__ == "AccumulateGrad":
            return isinstance(getattr(fn, "variable", None), nn.Parameter)
        if type(fn).__name__ not in _CAST_OR_VIEW:
            return False
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return False


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
    for key, block in layers.items():  # the other blocks' forwards advance the lag too
        if not offloads(setting, int(key)):
            offloader.count(block)
    return offloader
