"""The memory plan's results (:mod:`ray_titan.preflight.memory_plan`): :class:`RankPlan` (one rank's
predicted memory, bytes), :class:`Lever`, :class:`MemoryPlan` (a job's plan, its JSON form and its
table as text), and the sizes a plan prints (:func:`~ray_titan.config.units.format_bytes`).
Nothing is planned here: these are what the planning modules fill in and what the run, its summary
and the dry run read back."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray_titan.config.units import format_bytes
from ray_titan.metrics.reading.memory_plan import covering


@dataclass
class RankPlan:
    """One rank's predicted memory, bytes.

    ``coords``: mesh coordinates; ``stages``: the pipeline stages it holds. ``parameters``,
    ``gradients``: this rank's shards (fp32); ``optimizer_state``: bytes per optimizer;
    ``fsdp_unsharded_params`` / ``fsdp_unsharded_grads``: FSDP2's all-gathered parameters and
    accumulated unsharded gradients at the peak; ``activations_per_microbatch``: per stage;
    ``in_flight``: microbatches in flight per stage at the peak; ``activations``: at the peak;
    ``activations_by_ac_mode``: one microbatch over all its stages under each AC mode
    (``none``, ``full``, ``selective_op``, ``selective_layer``); ``expert_buffers``: the MoE
    layers' dispatched tokens and expert activations within ``activations``;
    ``pipeline_buffers``; ``buffers`` (module buffers and the step's batch); ``transient``;
    ``peak`` and ``peak_phase`` (``forward_backward`` or ``optimizer``); ``offloaded``: bytes
    ``memory.cpu_offload`` keeps in host memory instead (not in ``peak``).
    """

    rank: int
    coords: dict[str, int]
    stages: list[int]
    parameters: int
    gradients: int
    optimizer_state: dict[str, int]
    fsdp_unsharded_params: int
    fsdp_unsharded_grads: int
    activations_per_microbatch: dict[int, int]
    in_flight: dict[int, int]
    activations: int
    activations_by_ac_mode: dict[str, int]
    expert_buffers: int
    pipeline_buffers: int
    buffers: int
    transient: int
    peak: int
    peak_phase: str
    offloaded: int = 0

    def categories(self) -> dict[str, int]:
        """The peak split as the profiler splits a measured one (``memory.breakdown_step``):
        ``parameters`` (shards and FSDP's gathered copies), ``gradients``, ``optimizer_state``,
        ``activations``, ``temporaries`` (transient, pipeline and module buffers)."""
        if self.peak_phase == "optimizer":
            return {"parameters": self.parameters, "gradients": self.gradients,
                    "optimizer_state": sum(self.optimizer_state.values()), "activations": 0,
                    "temporaries": self.peak - self.parameters - self.gradients
                    - sum(self.optimizer_state.values())}
        params = self.parameters + self.fsdp_unsharded_params
        grads = self.peak_grads
        opt = sum(self.optimizer_state.values())
        acts = self.activations - self.activations_freed_at_peak
        return {"parameters": params, "gradients": grads, "optimizer_state": opt, "activations": acts,
                "temporaries": self.peak - params - grads - opt - acts}

    through: int | None = None
    """On a mesh over :data:`~ray_titan.preflight.plan_ranks.LISTED_RANKS` ranks, the last rank this
    plan stands for (ranks ``rank`` to ``through``, one pipeline rank: the same figures; ``coords``
    are ``rank``'s); None: ``rank`` alone."""
    peak_grads: int = 0
    """Gradient bytes alive at the peak (unsharded accumulated ones under FSDP)."""
    activations_freed_at_peak: int = 0
    """Of ``activations``, the bytes backward has freed by the transient's moment: at the peak
    they are the backward's temporaries (the plan's peak is unchanged; only its split)."""
    activations_offloaded: int = 0
    """Bytes of saved activations ``memory.activation_offload`` keeps in pinned host memory at the
    most (every microbatch in flight at the peak), instead of in ``activations`` (not in ``peak``;
    what comes back for a block's backward is in ``transient``)."""
    offload_bytes_per_step: int = 0
    """Bytes ``memory.activation_offload`` copies to the host (and back) in one step: every
    microbatch of every local stage."""


@dataclass
class Lever:
    """A change that lowers the peak: ``overrides`` (``--section.key=value``), the largest rank
    peak with it, whether that fits, ``cost`` (what it costs, in words) and ``rank`` (its place
    in the cost order, cheapest first)."""

    name: str
    overrides: list[str]
    peak: int
    fits: bool | None
    cost: str
    rank: int


@dataclass
class MemoryPlan:
    """The plan of a job (the model: :mod:`ray_titan.preflight.memory_plan`). ``job``: what was
    planned (model, mesh, schedule, microbatch, AC, dtype, device kind, routing imbalance,
    vocabulary); ``ranks``: one :class:`RankPlan` per rank; ``device_memory``: the capacity
    compared with (bytes, None if unknown) and where it came from; ``levers`` ranked by cost and
    ``recommendation`` (the overrides that make it fit, cheapest first; None if it fits or nothing
    does)."""

    job: dict[str, Any]
    ranks: list[RankPlan]
    device_memory: int | None = None
    device_memory_source: str = ""
    margin: float = 0.0
    """Share of ``device_memory`` kept free: the CUDA context, communication buffers and the
    caching allocator's fragmentation, which the plan does not count."""
    levers: list[Lever] = field(default_factory=list)
    recommendation: list[str] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def max_peak(self) -> int:
        return max(r.peak for r in self.ranks)

    @property
    def fits(self) -> bool | None:
        """Whether every rank's peak fits :attr:`usable` (None when the capacity is unknown)."""
        return None if self.usable is None else self.max_peak <= self.usable

    @property
    def usable(self) -> int | None:
        """Bytes a rank may plan to use: ``device_memory`` less the margin (None if unknown)."""
        return None if self.device_memory is None else int(self.device_memory * (1 - self.margin))

    def peak_by_rank(self) -> dict[int, int]:
        """``{rank: peak bytes}`` of the ranks listed (the first of each span on a mesh over
        :data:`~ray_titan.preflight.plan_ranks.LISTED_RANKS` ranks; :meth:`for_rank` finds any rank's)."""
        return {r.rank: r.peak for r in self.ranks}

    def for_rank(self, rank: int) -> RankPlan | None:
        """The plan holding ``rank``'s figures (a span's first rank's plan, coords included, when
        ``rank`` is inside it), or None for a rank off the mesh."""
        i = covering([r.rank for r in self.ranks], [r.through for r in self.ranks], rank)
        return None if i is None else self.ranks[i]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"max_peak": self.max_peak, "fits": self.fits}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryPlan:
        fields = {f.name for f in dataclasses.fields(RankPlan)}

        def rank(d: dict[str, Any]) -> RankPlan:
            d = {k: v for k, v in d.items() if k in fields}
            for key in ("activations_per_microbatch", "in_flight"):
                d[key] = {int(k): v for k, v in d[key].items()}
            return RankPlan(**d)

        return cls(job=data["job"], ranks=[rank(r) for r in data["ranks"]],
                   device_memory=data.get("device_memory"), device_memory_source=data.get("device_memory_source", ""),
                   margin=data.get("margin", 0.0),
                   levers=[Lever(**lv) for lv in data.get("levers", [])],
                   recommendation=data.get("recommendation"), notes=data.get("notes", []))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> MemoryPlan:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def format(self) -> str:
        """The plan as text: one row per group of ranks with the same figures, then the verdict
        and the levers."""
        j = self.job
        lines = [
            f"memory plan: {j['model']}/{j['flavor']}, mesh {j['mesh']}, {j['schedule']}, "
            f"{j['microbatches']} microbatches of {j['microbatch_size']} × {j['seq_len']} tokens, "
            f"AC {j['ac']}, {j['dtype']}, {j['optimizer']}, device {j['device']}"
            + (f", routing imbalance {j['routing_imbalance']:g}" if j.get("moe") else ""),
        ]
        head = ["ranks", "coords", "stages", "params", "gathered", "grads", "optim", "act/mb",
                "in flight", "activations", "pp bufs", "transient", "peak"]
        body = []
        for ranks, r in _groups(self.ranks):
            body.append([
                _rank_list(ranks), ", ".join(f"{k}={v}" for k, v in r.coords.items() if k != "dp_shard"
                                             and k != "ep") or "-",
                ",".join(map(str, r.stages)), format_bytes(r.parameters), format_bytes(r.fsdp_unsharded_params),
                format_bytes(r.peak_grads), format_bytes(sum(r.optimizer_state.values())),
                format_bytes(sum(r.activations_per_microbatch.values()) / max(1, len(r.stages))),
                "+".join(str(r.in_flight[s]) for s in r.stages), format_bytes(r.activations),
                format_bytes(r.pipeline_buffers), format_bytes(r.transient), format_bytes(r.peak),
            ])
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        lines += ["  ".join(x.rjust(w) if i > 2 else x.ljust(w) for i, (x, w) in enumerate(zip(row, widths))).rstrip()
                  for row in [head, *body]]
        if self.device_memory is None:
            lines.append(f"largest peak {format_bytes(self.max_peak)}; no device capacity "
                         f"({self.device_memory_source or 'pass --device-memory, e.g. 80GiB'})")
        else:
            verdict = "fits" if self.fits else "does NOT fit"
            of = format_bytes(self.device_memory) + f" ({self.device_memory_source})"
            if self.margin:
                of += f", {format_bytes(self.usable or 0)} usable with {self.margin:.0%} kept free"
            lines.append(f"largest peak {format_bytes(self.max_peak)} of {of}: {verdict}")
        if self.levers and not self.fits:
            lines.append("levers, cheapest first (each alone):")
            for lv in self.levers:
                mark = "fits" if lv.fits else ("does not fit" if lv.fits is False else "")
                lines.append(f"  {lv.name}: peak {format_bytes(lv.peak)}, {mark or '?'}; {lv.cost}")
            if self.recommendation:
                lines.append("recommended: " + " ".join(self.recommendation))
            else:
                lines.append("no combination of these levers fits: more devices (dp_shard, pp) or a smaller "
                             "microbatch / sequence")
        host = max(r.activations_offloaded for r in self.ranks)
        if host:
            lines.append(f"activation offload: up to {format_bytes(host)} of saved activations per rank in pinned "
                         "host memory (memory.activation_offload), not in the device peak")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _groups(ranks: list[RankPlan]) -> list[tuple[list[tuple[int, int]], RankPlan]]:
    """Ranks with identical figures, together (ranks differing only by dp_shard / ep coordinate),
    as ``(first, last)`` runs."""
    out: dict[tuple, tuple[list[tuple[int, int]], RankPlan]] = {}
    for r in ranks:
        key = (tuple(r.stages), r.peak, r.parameters, r.activations, r.coords.get("pp", 0))
        runs = out.setdefault(key, ([], r))[0]
        first, last = r.rank, r.rank if r.through is None else r.through
        if runs and runs[-1][1] + 1 == first:
            runs[-1] = (runs[-1][0], last)
        else:
            runs.append((first, last))
    return list(out.values())


def _rank_list(runs: list[tuple[int, int]]) -> str:
    """``0-7`` for a run of three or more ranks, else the ranks: ``0,1``."""
    return ",".join(f"{a}-{b}" if b > a + 1 else ",".join(map(str, range(a, b + 1))) for a, b in runs)
