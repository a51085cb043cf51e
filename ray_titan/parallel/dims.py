"""Parallel dimensions and the device mesh.

The mesh is ``(pp, dp_shard)`` with those axis names (DESIGN.md, Contracts), row-major, so global
rank ``r`` has coordinates ``pp = r // dp_shard`` and ``dp_shard = r % dp_shard``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ParallelDims"]


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the mesh axes, the pipeline's stages per rank, and the mapping of stages to ranks.

    Stages are placed in loop style (GPipe, 1F1B, Interleaved1F1B): stage ``s`` is on pp rank
    ``s % pp``. The last-stage ranks are derived from that mapping, never from a schedule's name.
    """

    pp: int = 1
    dp_shard: int = 1
    stages_per_rank: int = 1

    AXES = ("pp", "dp_shard")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_shard

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of global ``rank`` on each mesh axis, by axis name."""
        return {"pp": rank // self.dp_shard, "dp_shard": rank % self.dp_shard}

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

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """``init_device_mesh`` over the default process group, axes ``("pp", "dp_shard")``."""
        return init_device_mesh(device_type, (self.pp, self.dp_shard), mesh_dim_names=self.AXES)
