"""The memory plan: every rank's memory predicted before any worker starts, whether the job fits
its devices, and the levers that would make it fit, ranked by what they cost.

``memory_plan(cfg)`` (and ``ray-titan memory plan --config X``) builds the model on the meta
device (nothing allocated), cuts it into the job's pipeline stages and, for every rank of the
mesh (by its coordinates), adds up:

====================  ===========================================================================
part                  bytes
====================  ===========================================================================
parameters            this rank's shards, fp32: ``4·Ψ_r``, Ψ_r the elements it holds. FSDP2
                      shards dim 0 over ``dp_shard`` (padded to a multiple of it); expert
                      parallel splits the routed experts over ``ep`` first, and FSDP shards them
                      over what is left (``dp_shard / ep``).
gradients             ``4·Ψ_r`` (fp32, as the parameters).
optimizer state       AdamW / Adam: ``8·Ψ_r`` (``exp_avg``, ``exp_avg_sq``); SGD with momentum:
                      ``4·Ψ_r``. These three rows are ZeRO's model-state count (Rajbhandari et al.
                      2020, arXiv:1910.02054, §3.1: ``2Ψ + 2Ψ + 12Ψ`` for mixed-precision Adam;
                      here fp32 weights, so ``4Ψ + 4Ψ + 8Ψ``), with FSDP2 = ZeRO-3 sharding.
FSDP unsharded        while a stage computes, FSDP2 holds the all-gathered parameters of the blocks
                      in use: under PP the whole stage (the pipeline keeps them gathered, and
                      ``reshard_after_forward`` only re-gathers per microbatch), otherwise the
                      root group plus two blocks (the current and the prefetched one) with
                      ``reshard_after_forward`` and every block without it; and, with more than
                      one microbatch, the stage's unsharded gradients, accumulated without
                      reduce-scatter until the last microbatch's backward. Under
                      ``training.mixed_precision = "bf16"`` the gathered parameters are bf16
                      (2 bytes) and the gradients are accumulated and reduced in fp32; without
                      FSDP, ``torch.autocast`` caches a bf16 copy of every weight (2 bytes).
activations           per microbatch of ``T = (global batch / dp / microbatches) × seq_len``
                      tokens, the tensors autograd saves for backward (below), times the
                      microbatches the pipeline schedule keeps in flight on the stage
                      (``ray_titan.parallel.schedules``).
pipeline buffers      receive buffers a pipeline stage allocates once per microbatch: the
                      activations it receives (non-first stages) and the gradients it receives
                      (non-last stages), ``4·T·d`` each.
transient             the largest short-lived allocation of the step: the loss's gradient over
                      the vocabulary on the last stage, a block's backward, the block that
                      activation checkpointing recomputes, the optimizer's gradient temporaries.
                      Zero-bubble schedules (split backwards): what each input-gradient step
                      keeps until its weight-gradient step, and the recomputations a weight step
                      of checkpointed blocks keeps, at the moment found by walking the rank's
                      actions in torch's order (``_zero_bubble_peak``, ``_zero_bubble_terms``).
peak                  ``max`` of the forward/backward phase (everything above) and the optimizer
                      phase (parameters, gradients, optimizer state).
====================  ===========================================================================

**Activations per layer.** Each family's formula (bytes per token a block saves for backward,
counted the way of Korthikanti et al. 2022, arXiv:2205.05198, §4.1) is its ``ModelSpec``'s
``block_activations``, in ``ray_titan/models/<family>/costs.py`` (``ray_titan.models.costs``);
``e`` is the activation element size (4 in fp32, 2 under ``training.mixed_precision = "bf16"``).
The plan applies, for every family:

- Activation checkpointing (``[activation_checkpoint]``): ``full`` keeps each block's input
  (``4·d``) and recomputes one block at a time in backward (a transient of one block's
  activations); ``selective``/``op`` keeps the block input and the outputs of attention and of
  every second matrix multiplication (torchtitan's policy: ``ray_titan.parallel.ac``,
  :func:`ray_titan.models.costs.op_sac_saved`) and recomputes the rest; ``selective``/``layer``
  checkpoints every ``layer_freq``-th block fully.
- The last stage keeps the logits ``e·V`` of every microbatch in flight (pipelining holds a
  stage's output until its backward) and the loss's log-softmax ``4·V``; other stages keep their
  output ``4·d``.

**Microbatches in flight.** Each pipeline schedule's rule (the microbatches whose forward ran and
whose backward has not, at a rank's peak, per local stage) is its ``in_flight`` in
:data:`ray_titan.parallel.schedules.SCHEDULES`, beside its other properties.

**Checked against measurement.** On CPU (fp32) the plan's peak is compared with the torch
profiler's peak of all tensors during step 2 (the run's memory breakdown,
``memory.breakdown_step``) for the debug Llama and DeepSeek over pp, dp_shard, ep, schedules and
AC modes: ``tests/integration/test_memory_plan.py`` (a handful) and ``python -m benchmarks.memory_plan`` (the
full table), within 15 %. On GPUs the caching allocator adds its own reserve and fragmentation
on top (``device_reserved`` − ``device_allocated``); bf16 figures are estimates.

**Levers.** When a rank does not fit ``device_memory``, the plan re-plans the job with each
lever and ranks them by cost: more microbatches (smaller ones; no extra compute), selective
then full activation checkpointing (recomputation), ``reshard_after_forward`` (more
all-gathers), CPU offload (host traffic, optimizer on the CPU), then more devices: a larger
``dp_shard``, tensor parallel where the mesh has it, more pipeline stages. The recommendation is
the cheapest prefix of those levers, applied together, that fits.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray_titan import storage
from ray_titan.config.schema import ConfigError, JobConfig, apply_overrides

if TYPE_CHECKING:
    from ray_titan.models.registry import ModelSpec
    from ray_titan.parallel.dims import ParallelDims
    from ray_titan.parallel.schedules import Schedule

__all__ = [
    "LISTED_RANKS",
    "PLAN_FILE",
    "Lever",
    "MemoryPlan",
    "RankPlan",
    "format_bytes",
    "memory_plan",
    "parse_bytes",
    "planned_rank",
    "write_memory_plan",
]

PLAN_FILE = "memory_plan.json"
"""Where a run records its plan: ``<run_dir>/memory_plan.json``."""

LISTED_RANKS = 1024
"""The one bound on the plan's mesh-sized work: a mesh of up to this many ranks gets one
:class:`RankPlan` per rank; a larger one, one per pipeline rank (its ranks share every figure),
standing for ranks ``rank`` to ``through``. A plan of a million ranks is then as small and quick
as one of a thousand (one record per rank was ~10 KB and ~50 µs: 6 GB and a minute)."""

MiB, GiB = 2**20, 2**30
_F32, _I64 = 4, 8


# -- parameters ------------------------------------------------------------------------------------
@dataclass
class _Group:
    """One FSDP group's parameters on one rank, in elements: ``local``, what the rank holds
    (FSDP2 shards dim 0, padded to a multiple of the group), and ``full``, what an all-gather
    puts together (padded)."""

    local: int = 0
    full: int = 0

    def add(self, shape: tuple[int, ...], shard: int) -> None:
        """Add a parameter of ``shape`` sharded over ``shard`` ranks (1: not sharded)."""
        rows, rest = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
        per = math.ceil(rows / shard)
        self.local += per * rest
        self.full += per * shard * rest


@dataclass
class _StageParams:
    root: _Group = field(default_factory=_Group)  # embedding, final norm, output head
    blocks: dict[int, _Group] = field(default_factory=dict)
    experts: dict[int, _Group] = field(default_factory=dict)  # only where FSDP groups them apart
    buffers: int = 0  # bytes of module buffers (rotary tables, router statistics)
    unmanaged: int = 0  # elements FSDP leaves out (routed experts expert parallelism alone holds)

    def groups(self) -> list[_Group]:
        return [self.root, *self.blocks.values(), *self.experts.values()]

    @property
    def local(self) -> int:
        return sum(g.local for g in self.groups()) + self.unmanaged

    @property
    def full(self) -> int:
        return sum(g.full for g in self.groups())


def _stage_params(whole: Any, layers: list[int], first: bool, last: bool, dp: int, ep: int,
                  tp: int, bf16: bool) -> _StageParams:
    """Elements per FSDP group of one stage on one rank. ``whole``: the model on meta; ``bf16``:
    FSDP2's bf16 policy, under which it wraps the routed experts even where expert parallelism
    leaves one rank to shard them over (``ray_titan.parallel.fsdp.apply_fsdp``)."""
    out = _StageParams()
    mod_ep = dp // ep
    keep = {str(i) for i in layers}
    for name, p in whole.named_parameters():
        shape = tuple(p.shape)
        parts = name.split(".")
        if parts[0] == "layers":
            if parts[1] not in keep:
                continue
            layer = int(parts[1])
            if ".experts." in name and tp > 1 and len(shape) == 3:  # split by hidden units over tp
                hidden = 2 if parts[-1] == "w2" else 1  # w1, w3 (n, hidden, dim); w2 (n, dim, hidden)
                shape = tuple(math.ceil(n / tp) if i == hidden else n for i, n in enumerate(shape))
            if ".experts." in name and ep > 1:
                shape = (shape[0] // ep, *shape[1:])
                if mod_ep > 1 or bf16:
                    out.experts.setdefault(layer, _Group()).add(shape, mod_ep)
                else:  # left out of FSDP: each rank holds its experts whole, never gathered
                    out.unmanaged += math.prod(shape)
                continue
            if tp > 1 and len(shape) == 2:  # tensor parallel splits the block's matrices
                shape = (math.ceil(shape[0] / tp), shape[1])
            out.blocks.setdefault(layer, _Group()).add(shape, dp)
        # A tied head's last stage (not the first) holds its own copy of the embedding
        # (ray_titan.parallel.pipeline.build_stage_module), absent from a tied model's parameters.
        elif ((parts[0] == "tok_embeddings" and (first or (last and getattr(whole, "tied", False))))
              or (parts[0] in ("norm", "output") and last)):
            if tp > 1 and len(shape) == 2:
                shape = (math.ceil(shape[0] / tp), shape[1])
            out.root.add(shape, dp)
    for name, b in whole.named_buffers():
        parts = name.split(".")
        if parts[0] != "layers" or parts[1] in keep:
            out.buffers += b.numel() * b.element_size()
    return out


# -- activations -----------------------------------------------------------------------------------
def _checkpointed(cfg: JobConfig, layer: int) -> str:
    """How block ``layer`` is checkpointed: ``none``, ``op`` or ``full`` (``ray_titan.parallel.ac``)."""
    ac = cfg.activation_checkpoint
    if ac.mode == "none":
        return "none"
    if ac.mode == "full":
        return "full"
    if ac.selective_option == "op":
        return "op"
    return "full" if layer % ac.layer_freq == 0 else "none"


# -- the plan --------------------------------------------------------------------------------------
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
    """On a mesh over :data:`LISTED_RANKS` ranks, the last rank this plan stands for (ranks
    ``rank`` to ``through``, one pipeline rank: the same figures; ``coords`` are ``rank``'s);
    None: ``rank`` alone."""
    peak_grads: int = 0
    """Gradient bytes alive at the peak (unsharded accumulated ones under FSDP)."""
    activations_freed_at_peak: int = 0
    """Of ``activations``, the bytes backward has freed by the transient's moment: at the peak
    they are the backward's temporaries (the plan's peak is unchanged; only its split)."""


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
    """The plan of a job (module docstring). ``job``: what was planned (model, mesh, schedule,
    microbatch, AC, dtype, device kind, routing imbalance, vocabulary); ``ranks``: one
    :class:`RankPlan` per rank; ``device_memory``: the capacity compared with (bytes, None if
    unknown) and where it came from; ``levers`` ranked by cost and ``recommendation`` (the
    overrides that make it fit, cheapest first; None if it fits or nothing does)."""

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
        :data:`LISTED_RANKS` ranks; :meth:`for_rank` finds any rank's)."""
        return {r.rank: r.peak for r in self.ranks}

    def for_rank(self, rank: int) -> RankPlan | None:
        """The plan holding ``rank``'s figures (a span's first rank's plan, coords included, when
        ``rank`` is inside it), or None for a rank off the mesh."""
        i = _covering([r.rank for r in self.ranks], [r.through for r in self.ranks], rank)
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


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """``80GiB``, ``80GB``, ``81920MiB``, ``1.5e9`` → bytes (``GB`` = 10⁹, ``GiB`` = 2³⁰), at least
    one byte and at most an exbibyte. Raises ``ValueError`` naming the text for anything else."""
    bad = f"{text!r} is not a size of memory; write e.g. 80GiB, 80GB or 81920MiB"
    if isinstance(text, int):
        n = text
    else:
        m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(bad)
        try:
            x = float(m.group(1)) * _UNITS[m.group(2).lower()]
        except ValueError:
            raise ValueError(bad) from None
        n = int(x) if math.isfinite(x) and x <= 2**60 else 2**61  # 1e400 is inf: refused below
    if not 1 <= n <= 2**60:
        raise ValueError(f"{bad} (between 1 B and 1 EiB)")
    return n


