"""Every pipeline schedule's properties, in one table (:data:`SCHEDULES`), read by the pipeline
builder (``ray_titan.parallel.pipeline``), the pre-flight checks (``ray_titan.preflight.checks``) and the
memory plan (``ray_titan.preflight.memory_plan``); ``config.schema``'s ``Literal`` of schedule names is
checked against its keys (tests/unit/test_config.py).

**Microbatches in flight** (:attr:`Schedule.in_flight`): the microbatches whose forward ran and
whose backward (the weight-gradient half, for zero-bubble schedules) has not, at a rank's peak,
per local stage, as a function of ``pp``, stages per rank ``v``, microbatches ``n`` and the pp
rank ``r``; and how many are in flight once gradients exist. Read from the schedules of
``torch.distributed.pipelining.schedules`` (the warm-up counts of each;
``tests/integration/test_memory_plan.py`` checks every rule against the action lists torch
builds). GPipe keeps ``n`` (Huang et al. 2019), 1F1B ``min(n, pp − r)`` (Narayanan et al. 2021,
PipeDream-Flush), interleaved 1F1B its warm-up ``(v − 1)·n_round + 2·(pp − 1 − r)`` plus one,
the zero-bubble schedules (Qi et al. 2023, arXiv:2401.10241) and DualPipeV (DeepSeek-V3,
arXiv:2412.19437) theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal

from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    _ComputationType,
)

__all__ = ["SCHEDULES", "InFlight", "Schedule", "local_stages", "rank_actions"]


@dataclass(frozen=True)
class InFlight:
    """Microbatches in flight on each of a rank's local stages (in the order :func:`local_stages`
    gives): ``peak`` at the rank's most, ``with_grads`` at the most once the step's first weight
    gradients exist (after its first full backward, or first weight-gradient step)."""

    peak: tuple[int, ...]
    with_grads: tuple[int, ...]


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule.

    ``torch_class``: its ``torch.distributed.pipelining`` class. ``placement``: ``loop`` (rank
    ``r`` holds stages ``r, r + pp, ...``) or ``v`` (rank ``r`` holds ``r`` and ``2·pp − 1 − r``;
    torch builds the mapping with ``style="v"``). ``stages_per_rank``: what it needs, 1 or 2
    exactly, or None for ``>= 2`` (the interleaved ones). ``min_microbatches(pp)``: the fewest
    microbatches it runs. ``rounds``: microbatches must be a multiple of the rounds
    ``max(1, n // pp)`` (torch's interleaved schedules run rounds of ``pp``). ``zero_bubble``:
    each backward is split into its input and weight parts. ``in_flight(pp, v, n, r)``: the
    microbatches in flight on pp rank ``r`` (module docstring)."""

    name: str
    torch_class: type[PipelineScheduleSingle] | type[PipelineScheduleMulti]
    placement: Literal["loop", "v"]
    stages_per_rank: int | None
    min_microbatches: Callable[[int], int]
    rounds: bool
    zero_bubble: bool
    in_flight: Callable[[int, int, int, int], InFlight]


def _less_one(counts: tuple[int, ...], j: int, drop: bool) -> tuple[int, ...]:
    return tuple(c - 1 if drop and i == j else c for i, c in enumerate(counts))


def _gpipe(pp: int, v: int, n: int, r: int) -> InFlight:
    # All forwards, then all backwards.
    return InFlight((n,), (n - 1,))


def _one_f_one_b(pp: int, v: int, n: int, r: int) -> InFlight:
    # Warm-up of pp − r forwards, then one backward per forward.
    w = min(n, pp - r)
    return InFlight((w,), _less_one((w,), 0, n <= w))


