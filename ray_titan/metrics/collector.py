"""The metrics collector: one place that sees every rank at every step.

Used as a Ray actor (``ray.remote(MetricsCollector).options(num_cpus=0)``, owned by the driver)
or as a plain object in-process. Workers call :meth:`MetricsCollector.report` with batches of
step reports; when every rank has reported a step, the collector assembles it:

- loss: the token-weighted mean of the losses of the ranks that hold the last pipeline stage
  (given by the stage-to-rank mapping, ``last_stage_ranks``), and their max. A last-stage rank
  without a loss, or a non-last-stage rank with one, is recorded as an error, not filled in.
- tokens/s: tokens of the step (summed over the last stage's DP ranks) over the slowest rank's
  step time.
- one row per rank (timings, memory, GC pause) to Parquet, scalars to TensorBoard, and a console
  line at the first step, every ``log_freq`` steps and at the last step, which the driver drains
  and prints.
- a memory verdict per rank (``ray_titan.metrics.leak``: warming_up / stable / growing, MiB per
  step, projected OOM step) in every row and in TensorBoard, and a console line whenever a rank's
  verdict changes. With ``on_leak = "stop"`` a ``growing`` verdict sets :attr:`stop_reason`,
  which every later :meth:`MetricsCollector.report` call returns to the workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray_titan import storage
from ray_titan.metrics.leak import GROWING, LeakMonitor, leak_settings
from ray_titan.metrics.memory import MEMORY_FIELDS
from ray_titan.metrics.sinks import ParquetSink, TensorBoardSink

__all__ = ["MetricsCollector", "format_step_line", "expert_load"]

MiB = 2**20


def expert_load(rows: list[dict[str, Any]]) -> dict[int, list[int]]:
    """A step's expert load per MoE layer: tokens (× top-k) routed to each expert, summed over
    the ranks holding the layer (every data-parallel rank routes its own tokens). ``rows`` are the
    step's rows (dicts with ``moe_layers`` and ``expert_load``); empty for a dense model."""
    out: dict[int, list[int]] = {}
    for r in rows:
        for layer, counts in zip(r.get("moe_layers") or [], r.get("expert_load") or []):
            acc = out.setdefault(layer, [0] * len(counts))
            for e, c in enumerate(counts):
                acc[e] += c
    return dict(sorted(out.items()))