def format_bytes(n: float) -> str:
    """``1.50 GiB``, ``12.3 MiB``, ``512 KiB``."""
    for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}" if n / size < 100 else f"{n / size:.0f} {unit}"
    return f"{n:.0f} B"


def _optimizer_states(cfg: JobConfig) -> int:
    """fp32 states per parameter element of ``[optimizer]``."""
    o = cfg.optimizer
    if o.name in ("AdamW", "Adam"):
        return 2
    return 1 if o.beta1 > 0 else 0


def _vocab_size(cfg: JobConfig, args: Any) -> int:
    """The tokenizer's vocabulary (as the trainer builds the model), else the flavor's."""
    from ray_titan.data.tokenizer import build_tokenizer

    try:
        if cfg.data.tokenizer_path:  # a bucket that does not answer must not hang the plan
            storage.check_reachable(cfg.data.tokenizer_path, cfg.job.storage_timeout_s)
        return build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path).vocab_size
    except Exception:  # a tokenizer.json that is not here: plan with the flavor's vocabulary
        return args.vocab_size


@functools.lru_cache(maxsize=8)
def _meta_model(name: str, args: Any, vocab: int, extra: tuple[tuple[str, Any], ...]) -> Any:
    """The whole model of family ``name`` with the arguments ``args`` (a flavor's, or a Hugging
    Face checkpoint's ``config.json``; frozen dataclasses, so a cache key) on the meta device
    (nothing allocated); cached, since levers re-plan."""
    import torch

    from ray_titan.models.registry import build_model

    with torch.device("meta"):
        return build_model(name, "", vocab_size=vocab, args=args, **dict(extra))  # "": the flavor is in args


