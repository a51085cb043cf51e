"""One rank's model states in the memory plan: the rows ``parameters``, ``gradients``,
``optimizer state`` and ``FSDP unsharded`` of the table in :mod:`ray_titan.preflight.memory_plan`
(ZeRO's model-state count with FSDP2 as ZeRO-3, the sources there). The elements every FSDP group
of a stage holds on the rank (:func:`_stage_params`), and the bytes they come to
(:func:`_model_states`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ray_titan.preflight.plan_job import _F32, _Job


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
    root: _Group = field(default_factory=_Group)  # final norm, output head, a tied embedding
    embed: _Group = field(default_factory=_Group)  # an untied embedding: a group of its own
    blocks: dict[int, _Group] = field(default_factory=dict)
    experts: dict[int, _Group] = field(default_factory=dict)  # only where FSDP groups them apart
    buffers: int = 0  # bytes of module buffers (rotary tables, router statistics)
    unmanaged: int = 0  # elements FSDP leaves out (routed experts expert parallelism alone holds)

    def groups(self) -> list[_Group]:
        return [self.root, self.embed, *self.blocks.values(), *self.experts.values()]

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
    mtp = list(getattr(whole, "mtp_layer_ids", ()))  # multi-token prediction's blocks: the last stage's
    if last:
        keep |= set(mtp)
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
            # Tensor parallel splits the block's matrices; not an MTP depth's eh_proj (replicated:
            # ray_titan.parallel.tp.mtp_depth_plan).
            if tp > 1 and len(shape) == 2 and not name.endswith(".eh_proj.weight"):
                shape = (math.ceil(shape[0] / tp), shape[1])
            out.blocks.setdefault(layer, _Group()).add(shape, dp)
        # A tied head's last stage (not the first) holds its own copy of the embedding
        # (ray_titan.parallel.pipeline.build_stage_module), absent from a tied model's parameters;
        # so does one with multi-token prediction (``mtp_embeddings``).
        elif ((parts[0] == "tok_embeddings" and (first or (last and (getattr(whole, "tied", False) or mtp))))
              or (parts[0] in ("norm", "output") and last)):
            if tp > 1 and len(shape) == 2:
                shape = (math.ceil(shape[0] / tp), shape[1])
            # An untied embedding is an FSDP group of its own (ray_titan.parallel.fsdp.apply_fsdp).
            untied_embedding = parts[0] == "tok_embeddings" and not getattr(whole, "tied", False)
            (out.embed if untied_embedding else out.root).add(shape, dp)
    for name, b in whole.named_buffers():
        parts = name.split(".")
        if parts[0] != "layers" or parts[1] in keep:
            out.buffers += b.numel() * b.element_size()
    return out


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
    if dims.fsdp_shard > 1:
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
        # Autocast's cache: a bf16 copy of every weight, cached until the forward ends, then held
        # by the tensors each block's backward saved (ray_titan.preflight.plan_ranks).
        gathered, grads_during = (2.0 * local if j.bf16 and not dims.fsdp else 0.0), float(grads_after)
    return param_b, opt_b, grads_after, gathered, grads_during
