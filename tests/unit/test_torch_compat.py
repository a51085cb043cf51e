"""The declared torch range at both ends (torch 2.11 on Python 3.12, the newest torch): what differs
between versions, simulated here on the development pin so that each difference is kept by a test
that runs everywhere."""

from __future__ import annotations

import contextlib
import enum
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ray_titan.parallel.pipeline import ScheduleLoss
from ray_titan.trainer.step import run_schedule


class _Torch211Schedule:
    """A pipeline schedule with torch 2.11's ``step``: no ``loss_kwargs``, and every keyword it
    does not know forwarded to the model; the loss is called as ``loss_fn(output, target)``."""

    def __init__(self, model: torch.nn.Module, loss_fn: Any):
        self.model, self.loss_fn = model, loss_fn

    def step(self, *args, target=None, losses: list | None = None, return_outputs=True, **kwargs):
        out = self.model(*args, **kwargs)
        if losses is not None:
            losses.append(self.loss_fn(out, target))

    def eval(self, *args, target=None, losses: list | None = None, **kwargs):
        with torch.no_grad():
            return self.step(*args, target=target, losses=losses, **kwargs)


class _Model(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # no **kwargs: as ray_titan's Decoder
        return x.float()


@pytest.mark.parametrize("forward_only", [False, True])
def test_loss_arguments_reach_the_loss_under_a_schedule_without_loss_kwargs(forward_only):
    """torch 2.11's ``schedule.step`` has no ``loss_kwargs``: passed there, they reached the model
    (``Decoder.forward() got an unexpected keyword argument 'loss_kwargs'``); bound into the
    schedule's loss, they reach the loss, and only for that step."""
    seen: list[dict] = []

    def loss(out, y, **kw):
        seen.append(kw)
        return (out - y).pow(2).mean() * kw.get("scale", 1.0)

    sl = ScheduleLoss(loss)
    parts = SimpleNamespace(schedule=_Torch211Schedule(_Model(), sl), schedule_loss=sl, is_last_stage=True,
                            has_first_stage=True, autocast=None, loss_context=contextlib.nullcontext)
    x, y = torch.ones(2, 3), torch.zeros(2, 3)
    losses = run_schedule(parts, x, y, None, {"scale": 0.5}, forward_only=forward_only)  # type: ignore[arg-type]
    assert seen == [{"scale": 0.5}] and losses is not None and losses[0].item() == 0.5
    assert sl.kwargs == {}  # unbound after the step: the next call adds nothing
    sl(x, y)
    assert seen[-1] == {}


@pytest.fixture
def fake_world_of_8():
    """A fake process group of 8 ranks in this process (no communication): enough for device meshes."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield
    dist.destroy_process_group()


def test_the_ep_mesh_unflattens_dp_shard_by_index(fake_world_of_8, monkeypatch):
    """torch 2.11's ``DeviceMesh._unflatten`` refuses a dimension given by a name the mesh has
    (``ValueError: dim dp_shard specified in _unflatten is not in (...)``): every EP job failed at
    build. An integer dimension works on every torch."""
    from torch.distributed.device_mesh import DeviceMesh

    from ray_titan.parallel.dims import ParallelDims

    real = DeviceMesh._unflatten

    def as_torch_2_11(self, dim, mesh_sizes, mesh_dim_names, *a, **kw):
        if isinstance(dim, str) and dim in (self.mesh_dim_names or ()):
            raise ValueError(f"dim {dim} specified in `_unflatten` is not in {self.mesh_dim_names}")
        return real(self, dim, mesh_sizes, mesh_dim_names, *a, **kw)

    monkeypatch.setattr(DeviceMesh, "_unflatten", as_torch_2_11)
    meshes = ParallelDims(pp=2, dp_shard=4, ep=2).build_mesh("cpu")
    assert (meshes["ep"].size(), meshes["dp_shard_mod_ep"].size(), meshes["efsdp"].mesh_dim_names) == (
        2, 2, ("dp_shard_mod_ep",))


@pytest.fixture
def gloo_world_of_1():
    """A one-rank gloo process group in this process: every stage of a schedule on rank 0."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_the_p2p_warm_up_sends_nothing_to_a_stage_on_the_same_rank(gloo_world_of_1, schedule):
    """torch 2.11's multi-stage schedules warm up by sending to each neighbouring stage, on the
    same rank too, which gloo refuses (``Pair is not connected``); ray_titan's stages leave
    those out (``ray_titan.parallel.pipeline._Stage``). Here every stage is on rank 0."""
    from torch.distributed.pipelining import PipelineStage

    from ray_titan.parallel.pipeline import build_pipeline_schedule

    if not hasattr(PipelineStage, "_get_init_p2p_neighbors_ops"):
        pytest.skip("this torch warms its p2p communicators up without _get_init_p2p_neighbors_ops")
    stages = {s: torch.nn.Linear(4, 4) for s in range(2)}
    sched = build_pipeline_schedule(schedule, stages, 2, 2, lambda out, y: (out - y).pow(2).mean(),
                                    torch.device("cpu"), gloo_world_of_1, {0: 0, 1: 0})
    built = sched._stages  # type: ignore[union-attr]
    # What torch's own warm-up posts here: a send and a receive each way between stages 0 and 1.
    assert [len(PipelineStage._get_init_p2p_neighbors_ops(s)) for s in built] == [2, 2]
    assert [s._get_init_p2p_neighbors_ops() for s in built] == [[], []]
    x = torch.randn(4, 4)
    sched.step(x, target=x)  # the warm-up runs at the first step (on torch 2.11; gloo refused it)


def _profiled_step(monkeypatch_gone: Any) -> dict:
    """A step of a tiny model under ray_titan's StepProfiler with one torch name removed by
    ``monkeypatch_gone()``; the breakdown it reports."""
    from ray_titan.metrics.worker.profiling import StepProfiler

    model = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64)
    monkeypatch_gone()
    profiler = StepProfiler(None, 0, {}, torch.device("cpu"), breakdown_step=2)
    profiler.start(2)
    model(x).sum().backward()
    out = profiler.stop(2)
    assert out is not None
    return out