@dataclass(frozen=True)
class _Job:
    """What every rank's plan reads: the config, the mesh, the model on the meta device, the
    element sizes (bytes) and the microbatch (:func:`_job`)."""

    cfg: JobConfig
    device: str
    rho: float  # routing imbalance (MoE under expert parallel)
    dims: ParallelDims
    spec: ModelSpec
    args: Any  # the built model's arguments
    whole: Any  # the whole model on the meta device
    vocab: int
    bf16: bool
    e: int  # bytes of an activation element
    r: int  # bytes of a stage output element (the residual stream)
    mb: int  # sequences per microbatch
    tokens: int  # tokens per microbatch
    rule: Schedule | None  # the pipeline schedule's properties; None without one
    split: list[list[int]]  # each stage's layers
    reshard: bool  # FSDP's reshard_after_forward, resolved
    k_opt: int  # fp32 optimizer states per parameter element
    offload: bool  # CPU offload frees device memory

    @property
    def tp(self) -> int:
        return getattr(self.dims, "tp", 1)


def _job(cfg: JobConfig, device: str, rho: float, vocab_size: int | None) -> _Job:
    """The job as the plan reads it; builds the model on the meta device (cached). Raises
    :class:`ConfigError` for a pipeline schedule without an in-flight rule."""
    from ray_titan.checkpoint import job_model_args
    from ray_titan.models.registry import get_spec
    from ray_titan.parallel.dims import parallel_dims
    from ray_titan.parallel.fsdp import resolve_mixed_precision, resolve_reshard_after_forward
    from ray_titan.parallel.pipeline import split_layers
    from ray_titan.parallel.schedules import SCHEDULES

    dims = parallel_dims(cfg)
    par, tr = cfg.parallelism, cfg.training
    dp_total = dims.dp_shard * getattr(dims, "dp_replicate", 1)
    spec = get_spec(cfg.model.name)
    args = job_model_args(cfg)  # a Hugging Face checkpoint's config.json, else the flavor's
    # As the trainer builds it: a Hugging Face checkpoint's own vocabulary, else the tokenizer's.
    vocab = vocab_size or (args.vocab_size if cfg.checkpoint.initial_load_hf else _vocab_size(cfg, args))
    whole = _meta_model(cfg.model.name, args, vocab, tuple(sorted(spec.config_args(cfg.model).items())))
    # training.mixed_precision: bf16 activations; under FSDP2 the parameters are gathered in bf16
    # (pe = 2 bytes), without it autocast keeps a bf16 copy of the stage's weights (autocast_copy).
    bf16 = resolve_mixed_precision(tr.mixed_precision, device) == "bf16"
    mb = tr.global_batch_size // dp_total // par.microbatches
    rule = SCHEDULES.get(par.pipeline_schedule)
    if dims.pp > 1 and rule is None:
        raise ConfigError(f"parallelism.pipeline_schedule = {par.pipeline_schedule!r} has no in-flight rule; "
                          f"known: {sorted(SCHEDULES)}")
    return _Job(
        cfg=cfg, device=device, rho=rho, dims=dims, spec=spec, args=whole.args, whole=whole, vocab=vocab,
        bf16=bf16, e=2 if bf16 else _F32,
        r=2 if bf16 and dims.fsdp else _F32,  # a stage's output: fp32 under autocast
        mb=mb, tokens=mb * tr.seq_len, rule=rule, split=split_layers(whole.args.n_layers, dims.num_stages),
        reshard=resolve_reshard_after_forward(par.fsdp_reshard_after_forward, dims.pp > 1),
        k_opt=_optimizer_states(cfg), offload=cfg.memory.cpu_offload and device != "cpu",
    )


def _job_summary(j: _Job) -> dict[str, Any]:
    """The plan's ``job``: what was planned (model, mesh, schedule, batch, AC, dtype, device)."""
    cfg, dims, pp = j.cfg, j.dims, j.dims.pp
    ac = cfg.activation_checkpoint
    return {
        "model": cfg.model.name, "flavor": cfg.model.flavor, "vocab_size": j.vocab,
        "mesh": " × ".join(f"{a}={getattr(dims, a)}" for a in ("pp", "dp_shard", "tp", "ep")
                           if getattr(dims, a, 1) > 1 or a in ("pp", "dp_shard")),
        "world_size": dims.world_size, "schedule": cfg.parallelism.pipeline_schedule if pp > 1 else "none (pp = 1)",
        "stages_per_rank": dims.stages_per_rank, "microbatches": cfg.parallelism.microbatches,
        "microbatch_size": j.mb, "seq_len": cfg.training.seq_len,
        "ac": ac.mode + (f"/{ac.selective_option}" if ac.mode == "selective" else ""),
        "dtype": ("fp32" if not j.bf16 else "bf16 (FSDP2 mixed precision: bf16 params, fp32 reduce and master weights)"
                  if dims.fsdp else "bf16 (autocast, fp32 weights)"),
        "optimizer": cfg.optimizer.name,
        "device": j.device, "moe": hasattr(j.args, "n_routed_experts"), "routing_imbalance": j.rho,
        "reshard_after_forward": j.reshard, "cpu_offload": cfg.memory.cpu_offload,
    }


def _plan_ranks(cfg: JobConfig, device: str, rho: float,
                vocab_size: int | None) -> tuple[dict[str, Any], list[RankPlan]]:
    """What was planned, and every rank's plan in rank order: the ranks of one pipeline rank
    share their figures (:func:`_pp_rank_plans`)."""
    j = _job(cfg, device, rho, vocab_size)
    plans = {p.rank: p for pp_rank in range(j.dims.pp) for p in _pp_rank_plans(j, pp_rank)}
    return _job_summary(j), [plans[r] for r in sorted(plans)]


