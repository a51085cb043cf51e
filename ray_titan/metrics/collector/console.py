"""The collector's console: the lines it holds until the driver drains them (:class:`Console`),
and how each is written. Formatters only format: what a line says is decided by its caller.

- a step's line (:func:`format_step_line`; beyond :data:`CONSOLE_RANKS` ranks
  :func:`format_scale_line`, which summarises the ranks);
- the ranks' verdict changes (:func:`verdict_messages`) and the reason the leak policy gives for
  stopping the run (:func:`leak_stop_reason`);
- where a worker group runs (:func:`layout_line`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ray_titan.config.units import MiB
from ray_titan.metrics.collector.columns import Columns
from ray_titan.metrics.collector.leak import GROWING, LeakMonitor, Verdict
from ray_titan.metrics.fields import VERDICT_CODES, VERDICTS

__all__ = ["CONSOLE_RANKS", "Console", "format_scale_line", "format_step_line", "layout_line", "leak_stop_reason",
           "span", "verdict_messages"]

CONSOLE_RANKS = 16
"""Up to this many ranks the console line names every rank's memory; beyond, it summarises."""


class Console:
    """The console lines not yet drained, each with the step it belongs to (None: none).
    ``restarted``: this is a collector restarted by Ray, whose previous life showed the lines of
    the steps it re-assembles. ``layouts_shown``: the attempts whose layout line was shown."""

    def __init__(self, restarted: bool):
        self.restarted = restarted
        self.layouts_shown: set[float] = set()
        self._lines: list[tuple[int | None, str]] = []

    def add(self, step: int | None, text: str) -> None:
        self._lines.append((step, text))

    def drain(self, shown_step: int = 0) -> list[str]:
        """The lines added since the last call. ``shown_step``: the newest step the caller has
        shown; after a restart the lines of steps up to it were shown by the previous life, so
        they are dropped."""
        lines, self._lines = self._lines, []
        hide = shown_step if self.restarted else 0
        return [text for step, text in lines if step is None or step > hide]


def _step_figures(step: int, total: int, s: dict[str, Any], memory: str) -> str:
    """The head of a step's console line: loss, throughput, step time, LR, gradient norm, then
    ``memory`` (the ranks' host memory), the MoE imbalance, validation and a skipped update."""
    loss = "loss     n/a" if s["loss"] is None else f"loss {s['loss']:8.4f}"
    line = (
        f"step {step:>{len(str(total))}}/{total} | {loss} | {s['tokens_per_s']:9.0f} tok/s | "
        f"step {s['step_time_s']:.3f}s | lr {s['lr']:.2e} | gnorm {s['grad_norm']:.3f} | {memory}"
    )
    if s.get("moe_imbalance") is not None:
        line += f" | moe load max/mean {s['moe_imbalance']:.2f}"
    if s.get("val/loss") is not None:
        line += f" | val loss {s['val/loss']:.4f} (ppl {s['val/perplexity']:.2f})"
    if s.get("skipped"):
        line += " | update skipped (non-finite)"
    return line


