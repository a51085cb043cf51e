"""Units of memory, in one place: the binary sizes every figure of the project is counted in
(``MiB`` = 2²⁰ bytes, ``GiB`` = 2³⁰; IEC 80000-13), and a size read from or written for a person.
Imports nothing of the project."""

from __future__ import annotations

import math
import re

__all__ = ["GiB", "KiB", "MiB", "format_bytes", "parse_bytes"]

KiB, MiB, GiB = 2**10, 2**20, 2**30


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
    for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}" if n / size < 100 else f"{n / size:.0f} {unit}"
    return f"{n:.0f} B"