@dataclass
class _StageActivations:
    """One stage's activations of one microbatch, bytes: what it keeps for backward (``kept``),
    the MoE experts' share of it, the transient above it while backward runs, its pipeline
    receive buffers over the step's microbatches, and ``freed``: the part of ``kept`` already
    freed at the transient's moment (the blocks after the one whose backward peaks, and the
    head), which the peak's split counts as temporaries (``RankPlan.categories``)."""

    kept: float
    experts: float
    transient: float
    pipe: float
    freed: float = 0.0  # of ``kept``, freed by the transient's moment (the split of the peak)
    # Zero-bubble schedules, a stage whose backward is split (not the first): what an input-
    # gradient step keeps for its weight-gradient step, and the two steps' transients
    # (:func:`_zero_bubble_terms`).
    held: float = 0.0
    input_transient: float = 0.0
    weight_transient: float = 0.0
    # The backward's moments, last first (the head on the last stage, then each block): bytes
    # kept up to it, its transient, its layer (-1: the head); for _fsdp_backward_moment.
    scan: list[tuple[float, float, int]] = field(default_factory=list)


def _stage_activations(j: _Job, s: int, act_modes: dict[str, float]) -> _StageActivations:
    """Stage ``s``'s activations (module docstring); adds its per-token bytes under each AC mode
    to ``act_modes``."""
    cfg, args, e, r, pp, tr = j.cfg, j.args, j.e, j.r, j.dims.pp, j.cfg.training
    first, last = s == 0, s == j.dims.num_stages - 1
    # Per token of one microbatch: what it keeps, and the most it holds while backward runs (from
    # the last block back: the blocks not yet done, the block being recomputed, the block's
    # backward temporaries).
    kept_so_far, backward_peak, moe_part, unsplit = 0.0, 0.0, 0.0, 0.0
    kept_at_peak = 0.0  # what is still kept at the backward's peak moment (the blocks up to it)
    blocks = []  # (block, how checkpointed, layer), for the zero-bubble terms
    scan: list[tuple[float, float, int]] = []  # per block: kept up to it, its backward's transient, layer
    for i, layer in enumerate(j.split[s]):
        blk = j.spec.block_activations(args, layer, e, tr.seq_len, j.device, j.rho, j.dims.ep)
        how = _checkpointed(cfg, layer)
        blocks.append((blk, how, layer))
        kept = blk.kept(how)
        if i == 0 and not first:
            kept -= r * args.dim  # its input is the pipeline's receive buffer
        kept_so_far += kept
        scan.append((kept_so_far, blk.recompute(how) + blk.backward, layer))
        if kept_so_far + blk.recompute(how) + blk.backward > backward_peak:
            backward_peak, kept_at_peak = kept_so_far + blk.recompute(how) + blk.backward, kept_so_far
        moe_part += blk.experts(how)
        unsplit += blk.unsplit(how)
        lay = layer % cfg.activation_checkpoint.layer_freq == 0
        act_modes["none"] += blk.none
        act_modes["full"] += blk.input
        act_modes["selective_op"] += blk.op
        act_modes["selective_layer"] += blk.input if lay else blk.none
    head, loss_whole = 0.0, 0.0
    if last:  # final norm, output head's input, the loss's log-softmax
        head = _F32 * (2 * args.dim + 1) + e * args.dim + _F32 * j.vocab
        if pp > 1:
            head += e * j.vocab  # the stage output (logits) waits for its backward
        # The loss's backward: the gradients of the log-softmax and of the logits, both fp32 (the
        # loss upcasts bf16 logits; measured on the simulated GPU).
        loss_bwd = 2 * _F32 * j.vocab
        scan.append((kept_so_far + head, loss_bwd, -1))
        if kept_so_far + head + loss_bwd >= backward_peak:
            backward_peak, kept_at_peak = kept_so_far + head + loss_bwd, kept_so_far + head
        if j.tp > 1 and not cfg.parallelism.loss_parallel:  # replicated logits: the loss's are whole
            unsplit += _F32 * j.vocab + (e * j.vocab if pp > 1 else 0)
            loss_whole = loss_bwd
    elif pp > 1:
        head = r * args.dim  # the stage's output waits for its backward
    for key in act_modes:
        act_modes[key] += head
    per_token = kept_so_far + head + (_I64 if first else 0)
    # At the transient's moment (a block's backward) the blocks after it and the head are freed
    # already: kept bytes that the plan's split counts as temporaries then, not activations. Not
    # a last stage's logits under PP: the stage output, held by torch's backward_one_chunk until
    # it returns (simulated GPU, Interleaved1F1B).
    stays = e * j.vocab if last and pp > 1 else 0.0
    freed = per_token - (_I64 if first else 0) - kept_at_peak - stays if backward_peak > per_token else 0.0
    n = cfg.parallelism.microbatches
    # Tensor parallel splits all but the projections' whole inputs (BlockActivations.whole); under
    # sequence parallel a stage sends and receives its 1/tp of the sequence.
    sp = j.tp if j.tp > 1 and cfg.parallelism.sequence_parallel else 1
    held = input_t = weight_t = 0.0
    if pp > 1 and j.rule is not None and j.rule.zero_bubble and not first:
        loss_t = 2.0 * _F32 * j.vocab if last else 0.0
        held, input_t, weight_t = (x * j.tokens / j.tp for x in _zero_bubble_terms(j, s, blocks, loss_t))
    return _StageActivations(
        kept=(per_token / j.tp + unsplit * (1 - 1 / j.tp)) * j.tokens, experts=moe_part * j.tokens / j.tp,
        transient=(max(0.0, backward_peak - per_token) / j.tp + loss_whole * (1 - 1 / j.tp)) * j.tokens,
        freed=max(0.0, freed) * j.tokens / j.tp,
        pipe=r * args.dim * j.tokens * n * ((0 if first else 1) + (0 if last else 1)) / sp if pp > 1 else 0.0,
        held=held, input_transient=input_t, weight_transient=weight_t,
        scan=[(k * j.tokens / j.tp, t * j.tokens / j.tp, layer) for k, t, layer in scan])