def format_step_line(step: int, total: int, s: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The console line of a step: loss of the last stage, throughput, times, and every rank's
    memory (host RSS, and device allocated / peak reserved where there is a device)."""
    mem = " ".join(f"r{r['rank']}:{r['host_rss_bytes'] / MiB:.0f}" for r in rows)
    line = _step_figures(step, total, s, f"rss MiB {mem}")
    if rows[0].get("device_allocated_bytes") is not None:
        dev = " ".join(
            f"r{r['rank']}:{r['device_allocated_bytes'] / MiB:.0f}/{r['device_peak_reserved_bytes'] / MiB:.0f}"
            for r in rows
        )
        line += f" | dev alloc/peak MiB {dev}"
    return line


def _extremes(c: Columns, key: str) -> str | None:
    """``"min 2900 (r5) / med 3000 / max 3400 (r1)"`` of a memory field in MiB over the ranks,
    None where no rank has it."""
    v, ranks = c.get(key), c.get("rank")
    ok = ~np.isnan(v)
    if not ok.any():
        return None
    v, ranks = v[ok] / MiB, ranks[ok]
    lo, hi = int(np.argmin(v)), int(np.argmax(v))
    return f"min {v[lo]:.0f} (r{ranks[lo]:.0f}) / med {np.median(v):.0f} / max {v[hi]:.0f} (r{ranks[hi]:.0f})"


def format_scale_line(step: int, total: int, s: dict[str, Any], c: Columns, code: np.ndarray) -> str:
    """The console line of a step of more than :data:`CONSOLE_RANKS` ranks: the step's figures as
    :func:`format_step_line`'s, then min / median / max of host RSS and of device allocated and
    peak reserved memory (MiB) with the ranks at the extremes, the verdict counts with every
    ``growing`` rank named, and per pipeline stage the largest RSS and device peak."""
    line = _step_figures(step, total, s, f"{len(code)} ranks | rss MiB {_extremes(c, 'host_rss_bytes')}")
    for key, what in (("device_allocated_bytes", "dev alloc"), ("device_peak_reserved_bytes", "dev peak")):
        text = _extremes(c, key)
        if text:
            line += f" | {what} MiB {text}"
    counts = dict(zip(VERDICTS, np.bincount(code.astype(np.int64), minlength=len(VERDICTS)).tolist()))
    growing = c.get("rank")[code == VERDICT_CODES[GROWING]].astype(np.int64).tolist()
    line += f" | memory {counts['stable']} stable, {counts['warming_up']} warming_up, {counts['growing']} growing"
    if growing:
        line += f" ({', '.join(f'r{r}' for r in growing)})"
    pp = c.int("pp")
    stages = []
    dev = not c.null("device_peak_reserved_bytes").all()
    for stage in np.unique(pp).tolist():
        at = pp == stage
        key = "device_peak_reserved_bytes" if dev else "host_rss_bytes"
        v = c.get(key)[at]
        i = int(np.nanargmax(v))
        stages.append(f"pp{stage} {v[i] / MiB:.0f} (r{c.get('rank')[at][i]:.0f})")
    line += f" | max {'dev peak' if dev else 'rss'} MiB by stage: " + ", ".join(stages)
    return line


def verdict_messages(step: int, changes: list[tuple[int, Verdict]], leak: LeakMonitor,
                     stopping: int | None = None) -> list[str]:
    """The console messages of the ranks whose verdict changed (``changes``): one per rank up to
    :data:`CONSOLE_RANKS` changes, beyond that a count per verdict, and every ``growing`` rank by
    name always. ``stopping``: the rank whose verdict ends the run (its message says so)."""
    messages = []
    named = changes if len(changes) <= CONSOLE_RANKS else [(r, v) for r, v in changes if v.verdict == GROWING]
    for rank, v in named:
        message = f"memory: {leak.describe(rank)} {leak.format(v)} at step {step}"
        if rank == stopping:
            message += "; memory.on_leak = 'stop' ends the run"
        messages.append(message)
    if len(changes) > CONSOLE_RANKS:
        counts: dict[str, int] = {}
        for _, v in changes:
            counts[v.verdict] = counts.get(v.verdict, 0) + 1
        messages += [f"memory: {k} rank(s) now {verdict} at step {step}" for verdict, k in counts.items()
                     if verdict != GROWING]
    return messages


def leak_stop_reason(step: int, rank: int, verdict: Verdict, leak: LeakMonitor) -> str:
    """Why the leak policy ended the run, as the workers and the driver are told it."""
    return (f"{leak.describe(rank)}: memory {leak.format(verdict)} since step {step}; "
            "memory.on_leak = 'stop' ended the run")


def span(values: list[int]) -> str:
    """``[0, 1, 2]`` → ``"0-2"``; ``[3]`` → ``"3"``; ``[0, 2]`` → ``"0,2"``."""
    if len(values) > 1 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def layout_line(ranks: np.ndarray, nodes: list[str | None], coords: list[dict[str, int]]) -> str:
    """``"ray_titan: layout of 4 ranks: node 1a2b3c4d: ranks 0-1 (pp=0 × dp_shard=0-1); ..."``
    (the first 16 nodes; how many more there are)."""
    by_node: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        by_node.setdefault(node or "?", []).append(i)
    parts = []
    for node, idx in list(by_node.items())[:16]:
        axes = " × ".join(f"{a}={span(sorted({coords[i][a] for i in idx}))}" for a in coords[idx[0]])
        parts.append(f"node {node[:8]}: ranks {span([int(ranks[i]) for i in idx])} ({axes})")
    more = f"; ... and {len(by_node) - 16} more nodes" if len(by_node) > 16 else ""
    return f"ray_titan: layout of {len(ranks)} ranks on {len(by_node)} node(s): " + "; ".join(parts) + more
