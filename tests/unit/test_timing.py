"""Run timings and the metrics switch of the train loop (one process, no Ray)."""

from __future__ import annotations

from ray_titan.config import load_config, merge_overrides
from ray_titan.metrics.worker.report import Reporter
from ray_titan.metrics.worker.timing import read_timings, write_timings
from ray_titan.trainer import train_loop


class _Recording(Reporter):
    def __init__(self):
        self.reports, self.closed = [], False

    def report(self, rep):
        self.reports.append(rep)

    def close(self):
        self.closed = True


def _cfg(corpus_cache, *overrides):
    return load_config(None, merge_overrides([
        "--parallelism.pp=1", "--parallelism.dp_shard=1", "--training.steps=4",
        "--training.threads_per_worker=1", f"--data.cache_dir={corpus_cache}", "--memory.breakdown_step=0"],
        overrides))


def test_metrics_switch_and_timings(corpus_cache, tmp_path):
    on, off = _Recording(), _Recording()
    s_on = train_loop(_cfg(corpus_cache), on)
    s_off = train_loop(_cfg(corpus_cache, "--metrics.enabled=false"), off)
    assert [r.step for r in on.reports] == [1, 2, 3, 4] and on.closed
    assert on.reports[0].memory["host_rss_bytes"] > 0
    assert off.reports == [] and off.closed  # nothing sampled or sent, reporter still closed
    for s in (s_on, s_off):
        m = s["marks"]
        assert m["loop_start"] <= m["data_ready"] <= m["model_built"] <= m["step1_end"] <= m["last_step_end"]
        assert s["steady_steps"] == 2 and s["steady_time_s"] > 0  # steps 3-4, after 2 warm-up steps
        assert s["tokens_per_step"] == 16 * 128 and s["host_peak_rss_bytes"] >= s["host_rss_bytes"] > 0
    # Training itself does not depend on the switch.
    assert s_on["last_loss"] == s_off["last_loss"]
    write_timings(tmp_path, "rank0", s_on)
    assert read_timings(tmp_path)["rank0"]["steady_steps"] == 2


def test_bf16_without_fsdp_trains_close_to_fp32(corpus_cache):
    """One rank (no FSDP2 to cast the weights): ``training.mixed_precision = "bf16"`` computes
    under ``torch.autocast`` (``ray_titan.parallel.fsdp.autocast_dtype``)."""
    runs = {}
    for dtype in ("fp32", "bf16"):
        rec = _Recording()
        # 8 sequences a step: bf16 on CPU is slow, and 8 steps of them still learn by > 1.5 nats.
        train_loop(_cfg(corpus_cache, "--training.steps=8", "--lr_scheduler.warmup_steps=4",
                        "--training.global_batch_size=8", f"--training.mixed_precision={dtype}"), rec)
        runs[dtype] = [r.loss for r in rec.reports]
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert bf16[0] != fp32[0] and abs(bf16[0] - fp32[0]) < 0.02  # bf16 matmuls, same model
    assert bf16[-1] < bf16[0] - 0.5 and abs(bf16[-1] - fp32[-1]) < 0.1  # and it learns like fp32