def _zero_bubble_terms(j: _Job, s: int, blocks: list[tuple[Any, str, int]],
                       loss_bwd: float) -> tuple[float, float, float]:
    """Per token of one microbatch on stage ``s`` (not the first) of a zero-bubble schedule, bytes:
    what its input-gradient step ``I`` keeps until its weight-gradient step ``W``, the most ``I``
    holds above that and the kept activations, and the most ``W`` holds. ``blocks``: the stage's
    (block activations, how checkpointed, layer); ``loss_bwd``: the loss's backward on the last
    stage (0 elsewhere).

    Read from torch (``torch/distributed/pipelining``, 2.13): ``stage.backward_one_chunk(...,
    full_backward=False)`` runs ``_backward.stage_backward_input``, one ``autograd.grad`` to the
    stage input with ``retain_graph=True``: every saved activation stays (the graph is kept for
    ``W``, so nothing is freed as a full backward frees it) and each parameter group keeps the
    gradients flowing into its intermediate node, the output gradient of each weight-consuming op
    (``BlockActivations.weight_step_inputs``; on the last stage also the logits' gradient ``e·V``
    and the final norm's, ``4·d + e·d``). The first stage skips ``I`` and runs a full backward at
    ``W`` (``backward_weight_one_chunk``, ``stage_index == 0``): no terms here. ``W``
    (``stage_backward_weight``) calls ``autograd.grad`` once per parameter group, one per
    parameter tensor of a block: for a checkpointed block each call is a new graph task, so
    ``torch.utils.checkpoint`` (non-reentrant) recomputes the block each time and keeps every
    recomputed tensor whose saved-tensor holder is still alive until the graph dies at the step's
    end. Measured on the CPU (real tensors, one stage of debug blocks) and on the simulated GPU:
    ``W`` holds ``(G − 3)·R`` per checkpointed block plus one recomputation ``R`` in progress,
    ``G`` the block's parameter tensors and ``R`` its recomputed bytes (Llama: 6.9 R for one
    block, G = 9; 6.1 R per block over four; Qwen3 8.1 R, G = 11; DeepSeek-V2's dense block 7.8
    R, G = 10; its MoE block 7.5 R, G = 14, overestimated by this count)."""
    args, e, last = j.args, j.e, s == j.dims.num_stages - 1
    held = [blk.weight_step_inputs() for blk, _, _ in blocks]
    if blocks and not last:
        held[-1] -= j.r * args.dim  # the last block's output gradient is the received one (a pipeline buffer)
    head = e * j.vocab + _F32 * args.dim + e * args.dim if last else 0.0
    # I: from the last block back, each block's backward above the gradients already held.
    so_far, input_t = head, loss_bwd
    for (blk, how, _), h in zip(reversed(blocks), reversed(held)):
        input_t = max(input_t, so_far + blk.recompute(how) + blk.backward)
        so_far += h
    input_t = max(input_t, so_far)
    recomputed = [(sum(1 for _ in j.whole.layers[str(layer)].parameters()), blk.recompute(how))
                  for blk, how, layer in blocks if how != "none"]
    leak = sum(max(0, g - 3) * r for g, r in recomputed) + max((r for _, r in recomputed), default=0.0)
    return so_far, input_t, leak


def _model_states(j: _Job, params: dict[int, _StageParams]) -> tuple[int, int, int, float, float]:
    """One rank's model states and FSDP's buffers, bytes: parameters, optimizer state, gradients
    after the reduce-scatter, the gathered parameters and the gradients while backward runs."""
    dims, n = j.dims, j.cfg.parallelism.microbatches
    local = sum(p.local for p in params.values())
    full = sum(p.full for p in params.values())
    param_b = _F32 * local
    opt_b = _F32 * j.k_opt * local
    grads_after = _F32 * local
    gathered: float
    grads_during: float
    pe = j.e  # bytes of a gathered parameter: bf16 under FSDP2's MixedPrecisionPolicy
    if dims.dp_shard > 1:
        biggest = max((g.full for p in params.values() for g in [*p.blocks.values(), *p.experts.values()]),
                      default=0)
        if dims.pp > 1 or not j.reshard:
            gathered = pe * full
        else:
            gathered = pe * (sum(p.root.full for p in params.values()) + 2 * biggest)
        # Accumulated unsharded gradients are kept in the reduce dtype (fp32); one microbatch:
        # a block's gradient in the parameter dtype and its fp32 copy for the reduce-scatter.
        # Experts FSDP leaves out keep their gradients in place (fp32), as any unsharded one.
        # Interleaved (loop placement): a rank runs its last stage's backward first, and its
        # other stages' only after the next rounds: at the peak (the first backward after the
        # warm-up) only that stage's gradients are accumulated (simulated: ray-titan dry-run).
        # The V placement's two stages are consecutive on the rank and start backward together.
        loop = j.rule is not None and j.rule.placement == "loop" and len(params) > 1
        last = params[max(params)]
        held = [last] if loop else list(params.values())
        first_bwd, unmanaged = (last.full if loop else full), sum(p.unmanaged for p in held)
        grads_during = _F32 * (first_bwd + unmanaged) if n > 1 else _F32 * local + (pe + _F32) * biggest
    else:
        # Autocast's cache: a bf16 copy of every weight, alive until the step's region ends.
        gathered, grads_during = (2.0 * local if j.bf16 and not dims.fsdp else 0.0), float(grads_after)
    return param_b, opt_b, grads_after, gathered, grads_during


def _pp_rank_plans(j: _Job, pp_rank: int) -> list[RankPlan]:
    """The plans of the ranks at pipeline rank ``pp_rank``: their stages' parameters and
    activations times the microbatches in flight, and the peak of the forward/backward and the
    optimizer phases."""
    from ray_titan.parallel.schedules import InFlight, local_stages

    cfg, dims, tr = j.cfg, j.dims, j.cfg.training
    pp, v, n = dims.pp, dims.stages_per_rank, cfg.parallelism.microbatches
    stage_ids = local_stages(j.rule.placement, pp, v, pp_rank) if pp > 1 and j.rule is not None else [0]
    flight = j.rule.in_flight(pp, v, n, pp_rank) if pp > 1 and j.rule is not None else \
        InFlight((1,), (1 if n > 1 else 0,))
    params = {s: _stage_params(j.whole, j.split[s], s == 0, s == dims.num_stages - 1, dims.dp_shard, dims.ep, j.tp,
                               j.bf16) for s in stage_ids}
    act_modes = dict.fromkeys(("none", "full", "selective_op", "selective_layer"), 0.0)
    acts = {s: _stage_activations(j, s, act_modes) for s in stage_ids}
    pipe = sum(a.pipe for a in acts.values())
    param_b, opt_b, grads_after, gathered, grads_during = _model_states(j, params)
    batch_bytes = 2 * _I64 * j.mb * n * tr.seq_len  # inputs and labels of the step
    buffers = sum(p.buffers for p in params.values()) + batch_bytes
    a_peak = sum(c * acts[s].kept for c, s in zip(flight.peak, stage_ids))
    a_grads = sum(c * acts[s].kept for c, s in zip(flight.with_grads, stage_ids))
    transient, freed = max((a.transient, a.freed) for a in acts.values())
    resident = 0.0 if j.offload else param_b + opt_b
    base = resident + gathered + pipe + buffers
    before_grads = base + a_peak + transient
    with_grads = base + grads_during + a_grads + transient
    # The first stage's backward ends with the embedding's whole gradient in the compute dtype
    # beside FSDP2's fp32 accumulation of it, the microbatch just done freed (gpt-oss-120B rank 0:
    # 1.1 GiB, on the simulated GPU).
    emb_grad = j.e * j.vocab * j.args.dim / j.tp if 0 in stage_ids and dims.dp_shard > 1 else 0.0
    a_after = sum(max(c - 1, 0) * acts[s].kept for c, s in zip(flight.peak, stage_ids))
    if emb_grad and base + grads_during + a_after + emb_grad > max(before_grads, with_grads):
        with_grads, a_grads, transient = base + grads_during + a_after + emb_grad, a_after, emb_grad
    in_flight = {s: c for c, s in zip(flight.peak, stage_ids)}
    if pp == 1 and dims.dp_shard > 1:
        # FSDP2 without PP: the gradient-syncing microbatch's backward, block by block
        # (_fsdp_backward_moment); the first microbatch's (no gradients) is before_grads.
        fb = _fsdp_backward_moment(j, acts[0], params[0])
        if base + fb.activations + fb.transient + fb.grads >= before_grads:
            with_grads = base + fb.activations + fb.transient + fb.grads
            a_grads, transient, freed, grads_during = fb.activations, fb.transient, 0.0, fb.grads
    if pp > 1 and j.rule is not None and j.rule.stages_per_rank != 1:
        # Several stages per rank (interleaved, zero-bubble, DualPipeV): the peak's moment found
        # by walking the rank's actions, each stage's backward with what is in flight then, and
        # what stays from each input-gradient step to its weight-gradient step (_zero_bubble_peak).
        zb = _zero_bubble_peak(j, pp_rank, stage_ids, acts, params, grads_during)
        before_grads = with_grads = base + zb.activations + zb.transient + zb.grads
        a_peak = a_grads = zb.activations
        transient, freed, in_flight, grads_during = zb.transient, zb.freed, zb.in_flight, zb.grads
    fwd_bwd = max(before_grads, with_grads)
    optim = (0.0 if j.offload else param_b + grads_after + opt_b) + pipe + buffers
    peak, phase = (fwd_bwd, "forward_backward") if fwd_bwd >= optim else (optim, "optimizer")
    peak_grads = grads_during if with_grads >= before_grads else 0.0
    off, plans = j.offload, []
    act_mb = {s: int(acts[s].kept) for s in stage_ids}
    by_mode = {k: int(x * j.tokens / j.tp) for k, x in act_modes.items()}
    for rank, through in _listed_ranks(dims, pp_rank):
        plans.append(RankPlan(
            rank=rank, coords=dims.coords(rank), through=through, stages=stage_ids,
            parameters=int(0 if off else param_b),
            gradients=int(0 if off else grads_after),
            optimizer_state={cfg.optimizer.name: int(0 if off else opt_b)},
            fsdp_unsharded_params=int(gathered), fsdp_unsharded_grads=int(grads_during if dims.dp_shard > 1 else 0),
            activations_per_microbatch=dict(act_mb), in_flight=dict(in_flight),
            activations=int(a_peak if before_grads >= with_grads else a_grads),
            activations_by_ac_mode=dict(by_mode),
            expert_buffers=int(sum(c * acts[s].experts for c, s in zip(flight.peak, stage_ids))),
            pipeline_buffers=int(pipe), buffers=int(buffers), transient=int(transient),
            peak=int(peak), peak_phase=phase,
            offloaded=int(param_b + grads_after + opt_b) if off else 0,
            peak_grads=int(peak_grads if phase == "forward_backward" else grads_after),
            activations_freed_at_peak=int(min(freed, a_peak if before_grads >= with_grads else a_grads)),
        ))
    return plans


