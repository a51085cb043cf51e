"""A step's reports in columns: the packed parts (:func:`~ray_titan.metrics.packing.pack_reports`)
that brought them joined into one matrix, each rank's newest report once, in rank order
(:func:`newest_reports`), read by field name (:class:`Columns`); and the step's expert load
summed from them."""

from __future__ import annotations

from typing import Any

import numpy as np

from ray_titan.metrics.fields import FIELD, PACKED_FIELDS
from ray_titan.metrics.packing import MOE_PAD, OBJECT_INDEX

__all__ = ["INDEX", "Columns", "StepReports", "expert_load_of_blocks", "expert_load_of_objects", "newest_reports"]

INDEX = {name: i for i, name in enumerate(PACKED_FIELDS)}
"""A packed field's column in the ``values`` matrix."""
NODE, LAYERS, LOAD, SOURCES, BREAKDOWN = (OBJECT_INDEX[n] for n in (
    "node", "moe_layers", "expert_load", "source_tokens", "memory_breakdown"))
"""A field's position in each rank's packed objects."""


class Columns:
    """A step's packed reports (:func:`~ray_titan.metrics.packing.pack_reports`) by field name."""

    def __init__(self, values: np.ndarray, null: np.ndarray):
        self.values, self.nulls = values, null

    def get(self, name: str) -> np.ndarray:
        """float64 ``(ranks,)``; NaN where a report had None."""
        return self.values[:, INDEX[name]]

    def null(self, name: str) -> np.ndarray:
        return self.nulls[:, INDEX[name]]

    def int(self, name: str) -> np.ndarray:
        """int64 ``(ranks,)``; 0 where a report had None."""
        k = INDEX[name]
        return np.where(self.nulls[:, k], 0.0, self.values[:, k]).astype(np.int64)

    def rows(self, names: tuple[str, ...], at: np.ndarray) -> list[dict[str, Any]]:
        """A dict per rank of ``at`` (indices, int ``(k,)``) with the fields ``names``, each a
        Python number of its field's type (``float`` for ``float64``, else ``int``); None where a
        report had none."""
        cols = np.array([INDEX[k] for k in names])
        floats = [FIELD[k].type == "float64" for k in names]
        values = self.values[np.ix_(at, cols)].tolist()
        nulls = self.nulls[np.ix_(at, cols)].tolist()
        return [{k: None if null else v if f else int(v) for k, v, null, f in zip(names, vs, ns, floats)}
                for vs, ns in zip(values, nulls)]


class StepReports:
    """A step's reports joined (:func:`newest_reports`): ``columns``, each rank's ``objects``
    (tuples of :data:`~ray_titan.metrics.fields.PACKED_OBJECTS`), the MoE load blocks ``moe``
    (``(ranks, L)`` layers, :data:`~ray_titan.metrics.packing.MOE_PAD` for padding, and ``(ranks,
    L, E)`` load; None where ragged) and the mesh ``axes``."""

    def __init__(self, columns: Columns, objects: list[tuple], moe: tuple[np.ndarray, np.ndarray] | None,
                 axes: tuple[str, ...]):
        self.columns, self.objects, self.moe, self.axes = columns, objects, moe, axes


def _replaced(o: tuple, at: dict[int, Any]) -> tuple:
    out = list(o)
    for i, v in at.items():
        out[i] = v
    return tuple(out)


def _with_moe_lists(objects: list[tuple], moe: tuple[np.ndarray, np.ndarray]) -> list[tuple]:
    """A part's objects with ``moe_layers`` and ``expert_load`` taken back from its blocks."""
    keep = moe[0] != MOE_PAD
    return [_replaced(o, {LAYERS: lay[k].tolist(), LOAD: load[k].tolist()})
            for o, lay, load, k in zip(objects, moe[0], moe[1], keep)]