def _interleaved(zero_bubble: bool) -> Callable[[int, int, int, int], InFlight]:
    def rule(pp: int, v: int, n: int, r: int) -> InFlight:
        # torch: rounds of n_round = n // max(1, n // pp) microbatches; forward op i runs local
        # stage (i // n_round) % v; warm-up (v − 1)·n_round + m·(pp − 1 − r) forwards (m = 2;
        # 1 for zero bubble, whose first r steady steps defer their weight gradients).
        n_round = n // max(1, n // pp)
        warmup = min((v - 1) * n_round + (1 if zero_bubble else 2) * (pp - 1 - r), n * v)
        steady = n * v - warmup
        total = warmup + min(steady, r + 1 if zero_bubble else 1)
        counts = [0] * v
        for i in range(total):
            counts[(i // n_round) % v] += 1
        drop = steady <= (r + 1 if zero_bubble else 1)
        return InFlight(tuple(counts), _less_one(tuple(counts), v - 1, drop))

    return rule


def _zbv(pp: int, v: int, n: int, r: int) -> InFlight:
    # 2·(pp − r) − 1 forwards of the first chunk, r pairs of both, then the second chunk's first
    # forward before its first backward.
    counts = (min(n, 2 * pp - 1 - r), min(n, r + 1))
    return InFlight(counts, _less_one(counts, 1, r == pp - 1 and n <= pp))


def _dualpipev(pp: int, v: int, n: int, r: int) -> InFlight:
    # 2·(pp − r − 1) forwards of the first chunk, r + 1 pairs, then one more second-chunk forward.
    counts = (min(n, 2 * pp - r), min(n, r + 1))
    return InFlight(counts, counts)


def _table(*schedules: Schedule) -> dict[str, Schedule]:
    return {s.name: s for s in schedules}


SCHEDULES: dict[str, Schedule] = _table(
    Schedule("GPipe", ScheduleGPipe, "loop", 1, lambda pp: 1, False, False, _gpipe),
    Schedule("1F1B", Schedule1F1B, "loop", 1, lambda pp: pp, False, False, _one_f_one_b),
    Schedule("Interleaved1F1B", ScheduleInterleaved1F1B, "loop", None, lambda pp: pp, True, False,
             _interleaved(zero_bubble=False)),
    Schedule("InterleavedZeroBubble", ScheduleInterleavedZeroBubble, "loop", None, lambda pp: pp, True, True,
             _interleaved(zero_bubble=True)),
    # ZBVZeroBubble's warm-up alone runs 2·pp − 1 microbatches; DualPipeV needs one per stage.
    Schedule("ZBVZeroBubble", ScheduleZBVZeroBubble, "v", 2, lambda pp: 2 * pp - 1, False, True, _zbv),
    Schedule("DualPipeV", ScheduleDualPipeV, "v", 2, lambda pp: 2 * pp, False, True, _dualpipev),
)
"""Every pipeline schedule ``parallelism.pipeline_schedule`` may name, by name (:class:`Schedule`).
Without PP the microbatches are accumulated one at a time: one in flight."""


def local_stages(placement: str, pp: int, v: int, pp_rank: int) -> list[int]:
    """The stage indices pp rank ``pp_rank`` holds, in the order of :class:`InFlight`'s counts."""
    if placement == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + j * pp for j in range(v)]


_KINDS = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B",
          _ComputationType.BACKWARD_INPUT: "I", _ComputationType.BACKWARD_WEIGHT: "W"}


def rank_actions(name: str, pp: int, v: int, n: int, r: int) -> list[tuple[str, int, int]]:
    """The compute actions pp rank ``r`` runs in one step of the multi-stage schedule ``name``
    (interleaved, zero-bubble, DualPipeV) with ``v`` stages per rank and ``n`` microbatches, in
    order, as torch builds them (the schedules' own ``_calculate_single_rank_operations``, called
    without process groups; torch runs this list, less its idle slots):
    ``(kind, stage, microbatch)``, kind ``F`` (forward), ``B`` (full backward), ``I``
    (input-gradient half) or ``W`` (weight-gradient half); DualPipeV's overlapped pairs as their
    forward then their backward. Raises ``KeyError`` for a name not in :data:`SCHEDULES`,
    ``ValueError`` for a single-stage schedule (GPipe, 1F1B)."""
    cls = SCHEDULES[name].torch_class
    if not issubclass(cls, PipelineScheduleMulti):
        raise ValueError(f"rank_actions: {name} is a single-stage schedule; its in-flight rule says it all")
    rounds = max(1, n // pp)
    ns = SimpleNamespace(pp_group_size=pp, n_local_stages=v, _n_microbatches=n, number_of_rounds=rounds,
                         microbatches_per_round=n // rounds, num_stages=pp * v)
    order = cls._calculate_single_rank_operations(ns, r)  # type: ignore[attr-defined]
    out = []
    for a in order:
        for sub in (a.sub_actions if a is not None and a.sub_actions else [a]):
            if sub is not None and sub.computation_type in _KINDS:
                out.append((_KINDS[sub.computation_type], sub.stage_index, sub.microbatch_index))
    return out