def _covering(firsts: list[int], throughs: list[int | None], rank: int) -> int | None:
    """Index of the plan (first ranks ``firsts``, ascending; spans to ``throughs``) holding ``rank``."""
    i = bisect.bisect_right(firsts, rank) - 1
    last = firsts[i] if i < 0 or throughs[i] is None else throughs[i]
    return i if i >= 0 and rank <= last else None  # type: ignore[operator]


def planned_rank(ranks: list[dict[str, Any]], rank: int) -> dict[str, Any] | None:
    """Of a recorded plan's ``ranks`` (``memory_plan.json``, in rank order), the one holding
    ``rank``'s figures (a span's, on a mesh over :data:`LISTED_RANKS` ranks), or None."""
    return None if (i := _covering([r["rank"] for r in ranks], [r.get("through") for r in ranks], rank)) is None \
        else ranks[i]


def _listed_ranks(dims: ParallelDims, pp_rank: int) -> list[tuple[int, int | None]]:
    """The plans to make for pipeline rank ``pp_rank``: ``(rank, None)`` for each of its ranks, or
    one ``(first, last)`` span on a mesh over :data:`LISTED_RANKS` ranks."""
    per_pp = dims.world_size // dims.pp  # pp is the mesh's outermost axis: a pp rank's ranks are one block
    first, last = pp_rank * per_pp, (pp_rank + 1) * per_pp - 1
    if dims.world_size > LISTED_RANKS:
        return [(first, last if last > first else None)]
    return [(rank, None) for rank in range(first, last + 1)]


@dataclass
class _Moment:
    """The peak's moment of a zero-bubble rank (:func:`_zero_bubble_peak`), bytes: the kept
    activations, the transient (what input-gradient steps hold for their weight-gradient steps
    and the running step's own), the part of ``activations`` a full backward has freed by then,
    the gradients, and the microbatches in flight per stage."""

    activations: float
    transient: float
    freed: float
    grads: float
    in_flight: dict[int, int]


def _fsdp_backward_moment(j: _Job, a: _StageActivations, p: _StageParams) -> _Moment:
    """The most memory above the resident states while FSDP2 (no PP) runs the backward of the
    microbatch that syncs gradients (the last; the only one with one microbatch), from the head
    to the first block (``a.scan``): what is still kept up to the block, its transient, the
    gradients, and the reduce-scatter's buffers of the block finished just before (its gradient
    in the parameter dtype and the fp32 copy reduced, ``(e + 4)·G`` for the largest block ``G``;
    from the second block on: the head's groups are reduced last, with the root). Gradients: with
    several microbatches the accumulated unsharded ones (fp32) less what the finished blocks'
    reduce-scatters freed (their shards stay, on the host under CPU offload); with one, the
    finished blocks' shards and the root's unsharded ones. Measured on the simulated GPU
    (``ray-titan dry-run``, 2026-11-26): the peak at a checkpointed block's recomputation, the
    buffers ``(e + 4)·G`` of the block after it beside it (fsdp2 bf16 full AC, HSDP fp32
    selective layer)."""
    n, pe = j.cfg.parallelism.microbatches, j.e
    biggest = max((g.full for g in [*p.blocks.values(), *p.experts.values()]), default=0)
    extra = a.kept - (a.scan[-1][0] if a.scan else 0.0)  # kept outside the blocks (the token ids)
    groups = dict(p.blocks)
    total_full = sum(g.full for g in p.groups()) + p.unmanaged
    best: _Moment | None = None
    finished: list[int] = []
    for kept, t, layer in reversed(a.scan):
        done = [groups[x] for x in finished if x in groups]
        shards = 0.0 if j.offload else _F32 * sum(g.local for g in done)  # CPU offload: on the host
        if n > 1:
            grads = _F32 * (total_full - sum(g.full for g in done)) + shards
        else:
            grads = shards + pe * p.root.full
        rs = (pe + _F32) * biggest if done else 0.0
        m = _Moment(kept + extra, t + rs, 0.0, grads, {0: 1})
        if best is None or m.activations + m.transient + m.grads > best.activations + best.transient + best.grads:
            best = m
        if layer >= 0:
            finished.append(layer)
    assert best is not None
    return best


