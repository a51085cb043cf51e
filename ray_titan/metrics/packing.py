"""A batch of step reports in columns: the wire format between the senders (a rank's
:class:`~ray_titan.metrics.worker.report.CollectorReporter`, a metrics aggregator) and the collector.

Every scalar of a report, coordinates and memory flattened, goes into one float64 matrix
(:data:`~ray_titan.metrics.fields.PACKED_FIELDS`, in order), the fields that are not one number
into a tuple per report (:data:`~ray_titan.metrics.fields.PACKED_OBJECTS`), and the MoE load into
two int blocks. One matrix pickles and crosses a Ray call for a fraction of what a dict per
report, or an Arrow record batch of 60 columns, costs the collector.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import numpy as np

from ray_titan.metrics.fields import FIELDS, OBJECT, PACKED_FIELDS, PACKED_OBJECTS

__all__ = ["MOE_PAD", "OBJECT_INDEX", "pack_reports"]

MOE_PAD = -1
"""The layer index of a padding row in a ``moe`` block: pipeline stages hold different numbers of
MoE layers (DeepSeek's first dense layers), and the blocks of their ranks are padded to the most
layers of the batch (padding layers count no tokens)."""

OBJECT_INDEX = {name: i for i, name in enumerate(PACKED_OBJECTS)}
"""A field's position in ``pack_reports``' ``objects`` tuples."""

# A report read as one flat dict: the fields' defaults, then the report, its coordinates and its
# memory sample over them; the packed fields are then one C-level ``itemgetter`` call.
_DEFAULTS = {f.name: f.default for f in FIELDS if f.name in PACKED_FIELDS or f.source == OBJECT}
_NUMBERS = itemgetter(*PACKED_FIELDS)
_OBJECTS = itemgetter(*PACKED_OBJECTS)
_EMPTY_NULL = tuple(f.name for f in FIELDS if f.empty == "null")
_EMPTY_LIST = tuple(f.name for f in FIELDS if f.empty == "list")


def _flat(rep: dict[str, Any], dropped: int) -> dict[str, Any]:
    """``rep`` with its coordinates and memory sample as keys of their own, a default for every
    field it lacks and ``dropped`` unless it names its own (a metrics aggregator sets it: the
    sending rank's count); an empty value reads as its field's ``empty`` says."""
    flat = {**_DEFAULTS, "dropped": dropped, **rep, **rep["coords"], **rep["memory"]}
    for name in _EMPTY_NULL:
        if not flat[name]:
            flat[name] = None
    for name in _EMPTY_LIST:
        if not flat[name]:
            flat[name] = []
    return flat


def _padded_moe(objects: list[tuple]) -> tuple[np.ndarray, np.ndarray]:
    """``moe_layers`` and ``expert_load`` of packed objects as int64 blocks ``(n, L)`` and ``(n, L,
    E)``, rows with fewer than the most layers ``L`` padded with layer :data:`MOE_PAD` and zero
    load. Raises ValueError where the layers of the reports count different numbers of experts."""
    li, ei = OBJECT_INDEX["moe_layers"], OBJECT_INDEX["expert_load"]
    n, most = len(objects), max((len(o[li]) for o in objects), default=0)
    if all(len(o[li]) == most for o in objects):
        layers = np.asarray([o[li] for o in objects], np.int64).reshape(n, most)
        load = np.asarray([o[ei] for o in objects], np.int64) if layers.size else np.zeros((n, 0, 0), np.int64)
        return layers, load
    experts = {len(x) for o in objects for x in o[ei]}
    if len(experts) > 1:
        raise ValueError(f"expert counts differ between MoE layers: {sorted(experts)}")
    e = experts.pop() if experts else 0
    layers = np.full((n, most), MOE_PAD, np.int64)
    load = np.zeros((n, most, e), np.int64)
    for i, o in enumerate(objects):
        k = len(o[li])
        if len(o[ei]) != k:
            raise ValueError(f"{k} MoE layers but {len(o[ei])} rows of expert load")
        if k:
            layers[i, :k], load[i, :k] = o[li], o[ei]
    return layers, load


def pack_reports(reports: list[dict[str, Any]], dropped: list[int] | int = 0) -> dict[str, Any]:
    """Reports (``StepReport.to_dict()``) as columns: ``{"values": float64 (n, len(PACKED_FIELDS)),
    "null": bool (n, len(PACKED_FIELDS)) (the report had None there), "objects": [one tuple of
    PACKED_OBJECTS per report], "axes": the mesh axes of the first report's ``coords``, in order,
    "moe": None or (int64 (n, layers), int64 (n, layers, experts)): ``moe_layers`` and
    ``expert_load`` of every report, padded where ranks hold different numbers of MoE layers
    (:data:`MOE_PAD`; then None in ``objects``), None where the layers count different numbers of
    experts}``. Counts and bytes are exact in float64 up to 2**53. ``dropped``: per report, or one
    count for all, the reports its rank had dropped (a report's own ``dropped`` key wins)."""
    n = len(reports)
    drops = [dropped] * n if isinstance(dropped, int) else dropped
    rows, objects = [], []
    for rep, d in zip(reports, drops):
        flat = _flat(rep, d)
        rows.append(_NUMBERS(flat))
        objects.append(_OBJECTS(flat))
    raw = np.array(rows, dtype=object).reshape(n, len(PACKED_FIELDS))
    null = raw == None  # noqa: E711 (elementwise)
    raw[null] = np.nan
    packed = {"values": raw.astype(np.float64), "null": null, "objects": objects,
              "axes": tuple(reports[0]["coords"]) if reports else (), "moe": None}
    # MoE: every rank's layers and expert load as two int blocks, (n, layers) and (n, layers,
    # experts), padded to one shape: built here, on the sender's CPU, instead of element by
    # element in the collector.
    try:
        layers, load = _padded_moe(objects)
    except (ValueError, TypeError):  # ragged: expert counts differ between layers
        return packed
    if n and layers.ndim == 2 and load.ndim == 3 and load.shape[1] == layers.shape[1]:
        packed["moe"] = (layers, load)
        packed["objects"] = [_without_moe(o) for o in objects]
    return packed


def _without_moe(o: tuple) -> tuple:
    """Packed objects with ``moe_layers`` and ``expert_load`` None (the ``moe`` blocks hold them)."""
    out = list(o)
    out[OBJECT_INDEX["moe_layers"]] = out[OBJECT_INDEX["expert_load"]] = None
    return tuple(out)
