"""Parallel dimensions and the device mesh.

The mesh is ``(pp, dp_replicate, dp_shard, cp, tp)`` with those axis names (docs/design.md,
Contracts; torchtitan's order), row-major, so global rank ``r`` has coordinates
``tp = r % tp``, ``cp = (r // tp) % cp``, ``dp_shard = (r // (tp·cp)) % dp_shard``,
``dp_replicate = (r // (tp·cp·dp_shard)) % dp_replicate`` and ``pp = r // (tp·cp·dp_shard·dp_replicate)``:
the ranks of one tensor-parallel group are consecutive (on one node, on the fastest links), then
those of one context-parallel group, then those of one FSDP shard group, then the replicas (HSDP:
replicate across nodes, shard within), then the pipeline stages. With ``tp = cp = dp_replicate =
1`` this is the ``(pp, dp_shard)`` layout of earlier versions, rank for rank.

Context parallelism (``cp``, ``ray_titan.parallel.context``) splits every sequence over the cp
ranks of one data-parallel rank: they read the same batch and each keeps its load-balanced share
of the tokens. Parameters are FSDP-sharded over ``dp_shard × cp`` (torchtitan's ``dp_shard_cp``),
so the gradients of the cp ranks' different tokens are averaged as those of different
data-parallel ranks are.

Expert parallelism borrows its ranks from ``dp_shard``: with ``ep > 1`` the ``dp_shard`` axis is
unflattened into ``(dp_shard_mod_ep, ep)``, so the ``ep`` coordinate is ``dp_shard % ep``
(consecutive data-parallel ranks exchange tokens) and routed experts are FSDP-sharded over
``dp_shard_mod_ep`` (what is left of ``dp_shard``; with ``dp_replicate`` too under HSDP). EP never
spans ``tp``, ``dp_replicate`` or ``pp``: under tensor parallel every tp rank of a group holds all
of its DP rank's tokens and the same experts' ``1/tp`` slices (the routed experts are
tensor-parallel over ``tp`` as well: expert-tensor parallel), so the tp ranks dispatch the same
tokens over their own ``ep`` groups and no expert's work is repeated.

Nor does EP span ``cp``: an ``ep`` group is the ranks of one cp coordinate (each routes its own
slice of the sequences; dispatch is per token, so the slices need nothing more), and the routed
experts are FSDP-sharded over ``dp_shard_mod_ep × cp`` (flattened as ``dp_shard_mod_ep_cp``), as
every other parameter is over ``dp_shard × cp``. torchtitan 0.3.0 instead lets EP borrow from
``dp_shard × cp`` (× ``tp``) together; keeping it within ``dp_shard`` keeps each token exchange
inside one cp rank's data and the expert-tensor-parallel layout of the routed experts unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ray_titan.parallel.schedules import SCHEDULES

if TYPE_CHECKING:
    from ray_titan.config.schema import JobConfig

__all__ = ["Meshes", "ParallelDims", "process_group_backend"]

Meshes = dict[str, DeviceMesh]
"""The meshes of a job by name (:meth:`ParallelDims.build_mesh`)."""


def process_group_backend(use_gpu: bool, cpu_offload: bool) -> str:
    """The ``torch.distributed`` backend of a job's process groups: ``gloo`` on CPU, ``nccl`` on
    GPUs, and ``cuda:nccl,cpu:gloo`` on GPUs with ``memory.cpu_offload``, whose gradient-norm and
    tied-embedding reductions run on host tensors (FSDP2's offloaded shards), which NCCL cannot
    reduce (as torchtitan does; found by ``ray-titan dry-run``)."""
    if not use_gpu:
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the mesh axes, the pipeline's stages per rank, and the mapping of stages to ranks.

    Axes: ``pp`` (pipeline), ``dp_replicate`` (HSDP replicas), ``dp_shard`` (FSDP2 sharding),
    ``cp`` (context parallel: the sequence split), ``tp`` (tensor and sequence parallel); world
    size = ``pp × dp_replicate × dp_shard × cp × tp``.

    ``ep`` (expert parallel) borrows ranks from ``dp_shard`` only: it must divide ``dp_shard``
    (module docstring: why not ``tp`` or ``cp``).

    Stage placement (``pp_style``):

    - ``"loop"`` (GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble): stage ``s`` is on pp rank
      ``s % pp``; the last stage is on pp rank ``pp - 1``.
    - ``"v"`` (ZBVZeroBubble, DualPipeV): two stages per rank, pp rank ``r`` holds stages ``r``
      and ``2·pp − 1 − r``, so the first and the last stage are both on pp rank 0.

    The last-stage ranks are derived from that mapping, never from a schedule's name.

    Raises ``ValueError`` for a size < 1, an ``ep`` that does not divide ``dp_shard``, an unknown
    style, or a V-shaped placement with ``stages_per_rank != 2``.
    """

    pp: int = 1
    dp_shard: int = 1
    stages_per_rank: int = 1
    ep: int = 1
    tp: int = 1
    dp_replicate: int = 1
    pp_style: Literal["loop", "v"] = "loop"
    cp: int = 1

    AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

    def __post_init__(self):
        for name in (*self.AXES, "ep", "stages_per_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be >= 1")
        if self.dp_shard % self.ep:
            raise ValueError(f"ep = {self.ep} must divide dp_shard = {self.dp_shard} (EP borrows dp_shard's ranks)")
        if self.pp_style not in ("loop", "v"):
            raise ValueError(f"pp_style = {self.pp_style!r}; valid: 'loop', 'v'")
        if self.pp_style == "v" and self.stages_per_rank != 2:
            raise ValueError(f"a V-shaped stage placement needs stages_per_rank = 2, got {self.stages_per_rank}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: ``dp_replicate × dp_shard`` (the data loader's; the cp ranks of a
        data-parallel rank read the same batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shard(self) -> int:
        """The ranks FSDP2 shards parameters over: ``dp_shard × cp`` (torchtitan's ``dp_shard_cp``)."""
        return self.dp_shard * self.cp

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 (or HSDP) wraps the model: more than one data-parallel or context-parallel
        rank (FSDP2 shards over ``dp_shard × cp`` and averages the gradients over them)."""
        return self.dp * self.cp > 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of global ``rank`` on each mesh axis, by axis name: ``pp`` and ``dp_shard``
        always, ``dp_replicate``, ``cp``, ``tp`` and ``ep`` only when > 1 (so dense jobs' messages stay short)."""
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        shard, rest = rest % self.dp_shard, rest // self.dp_shard
        rep, pp = rest % self.dp_replicate, rest // self.dp_replicate
        coords = {"pp": pp}
        if self.dp_replicate > 1:
            coords["dp_replicate"] = rep
        coords["dp_shard"] = shard
        if self.cp > 1:
            coords["cp"] = cp
        if self.tp > 1:
            coords["tp"] = tp
        if self.ep > 1:
            coords["ep"] = shard % self.ep
        return coords

    def describe(self) -> str:
        """The mesh in words, e.g. ``"pp=2 × dp_shard=2"`` or ``"pp=1 × dp_replicate=2 × dp_shard=2 ×
        tp=2, ep=2"``: ``pp`` and ``dp_shard`` always, the other axes when > 1."""
        axes = [f"{a}={getattr(self, a)}" for a in self.AXES if a in ("pp", "dp_shard") or getattr(self, a) > 1]
        return " × ".join(axes) + (f", ep={self.ep}" if self.ep > 1 else "")

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global ``rank`` (``dp_replicate · dp_shard + dp_shard``), in
        ``[0, dp)``: the tp ranks of one group and the pp ranks of one pipeline share it."""
        c = self.coords(rank)
        return c.get("dp_replicate", 0) * self.dp_shard + c["dp_shard"]

    def stage_to_pp_rank(self, stage: int) -> int:
        """The pp rank holding pipeline stage ``stage`` (class docstring: loop or V placement)."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside 0 .. {self.num_stages - 1}")
        if self.pp_style == "v":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def stage_to_rank_mapping(self) -> dict[int, int]:
        """``{stage: pp rank}`` for every stage (the form of the pipeline schedules'
        ``stage_index_to_group_rank``)."""
        return {s: self.stage_to_pp_rank(s) for s in range(self.num_stages)}

    def stages_on_pp_rank(self, pp_rank: int) -> list[int]:
        """Stage indices held by ``pp_rank``, in increasing order."""
        return [s for s in range(self.num_stages) if self.stage_to_pp_rank(s) == pp_rank]

    def is_last_stage_rank(self, rank: int) -> bool:
        """Whether global ``rank`` holds the last pipeline stage."""
        return self.coords(rank)["pp"] == self.stage_to_pp_rank(self.num_stages - 1)

    def last_stage_ranks(self) -> list[int]:
        """Global ranks that hold the last pipeline stage: one per DP rank and tp rank (the tp
        ranks of one group compute the same loss; the collector counts it once)."""
        return [r for r in range(self.world_size) if self.is_last_stage_rank(r)]

    def build_mesh(self, device_type: str) -> Meshes:
        """The job's meshes by name, from ``init_device_mesh`` over the default process group
        (one root mesh ``(pp, dp_replicate, dp_shard, cp, tp)``; every mesh below is a view of it,
        so DTensors on different ones compose, e.g. FSDP2 over ``fsdp`` of TP's ``tp`` shards):

        - ``"pp"``, ``"dp_replicate"``, ``"dp_shard"``, ``"cp"``, ``"tp"``: the 1-D axes;
        - ``"fsdp"``: what FSDP2 shards over: ``dp_shard`` (``dp_shard × cp`` flattened as
          ``"dp_shard_cp"`` when ``cp > 1``), or the 2-D ``(dp_replicate, dp_shard[_cp])`` under
          HSDP (``dp_replicate > 1``: sharded over dim 1, replicated over dim 0);
        - ``"dp"``: every data-parallel rank of this (pp, cp, tp) position, 1-D (``dp_replicate ×
          dp_shard`` flattened; reductions over data-parallel ranks);
        - with ``cp > 1``: ``"dp_shard_cp"`` and ``"dp_cp"`` (``dp_replicate × dp_shard × cp``
          flattened: every rank holding other tokens of this (pp, tp) position);
        - with ``ep > 1``: ``"ep"`` (1-D), ``"dp_shard_mod_ep"`` (1-D), ``"efsdp"`` (what the routed
          experts are FSDP-sharded over: ``dp_shard_mod_ep``, flattened with ``cp`` as
          ``"dp_shard_mod_ep_cp"`` when ``cp > 1``, or 2-D with ``dp_replicate`` first under HSDP)
          and, with ``tp > 1``, ``"ep_tp"`` (2-D, the experts' own mesh).
        """
        root = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
                                mesh_dim_names=self.AXES)
        meshes: Meshes = {name: root[name] for name in self.AXES}
        shard = "dp_shard"
        if self.cp > 1:
            shard = "dp_shard_cp"
            meshes[shard] = root["dp_shard", "cp"]._flatten(shard)
        meshes["fsdp"] = root["dp_replicate", shard] if self.dp_replicate > 1 else meshes[shard]
        meshes["dp"] = (root["dp_replicate", "dp_shard"]._flatten("dp") if self.dp_replicate > 1
                        else meshes["dp_shard"])
        if self.cp > 1:
            meshes["dp_cp"] = root["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        # Flattened views DTensor finds by layout when it reduces over several axes at once (the
        # gradient norm of FSDP × TP shards, or of experts sharded over dp_shard_mod_ep × ep): one
        # collective instead of one per axis.
        if self.tp > 1 and self.fsdp:
            root["dp_shard", "cp", "tp"]._flatten("dp_shard_cp_tp") if self.cp > 1 else \
                root["dp_shard", "tp"]._flatten("dp_shard_tp")
        if self.ep > 1:
            # By index, not name: torch 2.11's _unflatten refuses a dimension name that the mesh has.
            ep_view = root._unflatten(self.AXES.index("dp_shard"), (self.dp_shard // self.ep, self.ep),
                                      ("dp_shard_mod_ep", "ep"))
            meshes["ep"] = ep_view["ep"]
            meshes["dp_shard_mod_ep"] = ep_view["dp_shard_mod_ep"]
            if self.cp > 1:  # not adjacent axes (ep lies between): a flattened view of their ranks
                eshard = "dp_shard_mod_ep_cp"
                meshes[eshard] = ep_view["dp_shard_mod_ep", "cp"]._flatten(eshard)
                # The 2-D view with a flattened axis comes from the root, as "fsdp"'s does.
                meshes["efsdp"] = root["dp_replicate", eshard] if self.dp_replicate > 1 else meshes[eshard]
            else:
                meshes["efsdp"] = (ep_view["dp_replicate", "dp_shard_mod_ep"] if self.dp_replicate > 1
                                   else meshes["dp_shard_mod_ep"])
            if self.tp > 1:
                meshes["ep_tp"] = ep_view["ep", "tp"]
            if (self.dp_shard > self.ep or self.dp_replicate > 1) and self.cp == 1:  # the experts are FSDP-sharded
                ep_view["dp_shard_mod_ep", "ep"]._flatten("dp_shard_mod_ep_ep")
        return meshes


def parallel_dims(cfg: JobConfig) -> ParallelDims:
    """The job's :class:`ParallelDims`: mesh sizes, stages per rank, and the stage placement of
    its pipeline schedule (``ray_titan.parallel.schedules.SCHEDULES``). Raises ``KeyError`` for
    a schedule the table lacks (the schema admits none) and ``ValueError`` as :class:`ParallelDims`."""
    par = cfg.parallelism
    return ParallelDims(pp=par.pp, dp_shard=par.dp_shard, stages_per_rank=par.stages_per_rank, ep=par.ep,
                        tp=par.tp, dp_replicate=par.dp_replicate,
                        pp_style=SCHEDULES[par.pipeline_schedule].placement, cp=par.cp)