def _zero_bubble_peak(j: _Job, pp_rank: int, stage_ids: list[int], acts: dict[int, _StageActivations],
                      params: dict[int, _StageParams], grads_during: float) -> _Moment:
    """Walk pp rank ``pp_rank``'s actions of one step as torch orders them
    (``ray_titan.parallel.schedules.rank_actions``) and return the moment of the most memory
    above the resident states: a forward adds its stage's kept activations; an input-gradient
    step ``I`` of a stage that is not the first runs its transient and then keeps ``held`` until
    its ``W``; ``W`` (on the first stage a full backward) and a full backward ``B`` run theirs and
    end the microbatch. Gradients count from a stage's first ``W`` or ``B`` on (a full backward's
    from its end, when its transient is gone; a ``W``'s beside what it keeps at its end): FSDP2's
    unsharded accumulation of that stage (more than one microbatch), else its sharded ones
    (``_StageActivations``, :func:`_zero_bubble_terms`)."""
    from ray_titan.parallel.schedules import rank_actions

    dims, n = j.dims, j.cfg.parallelism.microbatches
    fsdp_acc = dims.dp_shard > 1 and n > 1

    def stage_grads(s: int) -> float:
        p = params[s]
        return _F32 * (p.full + p.unmanaged) if fsdp_acc else _F32 * p.local

    per_stage = {s: stage_grads(s) for s in stage_ids}
    scale = grads_during / max(1.0, sum(per_stage.values()))  # FSDP2 with one microbatch: its own count
    in_flight, held = dict.fromkeys(stage_ids, 0), dict.fromkeys(stage_ids, 0)
    done: set[int] = set()
    best = _Moment(0.0, 0.0, 0.0, 0.0, dict(in_flight))

    def moment(t: float, freed: float = 0.0) -> None:
        nonlocal best
        kept = sum(in_flight[x] * acts[x].kept for x in stage_ids)
        grads = sum(per_stage[x] for x in done) * (1.0 if fsdp_acc or dims.dp_shard == 1 else scale)
        transient = t + sum(held[x] * acts[x].held for x in stage_ids)
        if kept + transient + grads > best.activations + best.transient + best.grads:
            best = _Moment(kept, transient, min(freed, kept), grads, dict(in_flight))

    for kind, s, _ in rank_actions(j.cfg.parallelism.pipeline_schedule, dims.pp, dims.stages_per_rank, n, pp_rank):
        a, first = acts[s], s == 0
        if kind == "F":
            in_flight[s] += 1
            moment(0.0)
        elif kind == "I":
            moment(0.0 if first else a.input_transient)
            held[s] += 0 if first else 1
        elif kind == "W" and not first:
            # W consumes the held gradients as it makes the weight gradients: at its start the
            # one, at its end the other and (checkpointed blocks) the recomputations it keeps.
            moment(0.0)
            held[s] -= 1
            done.add(s)
            moment(a.weight_transient)
            in_flight[s] -= 1
        else:  # a full backward (B, or W of the first stage): its weight gradients come at its end
            moment(a.transient, a.freed)
            in_flight[s] -= 1
            done.add(s)
            moment(0.0)
    return best


def _detect_device_memory() -> tuple[int | None, str]:
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        return total, f"detected: {torch.cuda.get_device_name(0)}"
    return None, "no CUDA device here; pass --device-memory, e.g. 80GiB"


# (key, group, cost): levers in cost order, cheapest first. One lever per group at a time.
_LEVERS = [
    ("microbatches", "microbatches",
     "smaller microbatches: no extra compute or devices; smaller matmuls run less efficiently"),
    ("selective_op", "ac",
     "recomputes norms, rotary embeddings and activation functions in backward (a few % more compute)"),
    ("selective_layer", "ac", "recomputes every 2nd block's forward in backward (~+17% compute)"),
    ("full_ac", "ac", "recomputes every block's forward in backward (~+33% compute)"),
    ("reshard", "reshard", "all-gathers each block again in backward (more communication)"),
    ("cpu_offload", "offload", "parameters, gradients and optimizer state in host memory: host-device copies "
                               "every step, optimizer on the CPU (much slower steps)"),
    ("dp_shard", "dp_shard", "2× the devices (FSDP shards model states over twice as many ranks)"),
    ("tp", "tp", "2× the devices (tensor parallel splits matrices and, with sequence parallel, activations)"),
    ("pp", "pp", "2× the devices (twice the pipeline stages) and a longer pipeline bubble"),
]


