"""The dry run's checkpoint planning (``ray_titan.dry_run.checkpoint_plan``): DCP's save and load
planners on a state dict, nothing written."""

from __future__ import annotations

import pytest
import torch

from ray_titan.dry_run.checkpoint_plan import CheckpointPlanError, plan_load, plan_save


def test_save_planning_counts_the_copied_bytes_and_refuses_what_the_writer_cannot_copy():
    rng = torch.get_rng_state()
    metadata, copied = plan_save({"model.w": torch.ones(4, 3), "train.step": 7, "rng.rank0.cpu": rng})
    assert copied == {"cpu": 4 * 3 * 4 + rng.numel()}  # the step is pickled, not copied
    assert set(metadata.state_dict_metadata) == {"model.w", "train.step", "rng.rank0.cpu"}
    with pytest.raises(CheckpointPlanError, match=r"'model\.w': a meta tensor \(4, 3\) torch\.float32"):
        plan_save({"model.w": torch.empty(4, 3, device="meta")})


def test_load_planning_names_a_key_the_checkpoint_lacks():
    """A CPU rank's save has no CUDA generator key: a CUDA rank asking for it fails in planning
    (what ``Checkpointer._load`` drops first)."""
    metadata, _ = plan_save({"model.w": torch.ones(4, 3), "rng.rank0.cpu": torch.get_rng_state()})
    assert plan_load({"model.w": torch.empty(4, 3), "rng.rank0.cpu": torch.get_rng_state()}, metadata) == 2
    with pytest.raises(CheckpointPlanError, match=r"Missing key in checkpoint state_dict: rng\.rank0\.cuda"):
        plan_load({"model.w": torch.empty(4, 3), "rng.rank0.cuda": torch.zeros(16, dtype=torch.uint8)}, metadata)