def format_step_line(step: int, total: int, s: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The console line of a step: loss of the last stage, throughput, times, and every rank's
    memory (host RSS, and device allocated / peak reserved where there is a device)."""
    loss = "loss     n/a" if s["loss"] is None else f"loss {s['loss']:8.4f}"
    mem = " ".join(f"r{r['rank']}:{r['host_rss_bytes'] / MiB:.0f}" for r in rows)
    line = (
        f"step {step:>{len(str(total))}}/{total} | {loss} | {s['tokens_per_s']:9.0f} tok/s | "
        f"step {s['step_time_s']:.3f}s | lr {s['lr']:.2e} | gnorm {s['grad_norm']:.3f} | "
        f"rss MiB {mem}"
    )
    if s.get("moe_imbalance") is not None:
        line += f" | moe load max/mean {s['moe_imbalance']:.2f}"
    if rows[0].get("device_allocated_bytes") is not None:
        dev = " ".join(
            f"r{r['rank']}:{r['device_allocated_bytes'] / MiB:.0f}/{r['device_peak_reserved_bytes'] / MiB:.0f}"
            for r in rows
        )
        line += f" | dev alloc/peak MiB {dev}"
    return line


def _max_memory(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rank with the most memory: device peak reserved where there is a device, else host RSS."""
    if rows[0].get("device_peak_reserved_bytes") is not None:
        key, kind = "device_peak_reserved_bytes", "dev peak"
    else:
        key, kind = "host_rss_bytes", "rss"
    best = max((r for r in rows if r.get(key) is not None), key=lambda r: r[key], default=None)
    return None if best is None else {"rank": best["rank"], "bytes": best[key], "kind": kind}


class MetricsCollector:
    """Assembles steps from all ranks' reports and writes them to the sinks.

    Args:
        run_dir: the run directory; metrics go to ``metrics/`` and ``tb/`` inside it. A remote URI
            (``s3://...``, see :mod:`ray_titan.storage`) is written through a local staging
            directory that is uploaded at every flush and at the end.
        world_size: number of ranks that report every step.
        last_stage_ranks: global ranks holding the last pipeline stage.
        total_steps: steps of the run (for the console line).
        log_freq: console line every this many steps.
        flush_every_steps: Parquet part and TensorBoard flush every this many assembled steps.
        enable_tensorboard: write TensorBoard event files.
        leak: settings of the memory verdict, keyword arguments of
            :class:`~ray_titan.metrics.leak.LeakMonitor` (default: its defaults in ``[memory]``).
        on_leak: ``"warn"`` or ``"stop"`` (see the module docstring).
    """

    MAX_ERRORS = 1000

    def __init__(
        self,
        run_dir: str,
        world_size: int,
        last_stage_ranks: list[int],
        total_steps: int,
        log_freq: int = 10,
        flush_every_steps: int = 20,
        enable_tensorboard: bool = True,
        leak: dict[str, Any] | None = None,
        on_leak: str = "warn",
    ):
        self.mirror = None
        if storage.is_remote(run_dir):
            self.mirror = storage.Mirror(storage.staging_dir(run_dir), run_dir)
            run_dir = str(self.mirror.local_dir)
        self.run_dir = Path(run_dir)
        self.world_size, self.last = world_size, sorted(last_stage_ranks)
        self.total_steps, self.log_freq, self.flush_every = total_steps, log_freq, flush_every_steps
        self.parquet = ParquetSink(self.run_dir / "metrics")
        self.tb = TensorBoardSink(self.run_dir / "tb") if enable_tensorboard else None
        self._pending: dict[int, dict[int, dict[str, Any]]] = {}
        self._lines: list[str] = []
        self.errors: list[str] = []
        self.errors_total = 0
        self.assembled = 0
        self.last_step = 0
        self.final_loss: float | None = None
        self.latest: dict[str, Any] | None = None
        self.dropped: dict[int, int] = {}
        self._since_flush = 0
        self._closed = False
        self.leak = LeakMonitor(**(leak or leak_settings()))
        self.on_leak = on_leak
        self.stop_reason: str | None = None

    # -- worker-facing -------------------------------------------------------------------------
    def report(self, batch: list[dict[str, Any]], dropped: int = 0) -> dict[str, str] | None:
        """Accept a batch of step reports (``StepReport.to_dict()``) from one rank. Returns
        ``{"stop": reason}`` once the run must stop (``on_leak = "stop"``), else None."""
        for rep in batch:
            self._pending.setdefault(rep["step"], {})[rep["rank"]] = rep
            if dropped:
                self.dropped[rep["rank"]] = dropped
        for step in sorted(s for s, reps in self._pending.items() if len(reps) == self.world_size):
            self._assemble(step, self._pending.pop(step))
        return {"stop": self.stop_reason} if self.stop_reason else None

    # -- driver-facing -------------------------------------------------------------------------
    def drain_lines(self) -> list[str]:
        """Console lines produced since the last call."""
        lines, self._lines = self._lines, []
        return lines

    def poll(self) -> dict[str, Any]:
        """``{"lines": drain_lines(), "latest": the newest assembled step's progress}`` (see
        :mod:`ray_titan.progress`), one call per driver refresh."""
        return {"lines": self.drain_lines(), "latest": self.latest}

    def finish(self) -> dict[str, Any]:
        """Record incomplete steps as errors, flush and close the sinks, and summarise.

        Returns ``{"steps": n, "last_step", "final_loss", "errors": [...], "lines": [...],
        "steps_path"}``. Idempotent.
        """
        if not self._closed:
            for step in sorted(self._pending):
                missing = sorted(set(range(self.world_size)) - set(self._pending[step]))
                self._error(f"step {step}: no report from rank(s) {missing}")
            self._pending.clear()
            for rank, n in sorted(self.dropped.items()):
                self._error(f"rank {rank} dropped {n} report(s): the collector was too slow")
            steps_path = self.parquet.close()
            if self.tb:
                self.tb.close()
            self._sync("at the end")
            self._closed = True
            self._steps_path = str(steps_path)
        return {
            "steps": self.assembled,
            "last_step": self.last_step,
            "final_loss": self.final_loss,
            "errors": list(self.errors),
            "lines": self.drain_lines(),
            "latest": self.latest,
            "steps_path": self._steps_path,
            "memory_verdicts": self.leak.summary(),
            "stop": self.stop_reason,
        }

    # -- internals -----------------------------------------------------------------------------
    def _assemble(self, step: int, reps: dict[int, dict[str, Any]]) -> None:
        rows = [reps[r] for r in sorted(reps)]
        last = [reps[r] for r in self.last if r in reps]
        for r in rows:
            if r["rank"] in self.last and r["loss"] is None:
                self._error(f"step {step}: last-stage rank {r['rank']} reported no loss")
            if r["rank"] not in self.last and r["loss"] is not None:
                self._error(f"step {step}: rank {r['rank']} is not on the last stage but reported a loss")
        with_loss = [r for r in last if r["loss"] is not None]
        tokens = sum(r["tokens"] for r in with_loss)
        loss = sum(r["loss"] * r["tokens"] for r in with_loss) / tokens if tokens else None
        step_time = max(r["step_time_s"] for r in rows)
        summary = {
            "loss": loss,
            "loss_max": max((r["loss"] for r in with_loss), default=None),
            "tokens": sum(r["tokens"] for r in last),
            "step_time_s": step_time,
            "lr": rows[0]["lr"],
            "grad_norm": rows[0]["grad_norm"],
        }
        summary["tokens_per_s"] = summary["tokens"] / step_time if step_time > 0 else 0.0
        load = expert_load(rows)
        aux = [r["aux_loss"] for r in rows if r.get("aux_loss") is not None]
        # Each DP replica's layers sum to its balance loss; average the replicas.
        summary["moe/aux_loss"] = sum(aux) / max(1, len(self.last)) if aux else None
        summary["moe_imbalance"] = max(
            (max(c) * len(c) / sum(c) for c in load.values() if sum(c)), default=None
        )
        flat = [self._row(r, summary) for r in rows]
        changes = [self._verdict(step, r, row) for r, row in zip(rows, flat)]
        self.parquet.add(flat)
        if self.tb:
            self.tb.add_step(step, {k: summary[k] for k in ("loss", "loss_max", "tokens_per_s", "lr", "grad_norm", "step_time_s", "moe/aux_loss")}, flat)
            if load:
                self.tb.add_expert_load(step, load)
            for message in filter(None, changes):
                self.tb.add_text("memory/verdict", message, step)
        if step % self.log_freq == 0 or step == self.total_steps or step == 1:
            self._lines.append(format_step_line(step, self.total_steps, summary, flat))
        self._lines += filter(None, changes)
        self.assembled += 1
        if step >= self.last_step:  # the newest step's loss, None (and an error) if it had none
            self.last_step, self.final_loss = step, loss
            self.latest = {"step": step, "total": self.total_steps, "loss": loss,
                           "tokens_per_s": summary["tokens_per_s"], "max_memory": _max_memory(flat)}
        self._since_flush += 1
        if self._since_flush >= self.flush_every:
            self.flush()

    def _verdict(self, step: int, rep: dict[str, Any], row: dict[str, Any]) -> str | None:
        """Put the rank's memory verdict into its row; the console message if it changed."""
        v, message = self.leak.update(step, {**rep["memory"], "rank": rep["rank"], "coords": rep["coords"]})
        row.update(memory_verdict=v.verdict, memory_slope_mib_per_step=v.slope_mib_per_step,
                   memory_oom_step=v.oom_step)
        if v.verdict == GROWING and self.on_leak == "stop" and self.stop_reason is None:
            self.stop_reason = (
                f"{self.leak.describe(rep['rank'])}: memory {self.leak.format(v)} since step {step}; "
                "memory.on_leak = 'stop' ended the run"
            )
            message = (f"memory: {self.leak.describe(rep['rank'])} {self.leak.format(v)} at step {step}; "
                       "memory.on_leak = 'stop' ends the run")
        return message

    def _error(self, message: str) -> None:
        # Bounded: a systematic error would otherwise add one message per step.
        self.errors_total += 1
        if len(self.errors) < self.MAX_ERRORS:
            self.errors.append(message)
        elif len(self.errors) == self.MAX_ERRORS:
            self.errors.append("... further errors are counted in errors_total only")

    def flush(self) -> None:
        """Write a Parquet part of the assembled rows and flush TensorBoard."""
        self.parquet.flush()
        if self.tb:
            self.tb.flush()
        self._since_flush = 0
        self._sync("after a flush")

    def _sync(self, when: str) -> None:
        if self.mirror is None:
            return
        try:
            self.mirror.sync()
        except Exception as e:  # the staged copy is complete; the next sync retries
            self._error(f"upload of metrics to {self.mirror.destination} failed {when}: {e}")

    @staticmethod
    def _row(r: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
        row = {k: r[k] for k in ("step", "rank", "is_last_stage", "loss", "tokens", "step_time_s",
                                  "data_time_s", "fwd_bwd_time_s", "optim_time_s", "grad_norm",
                                  "lr", "gc_pause_s", "time")}
        row.update({axis: r["coords"].get(axis, 0) for axis in ("pp", "dp_shard", "ep")})
        row.update(aux_loss=r.get("aux_loss"), moe_layers=r.get("moe_layers") or [],
                   expert_load=r.get("expert_load") or [])
        row["gc_generation"] = r.get("gc_generation")
        row.update({k: r["memory"].get(k) for k in MEMORY_FIELDS})
        row.update(step_loss=s["loss"], step_loss_max=s["loss_max"], step_tokens=s["tokens"],
                   step_tokens_per_s=s["tokens_per_s"])
        return row