def test_a_memory_breakdown_survives_the_deprecated_timeline_export_being_gone(monkeypatch):
    """``profile.export_memory_timeline`` is deprecated: where it is gone the step still reports
    its peak (from the allocations), without categories, and says why."""
    owner = next(c for c in torch.profiler.profile.__mro__ if "export_memory_timeline" in vars(c))
    out = _profiled_step(lambda: monkeypatch.delattr(owner, "export_memory_timeline"))
    assert out["peak_bytes"] > 0 and out["at_peak"] == {"unknown": out["peak_bytes"]}
    assert out["error"].startswith("AttributeError") and "export_memory_timeline" in out["error"]


def test_a_memory_breakdown_survives_a_change_of_the_private_category_order(monkeypatch):
    """The timeline's columns are named by torch's private ``_CATEGORY_TO_INDEX``: where it names
    a category unknown here (a later torch), the step falls back as above instead of failing
    (a ``KeyError`` at the profiled step), and so it does where the mapping is gone."""
    import torch.profiler._memory_profiler as mp

    from ray_titan.metrics.worker.memory import timeline_breakdown

    new = enum.Enum("Category", ["NEW_CATEGORY"]).NEW_CATEGORY
    grown = {**mp._CATEGORY_TO_INDEX, new: len(mp._CATEGORY_TO_INDEX)}
    out = _profiled_step(lambda: monkeypatch.setattr(mp, "_CATEGORY_TO_INDEX", grown))
    assert out["peak_bytes"] > 0 and out["at_peak"] == {"unknown": out["peak_bytes"]}
    assert out["error"].startswith("ValueError") and "_CATEGORY_TO_INDEX" in out["error"]
    monkeypatch.delattr(mp, "_CATEGORY_TO_INDEX")
    with pytest.raises(ValueError, match="cannot name"):
        timeline_breakdown([[0, 1, 2]])