def _lever_candidates(cfg: JobConfig, device: str) -> list[tuple[str, str, list[str]]]:
    """(key, name, overrides) of every lever that applies to ``cfg``, in cost order."""
    par, ac = cfg.parallelism, cfg.activation_checkpoint
    out = []
    local = cfg.training.global_batch_size // (par.dp_shard * par.microbatches)
    if par.pipeline_schedule != "GPipe" and local % 2 == 0:
        out.append(("microbatches", f"microbatches {par.microbatches} → {2 * par.microbatches}",
                    [f"--parallelism.microbatches={2 * par.microbatches}"]))
    if ac.mode == "none":
        out.append(("selective_op", "activation checkpointing selective/op",
                    ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=op"]))
        out.append(("selective_layer", "activation checkpointing selective/layer (every 2nd)",
                    ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=layer",
                     "--activation_checkpoint.layer_freq=2"]))
    if ac.mode != "full":
        out.append(("full_ac", "activation checkpointing full", ["--activation_checkpoint.mode=full"]))
    if par.dp_shard > 1 and par.pp == 1 and par.fsdp_reshard_after_forward == "never":
        out.append(("reshard", "fsdp_reshard_after_forward always",
                    ["--parallelism.fsdp_reshard_after_forward=always"]))
    if par.dp_shard > 1 and not cfg.memory.cpu_offload and device != "cpu":
        out.append(("cpu_offload", "CPU offload", ["--memory.cpu_offload=true"]))
    gbs = cfg.training.global_batch_size
    # More devices keep each rank's batch where the global batch cannot be split further.
    dp_more = [f"--parallelism.dp_shard={2 * par.dp_shard}"]
    dp_name = f"dp_shard {par.dp_shard} → {2 * par.dp_shard}"
    if gbs % (2 * par.dp_shard * par.microbatches):
        dp_more.append(f"--training.global_batch_size={2 * gbs}")
        dp_name += f" (global batch {gbs} → {2 * gbs})"
    out.append(("dp_shard", dp_name, dp_more))
    if hasattr(par, "tp"):  # tensor parallel, where the mesh has it
        tp = par.tp
        out.append(("tp", f"tp {tp} → {2 * tp}", [f"--parallelism.tp={2 * tp}"]))
    pp_more = [f"--parallelism.pp={2 * par.pp}"]
    pp_name = f"pp {par.pp} → {2 * par.pp}"
    if par.pp == 1:
        pp_more.append("--parallelism.pipeline_schedule=1F1B")
    n = max(par.microbatches, 2 * par.pp)  # 1F1B and the interleaved schedules need n >= pp
    if n != par.microbatches:
        pp_more.append(f"--parallelism.microbatches={n}")
        pp_name += f", microbatches {par.microbatches} → {n}"
    g = gbs
    while g % (par.dp_shard * n):
        g *= 2
    if g != gbs:
        pp_more.append(f"--training.global_batch_size={g}")
        pp_name += f" (global batch {gbs} → {g})"
    out.append(("pp", pp_name, pp_more))
    return out


def _variant(cfg: JobConfig, overrides: list[str]) -> JobConfig | None:
    """``cfg`` with ``overrides``, or None when the result is not a valid job (the checks the
    driver runs before workers start, without the data ones)."""
    from ray_titan.preflight.checks import validate_job

    data = cfg.model_dump()
    data["ray"]["num_workers"] = None  # a lever may change the worker count
    try:
        new = JobConfig.from_dict(apply_overrides(data, overrides))
        validate_job(new, check_data=False)
    except (ConfigError, ValueError):
        return None
    return new


def _add_levers(plan: MemoryPlan, cfg: JobConfig, device: str, rho: float, vocab: int) -> None:
    """Each lever alone (those that lower the peak) into ``plan.levers``, and the cheapest set of
    levers that fits into ``plan.recommendation``: the one whose dearest lever is cheapest, then
    with the fewest and cheapest levers (one activation checkpointing mode at a time)."""
    usable = plan.usable
    assert usable is not None
    order = {key: (i, group, cost) for i, (key, group, cost) in enumerate(_LEVERS)}
    for key, name, overrides in _lever_candidates(cfg, device):
        variant = _variant(cfg, overrides)
        if variant is None:
            continue
        peak = max(r.peak for r in _plan_ranks(variant, device, rho, vocab)[1])
        if peak >= plan.max_peak:
            continue  # does not lower the peak (e.g. more microbatches under GPipe)
        rank, _, cost = order[key]
        plan.levers.append(Lever(name, overrides, peak, peak <= usable, cost, rank))
    best: tuple | None = None
    for n in range(1, len(plan.levers) + 1):
        for combo in itertools.combinations(plan.levers, n):
            groups = [_LEVERS[lv.rank][1] for lv in combo]
            if len(set(groups)) < len(groups):
                continue
            cost_key = (max(lv.rank for lv in combo), n, sum(lv.rank for lv in combo))
            if best is not None and cost_key >= best[0]:
                continue
            overrides = [o for lv in sorted(combo, key=lambda lv: lv.rank) for o in lv.overrides]
            variant = _variant(cfg, overrides)
            if variant is None:
                continue
            if max(r.peak for r in _plan_ranks(variant, device, rho, vocab)[1]) <= usable:
                best = (cost_key, overrides)
    if best is not None:
        plan.recommendation = best[1]


def memory_plan(
    cfg: JobConfig, device_memory: int | str | None = None, device: str | None = None,
    routing_imbalance: float = 1.0, vocab_size: int | None = None, levers: bool = True,
    margin: float | None = None,
) -> MemoryPlan:
    """Plan every rank's memory for ``cfg`` without starting anything (module docstring).

    ``device_memory``: bytes (or ``"80GiB"``) each rank's device has; default: the detected CUDA
    device's, else unknown (no fit verdict). ``device``: ``"cuda"`` (any accelerator) or ``"cpu"``;
    default ``cuda`` when ``ray.use_gpu`` or a device capacity is given, else ``cpu``. It decides
    the attention kernel (PyTorch's CPU kernel saves ``s × s`` probabilities where query and value
    head dimensions differ) and whether CPU offload frees device memory. ``routing_imbalance``:
    MoE only, max over mean of the tokens an expert-parallel rank's experts receive (>= 1).
    ``vocab_size``: default the tokenizer's, as the trainer builds the model (the flavor's where the
    tokenizer file is not here). ``levers``: also rank the levers when the job does not fit.
    ``margin``: share of the capacity kept free for what the plan does not count (the CUDA
    context, NCCL buffers, the caching allocator's fragmentation); default 0.08 on ``cuda``
    (PyTorch's own context and NCCL take ~1-3 GiB of an 80 GiB device, fragmentation a few %
    more), 0 on ``cpu``.

    Raises :class:`ConfigError` for a job that is not valid (mesh, batch, schedule) or a bad
    argument.
    """
    from ray_titan.checkpoint import resolve_hf_job
    from ray_titan.preflight.checks import validate_job

    cfg = resolve_hf_job(cfg)  # a Hugging Face job's family and sizes are its config.json's
    if not 1 <= routing_imbalance < math.inf:  # NaN too
        raise ConfigError(f"routing imbalance = {routing_imbalance}: a finite number >= 1 (max over mean "
                          "load of an expert-parallel rank; 1 is balanced)")
    if vocab_size is not None and not 1 <= vocab_size <= 2**31 - 1:  # token ids are int32 at most
        raise ConfigError(f"vocab size = {vocab_size}: a positive number of tokens (at most 2^31 - 1), or leave "
                          "it unset for the tokenizer's")
    try:
        capacity = parse_bytes(device_memory) if device_memory is not None else None
    except ValueError as e:
        raise ConfigError(f"device memory: {e}") from None
    validate_job(cfg, check_data=False)
    source = "given"
    if capacity is None:
        capacity, source = _detect_device_memory()
    device = device or ("cuda" if cfg.ray.use_gpu or capacity is not None else "cpu")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"device = {device!r}: 'cuda' (any accelerator) or 'cpu'")
    job, ranks = _plan_ranks(cfg, device, routing_imbalance, vocab_size)
    if margin is None:
        margin = 0.08 if device == "cuda" else 0.0
    if not 0 <= margin < 1:
        raise ConfigError(f"margin = {margin}: a share of the device memory in [0, 1)")
    plan = MemoryPlan(job=job, ranks=ranks, device_memory=capacity, device_memory_source=source, margin=margin)
    if job["dtype"] != "fp32" and (job["model"] != "llama" or not job["dtype"].startswith("bf16 (FSDP2")):
        # Checked against what autograd saves: fp32 blocks of every family, and bf16 Llama blocks
        # with bf16 weights (tests/integration/test_memory_plan.py).
        plan.notes.append("bf16 activations are estimated (the formulas are checked against fp32 runs, "
                          "and bf16 Llama blocks under FSDP2 mixed precision)")
    if levers and plan.fits is False:
        _add_levers(plan, cfg, device, routing_imbalance, job["vocab_size"])
    return plan


def write_memory_plan(plan: MemoryPlan, run_dir: Path | str) -> dict[str, Any]:
    """Write a run's ``plan`` to ``<run_dir>/memory_plan.json`` (``run_dir`` a local path or a URI)
    and print each rank group's predicted peak; returns the plan as a dict. The plan is made before
    anything starts (:func:`ray_titan.preflight.prepare.prepare_job`)."""
    from ray_titan.run_dir import under

    data = plan.to_dict()
    storage.write_text(under(run_dir, PLAN_FILE), json.dumps(data, indent=1))
    peaks = ", ".join(f"ranks {_rank_list(ranks)} {format_bytes(r.peak)}" for ranks, r in _groups(plan.ranks))
    print(f"ray_titan: memory plan: predicted peak {peaks} ({under(run_dir, PLAN_FILE)})", flush=True)
    return data
