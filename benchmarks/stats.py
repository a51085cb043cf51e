"""Statistics and the printed table of the benchmark runner (pure functions, no torch, no Ray).

A comparison runs side A and side B alternately (A B, then B A, ...) for several repetitions;
each repetition gives one paired ratio ``a / b`` of the same figure (tokens/s, seconds, bytes),
and the comparison is reported as the median of those ratios with their min and max. Pairing
neighbours in time cancels most of a shared machine's slow drift; the spread says how much noise
is left.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["RatioStats", "Row", "alternate", "fmt_si", "format_table", "ratio_stats", "slope"]


@dataclass(frozen=True)
class RatioStats:
    """Paired ratios ``a_i / b_i``: their median, min and max, and the medians of each side."""

    median: float
    min: float
    max: float
    n: int
    median_a: float
    median_b: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def ratio_stats(a: Sequence[float], b: Sequence[float]) -> RatioStats:
    """Statistics of the paired ratios of ``a`` and ``b`` (same length, one pair per repetition).

    Raises ``ValueError`` for empty or unequal sequences or a ``b`` value of 0.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"need equal, non-empty sequences of pairs; got {len(a)} and {len(b)} values")
    if any(y == 0 for y in b):
        raise ValueError(f"side B has a zero value, the ratio is undefined: {list(b)}")
    ratios = [x / y for x, y in zip(a, b)]
    return RatioStats(
        median=statistics.median(ratios), min=min(ratios), max=max(ratios), n=len(ratios),
        median_a=statistics.median(a), median_b=statistics.median(b),
    )


def alternate(run_a: Callable[[], Any], run_b: Callable[[], Any], repeats: int) -> tuple[list, list]:
    """Run both sides ``repeats`` times in the order A B, B A, A B, ...; returns their results
    in repetition order ``([a_1, ...], [b_1, ...])``."""
    out_a, out_b = [], []
    for i in range(repeats):
        if i % 2 == 0:
            out_a.append(run_a())
            out_b.append(run_b())
        else:
            out_b.append(run_b())
            out_a.append(run_a())
    return out_a, out_b


def slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of ``y`` over ``x`` (units of y per unit of x, e.g. bytes per step).
    Raises ``ValueError`` for fewer than two points or a constant ``x``."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"need two or more (x, y) pairs; got {len(x)} x and {len(y)} y values")
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((v - mx) ** 2 for v in x)
    if sxx == 0:
        raise ValueError("x is constant: the slope is undefined")
    return sum((u - mx) * (v - my) for u, v in zip(x, y)) / sxx


def fmt_si(x: float | None, unit: str = "", digits: int = 3) -> str:
    """``1.23 k``-style number with an SI prefix (``n/a`` for ``None``)."""
    if x is None:
        return "n/a"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.{digits}g} {prefix}{unit}"
    return f"{x:.{digits}g} {unit}".rstrip()


@dataclass
class Row:
    """One line of the table: a comparison (A vs B, ratio) or a single figure (``stats`` None)."""

    name: str
    a_label: str
    a_value: str
    b_label: str = ""
    b_value: str = ""
    stats: RatioStats | None = None
    target: str = ""
    note: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def ratio_text(self) -> str:
        if self.stats is None:
            return ""
        s = self.stats
        return f"{s.median:.3f} [{s.min:.3f}, {s.max:.3f}] n={s.n}"


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table (also readable as plain text)."""
    head = ["benchmark", "A", "A value", "B", "B value", "A/B median [min, max]", "target", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.name, r.a_label, r.a_value, r.b_label, r.b_value, r.ratio_text(), r.target, r.note]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)
