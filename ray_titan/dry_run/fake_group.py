"""The fake process group of the job's world size, and the ranks a dry run does not run.

Every rank but the simulated one is absent: the group is ``torch.testing._internal``'s fake one
(its collectives return at once; :mod:`.fake_device` checks each as NCCL would), and a pipeline
stage's neighbours, which would exchange shape metadata with it before the first step, are
answered here (:func:`_install_stage_meta_shims`, :func:`_schedules_see_nccl`). Nothing here
imports torch at module level: the rank's process loads the fake CUDA library first (:mod:`.rank`).
"""

from __future__ import annotations

from typing import Any

from ray_titan.dry_run.fake_device import _patch


def _join_fake_group(job: Any) -> None:
    """Join ``job``'s fake process group as ``job.rank`` of ``job.dims.world_size`` (``job``: a
    ``rank._Job``), its pipeline neighbours answered by :func:`_install_stage_meta_shims`."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _install_stage_meta_shims(job)
    dist.init_process_group("fake", store=FakeStore(), rank=job.rank, world_size=job.dims.world_size)


def _install_stage_meta_shims(job: Any) -> None:
    """A pipeline stage's shape metadata, which it exchanges with its neighbours before the first
    step, answered without them: ``job.hidden`` (in ``job.hidden_dtype``; ``job``: a ``rank._Job``)
    forward, the stage's own outputs backward. Torch exchanges it through
    ``PipelineStage._send_meta``/``_recv_meta`` where those exist; before
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

