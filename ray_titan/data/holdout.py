"""A held-out share of a source, chosen by a hash of each document's content.

A document is held out when the first 8 bytes of the BLAKE2b digest of its content, read as a
number in ``[0, 1)``, fall below the fraction. So the choice depends on the document alone: the
same on every rank, in every run and whatever the seed or the file order, and a document that
appears twice is on one side only. The training stream and the validation stream are disjoint.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa

__all__ = ["document_key", "holdout_mask", "split_holdout"]


def document_key(row) -> bytes:
    """The bytes a document's hash is taken of: a text's UTF-8, or a record's (a supervised
    example's columns) canonical JSON."""
    if isinstance(row, str):
        return row.encode("utf-8")
    return json.dumps(row, sort_keys=True, ensure_ascii=False).encode("utf-8")


def holdout_mask(docs: pa.ChunkedArray | pa.Array | pa.Table, fraction: float) -> np.ndarray:
    """Boolean ``(len(docs),)``: True for the documents held out. ``docs`` is a string array
    (texts) or a table (one example a row). Raises ``ValueError`` unless ``0 < fraction < 1``."""
    if not 0 < fraction < 1:
        raise ValueError(f"holdout fraction {fraction} is not between 0 and 1")
    rows = docs.to_pylist()
    threshold = int(fraction * 2**64)
    return np.fromiter(
        (int.from_bytes(hashlib.blake2b(document_key(r), digest_size=8).digest(), "little") < threshold for r in rows),
        dtype=bool, count=len(rows),
    )


def split_holdout(docs, fraction: float):
    """``(training, held_out)``: ``docs`` (a string array or a table) without and with the
    documents :func:`holdout_mask` holds out, each in the original order."""
    held = holdout_mask(docs, fraction)
    return docs.filter(pa.array(~held)), docs.filter(pa.array(held))
