"""What the dry run counts on the fake device: host reads, collectives, grouped GEMMs and device memory.

:class:`_DeviceTally` is told of every op by the fake tensor mode (:mod:`.fake_device`) and of every
storage resize; it keeps the bytes of live fake CUDA storages, their peak and what held it, by
the memory plan's categories (:data:`CATEGORIES`: the storages a rank holds by reference,
:func:`_owned_storages`, the rest by the phase that made them). Nothing here imports torch at
module level: the rank's process loads the fake CUDA library first (:mod:`.rank`).
"""

from __future__ import annotations

import os
import traceback
from collections import Counter
from typing import Any

__all__ = ["CATEGORIES"]


def _site() -> str:
    """The innermost ray_titan frame of the current stack, ``path:line`` below the package."""
    frames = [f for f in traceback.extract_stack() if f"{os.sep}ray_titan{os.sep}" in f.filename
              and f"{os.sep}dry_run{os.sep}" not in f.filename]
    if not frames:
        return "(outside ray_titan)"
    f = frames[-1]
    return f"{f.filename.rsplit(os.sep + 'ray_titan' + os.sep, 1)[-1]}:{f.lineno}"


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


def _device_bytes(tensors: Any) -> int:
    """Bytes of the distinct device storages of ``tensors`` (views share one; DTensors by their
    local shard; host tensors and ``None`` not counted)."""
    import torch

    from ray_titan.parallel import local_tensor

    storages = {local_tensor(t).untyped_storage()._cdata: local_tensor(t).untyped_storage().nbytes()
                for t in tensors if isinstance(t, torch.Tensor) and local_tensor(t).device.type == "cuda"}
    return sum(storages.values())
