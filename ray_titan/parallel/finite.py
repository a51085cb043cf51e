"""Whether tensors sharded over the ranks are finite everywhere: one flag, all-reduced.

The trainer reads it after every optimizer step (an update that made a weight non-finite,
``ray_titan.trainer.nonfinite``) and the checkpointer before every save and after every load, so
non-finite weights never train on and never reach a checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ray_titan.parallel import local_tensor

__all__ = ["all_finite", "finite_each", "nonfinite_flag"]


@torch.no_grad()
def nonfinite_flag(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``(1,)`` float32 on ``device``: 1 when some element of ``tensors`` (this rank's shards of
    DTensors; floating or complex, others ignored) is not finite on some rank, else 0. A few
    extreme values per tensor (:func:`_extremes`, which cannot overflow, unlike a sum) and one
    all-reduce; no host sync."""
    local = [local_tensor(t).detach() for t in tensors]
    local = [t for t in local if t.numel() and (t.is_floating_point() or t.is_complex())]
    bad = torch.zeros(1, device=device)
    if local:
        extremes = torch.stack([x.to(device) for x in _extremes(local)])
        bad = (~torch.isfinite(extremes)).any().to(bad.dtype).reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad


def _extremes(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """0-dim values that are all finite exactly when every element of ``tensors`` (non-empty,
    floating or complex) is, each in its tensor's dtype: for a tensor on the CPU its minimum and
    maximum (``torch.aminmax``, of the real view of a complex one; a NaN anywhere makes both NaN,
    as documented), for one elsewhere its largest absolute value (``torch._foreach_norm`` with
    ``inf``).

    Why two ways: on a GPU ``_foreach_norm`` is one fused kernel over many tensors, while on
    the CPU it loops over them and its max-abs reduction is not vectorised; ``aminmax`` is
    one vectorised pass. The debug Llama's 39 parameters, 0.85 M elements: 2.3 ms against
    0.2 ms of one CPU core (torch 2.13), a step's non-finite check (after every update)."""
    extremes: list[torch.Tensor] = []
    others = []
    for t in tensors:
        if t.device.type == "cpu":
            extremes.extend(torch.aminmax(torch.view_as_real(t) if t.is_complex() else t))
        else:
            others.append(t)
    if others:
        extremes.extend(torch._foreach_norm(others, float("inf")))
    return extremes


def all_finite(tensors: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Whether every element of ``tensors`` is finite on every rank (:func:`nonfinite_flag`, read
    on the host: one sync)."""
    return nonfinite_flag(tensors, device).item() == 0


@torch.no_grad()
def finite_each(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """For each of ``tensors`` (plain, non-empty, floating or complex; one rank's, nothing
    reduced), whether every element is finite: one pass per tensor (:func:`_extremes`, so on the
    CPU ``aminmax``, several times faster than a max-abs norm there) and one host read for all.
    Raises ``RuntimeError`` for an empty tensor (it has no extremes)."""
    if not tensors:
        return []
    flags = torch.stack([torch.isfinite(torch.stack(_extremes([t]))).all() for t in tensors])
    return flags.tolist()