def _moe_blocks(parts: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray] | None:
    """The parts' ``moe`` blocks stacked, padded to the most layers (:data:`MOE_PAD`: pipeline
    stages hold different numbers of MoE layers); None where a part has none, or where layers
    count different numbers of experts."""
    blocks = [p.get("moe") for p in parts]
    if any(b is None for b in blocks):
        return None
    most = max(b[0].shape[1] for b in blocks)  # type: ignore[index]
    experts = {b[1].shape[2] for b in blocks if (b[0] != MOE_PAD).any()}  # type: ignore[index]
    if len(experts) > 1:
        return None
    e = experts.pop() if experts else 0
    layers, loads = [], []
    for lay, load in blocks:  # type: ignore[misc]
        n, k = lay.shape
        if k != most or load.shape[2] != e:
            padded = np.zeros((n, most, e), np.int64)
            padded[:, :k] = load if load.shape[2] == e else 0
            lay, load = np.pad(lay, ((0, 0), (0, most - k)), constant_values=MOE_PAD), padded
        layers.append(lay)
        loads.append(load)
    return np.concatenate(layers), np.concatenate(loads)


def newest_reports(parts: list[dict[str, Any]]) -> StepReports:
    """A step's packed reports (one part per call that brought some) joined, keeping each rank's
    newest report (a resent duplicate collapses), in rank order."""
    values = np.concatenate([p["values"] for p in parts])
    null = np.concatenate([p["null"] for p in parts])
    moe = _moe_blocks(parts)
    # Where layers count different numbers of experts the step goes element by element: the
    # parts' blocks back into the objects.
    objects = [o for p in parts for o in (p["objects"] if moe is not None or p.get("moe") is None
                                          else _with_moe_lists(p["objects"], p["moe"]))]
    ranks_all = values[:, INDEX["rank"]].astype(np.int64)
    if len(ranks_all) > 1 and not (ranks_all[1:] > ranks_all[:-1]).all():  # not already one per rank in order
        rev = len(ranks_all) - 1 - np.unique(ranks_all[::-1], return_index=True)[1]
        values, null = values[rev], null[rev]
        objects = [objects[i] for i in rev.tolist()]
        if moe is not None:
            moe = (moe[0][rev], moe[1][rev])
    if moe is None:  # ragged MoE shapes: element by element
        objects = [_replaced(o, {LAYERS: o[LAYERS] or [], LOAD: o[LOAD] or []}) for o in objects]
    return StepReports(Columns(values, null), objects, moe, parts[0]["axes"])


def expert_load_of_objects(objects: list[tuple]) -> dict[int, list[int]]:
    """A step's expert load per MoE layer (tokens × top-k routed to each expert, summed over the
    ranks holding the layer) from the packed objects of its counted rows, summed in numpy by the
    layers each rank holds (a pipeline stage's ranks hold the same layers)."""
    groups: dict[tuple[int, ...], list] = {}
    for o in objects:
        if o[LAYERS]:
            groups.setdefault(tuple(o[LAYERS]), []).append(o[LOAD])
    out: dict[int, np.ndarray] = {}
    for layers, loads in groups.items():
        total: np.ndarray | list[np.ndarray]
        try:
            total = np.asarray(loads, dtype=np.int64).sum(axis=0)  # (layers, experts)
        except ValueError:  # ragged: expert counts differ between layers
            total = [np.sum([x[i] for x in loads], axis=0) for i in range(len(layers))]
        for layer, counts in zip(layers, total):
            out[layer] = out[layer] + counts if layer in out else np.asarray(counts)
    return {layer: [int(x) for x in out[layer]] for layer in sorted(out)}


def expert_load_of_blocks(layers: np.ndarray, load: np.ndarray) -> dict[int, list[int]]:
    """:func:`expert_load_of_objects` from the counted rows' blocks: ``layers`` (ranks, L), ``load``
    (ranks, L, E)."""
    if not layers.size:
        return {}
    out: dict[int, np.ndarray] = {}
    held, inverse = np.unique(layers, axis=0, return_inverse=True)  # one row per pipeline stage
    for g, row in enumerate(held):
        total = load[inverse.reshape(-1) == g].sum(axis=0)
        for layer, counts in zip(row.tolist(), total):
            if layer != MOE_PAD:
                out[layer] = out[layer] + counts if layer in out else counts
    return {layer: out[layer].tolist() for layer in sorted(out)}
