"""The first-contact GPU run's record: ``<out>/facts.jsonl``, one JSON object a line
(``stage``, ``name``, ``value``, ``unit``, ``time``: UTC ISO 8601, and ``note`` where there is
one), each line written, flushed and fsynced the moment the fact is known, so a run killed at
any point keeps every fact before it; and one human-readable line per fact on stdout.

Several processes append to the same file (the runner and the stage it waits for, one at a
time); each fact is one ``write`` of one line to a file opened with ``O_APPEND``.
"""

from __future__ import annotations

import json
import math
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["FACTS", "FactLog", "read_facts", "stderr_tail"]

FACTS = "facts.jsonl"


def _jsonable(value: Any) -> Any:
    """``value`` with non-finite floats as strings (JSON has no NaN) and unknown objects as ``str``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class FactLog:
    """Appends facts of ``stage`` to ``<out>/facts.jsonl`` (the folder is made) and prints them."""

    def __init__(self, out: Path | str, stage: str):
        self.path = Path(out) / FACTS
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.stage = stage

    def add(self, name: str, value: Any, unit: str = "", note: str = "") -> dict[str, Any]:
        """Record one fact: ``value`` in ``unit`` (``""``: none; a string value such as
        ``"n/a on cpu"`` says why there is no number). Returns the record written."""
        rec: dict[str, Any] = {"stage": self.stage, "name": name, "value": _jsonable(value), "unit": unit,
                               "time": datetime.now(UTC).isoformat(timespec="milliseconds")}
        if note:
            rec["note"] = note
        line = (json.dumps(rec, ensure_ascii=False) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        shown = f"{value:.4g}" if isinstance(value, float) else str(rec["value"])
        print(f"[{self.stage}] {name}: {shown}{' ' + unit if unit else ''}{'  (' + note + ')' if note else ''}",
              flush=True)
        return rec


def read_facts(out: Path | str) -> list[dict[str, Any]]:
    """Every complete fact in ``<out>/facts.jsonl`` (a torn last line, from a kill mid-write, is
    left out); [] where there is no file."""
    path = Path(out) / FACTS
    if not path.is_file():
        return []
    facts = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            facts.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return facts


def stderr_tail(text: str, lines: int = 15, chars: int = 2000) -> str:
    """The last ``lines`` lines of ``text`` (at most ``chars`` characters): where a failure says why."""
    return "\n".join(text.strip().splitlines()[-lines:])[-chars:]

