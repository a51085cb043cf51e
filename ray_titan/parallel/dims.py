"""Parallel dimensions and the device mesh.

The mesh is ``(pp, dp_shard)`` with those axis names (DESIGN.md, Contracts), row-major, so global
rank ``r`` has coordinates ``pp = r // dp_shard`` and ``dp_shard = r % dp_shard``.

Expert parallelism borrows its ranks from ``dp_shard``: with ``ep > 1`` the mesh is built as
``(pp, dp_shard_mod_ep, ep)`` and ``dp_shard`` is the flattened ``(dp_shard_mod_ep, ep)``, so the
``ep`` coordinate is ``dp_shard % ep`` (consecutive data-parallel ranks exchange tokens) and
routed experts are FSDP-sharded over ``dp_shard_mod_ep`` (what is left of ``dp_shard``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["Meshes", "ParallelDims"]

Meshes = dict[str, DeviceMesh]
"""The 1-D meshes of a job by axis name (:meth:`ParallelDims.build_mesh`)."""


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the mesh axes, the pipeline's stages per rank, and the mapping of stages to ranks.

    Stages are placed in loop style (GPipe, 1F1B, Interleaved1F1B): stage ``s`` is on pp rank
    ``s % pp``. The last-stage ranks are derived from that mapping, never from a schedule's name.
    """

    pp: int = 1
    dp_shard: int = 1
    stages_per_rank: int = 1
    ep: int = 1

    AXES = ("pp", "dp_shard")

    def __post_init__(self):
        if self.dp_shard % self.ep:
            raise ValueError(f"ep = {self.ep} must divide dp_shard = {self.dp_shard}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_shard

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of global ``rank`` on each mesh axis, by axis name (``ep`` only when > 1)."""
        dp = rank % self.dp_shard
        coords = {"pp": rank // self.dp_shard, "dp_shard": dp}
        if self.ep > 1:  # only where the axis exists, so dense jobs' messages stay short
            coords["ep"] = dp % self.ep
        return coords

    def stage_to_pp_rank(self, stage: int) -> int:
        """The pp rank holding pipeline stage ``stage`` (loop style)."""
        return stage % self.pp

    def stages_on_pp_rank(self, pp_rank: int) -> list[int]:
        """Stage indices held by ``pp_rank``, in increasing order."""
        return [s for s in range(self.num_stages) if self.stage_to_pp_rank(s) == pp_rank]

    def is_last_stage_rank(self, rank: int) -> bool:
        """Whether global ``rank`` holds the last pipeline stage."""
        return self.coords(rank)["pp"] == self.stage_to_pp_rank(self.num_stages - 1)

    def last_stage_ranks(self) -> list[int]:
        """Global ranks that hold the last pipeline stage (one per DP rank)."""
        return [r for r in range(self.world_size) if self.is_last_stage_rank(r)]

    def build_mesh(self, device_type: str) -> Meshes:
        """The 1-D meshes of each axis by name, from ``init_device_mesh`` over the default process
        group: ``"pp"``, ``"dp_shard"``, and with ``ep > 1`` also ``"ep"`` and ``"dp_shard_mod_ep"``
        (module docstring)."""
        if self.ep == 1:
            mesh = init_device_mesh(device_type, (self.pp, self.dp_shard), mesh_dim_names=self.AXES)
            return {"pp": mesh["pp"], "dp_shard": mesh["dp_shard"]}
        mesh = init_device_mesh(
            device_type, (self.pp, self.dp_shard // self.ep, self.ep),
            mesh_dim_names=("pp", "dp_shard_mod_ep", "ep"),
        )
        # Kept as returned: slicing a flattened axis from the root mesh is deprecated.
        dp = mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        return {"pp": mesh["pp"], "dp_shard": dp, "ep": mesh["ep"], "dp_shard_mod_ep": mesh["dp_shard_mod_ep"]}
