"""The driver's progress display (ray_titan.driver.progress), no Ray: plain lines for logs, a bar on a
terminal, and the collector's progress payload."""

from __future__ import annotations

import io
import os
import re
import select
import time

from ray_titan.config.units import MiB
from ray_titan.driver.progress import BarDisplay, ConsoleThread, LineDisplay, format_eta, format_postfix, make_display
from ray_titan.metrics.collector.collector import MetricsCollector
from ray_titan.parallel.dims import ParallelDims
from tests.unit.test_collector import _report

LATEST = {"step": 3, "total": 10, "loss": 2.5, "tokens_per_s": 6843.2,
          "max_memory": {"rank": 2, "bytes": 583 * MiB, "kind": "rss"}}


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_format_eta_and_postfix():
    assert [format_eta(s) for s in (None, float("nan"), 0, 59.6, 61, 3725)] == [
        "?", "?", "0:00", "1:00", "1:01", "1:02:05"]
    assert format_postfix(LATEST) == "loss 2.5000 | 6,843 tok/s | rss max 583 MiB (r2)"
    assert format_postfix({**LATEST, "loss": None, "max_memory": None}) == "loss n/a | 6,843 tok/s"


def test_line_mode_prints_each_line_once_with_the_eta_and_no_redraws():
    out, clock = io.StringIO(), _Clock()
    d = LineDisplay(10, out, clock)
    d.update({"lines": ["step  1/10 | loss 5.0"], "latest": {**LATEST, "step": 1}})
    clock.t += 20.0  # 2 steps in 20 s: 10 s/step, 7 steps left
    d.update({"lines": [], "latest": LATEST})
    d.update({"lines": ["step  3/10 | loss 2.5"], "latest": LATEST})
    clock.t += 70.0
    d.update({"lines": ["step 10/10 | loss 2.0"], "latest": {**LATEST, "step": 10}})
    d.close()
    # The first step carries start-up time, so no ETA is shown from it alone.
    assert out.getvalue().splitlines() == [
        "step  1/10 | loss 5.0",
        "step  3/10 | loss 2.5 | eta 1:10",
        "step 10/10 | loss 2.0 | eta 0:00",
    ]
    assert "\r" not in out.getvalue()


def test_bar_mode_renders_steps_eta_loss_throughput_and_memory():
    out = io.StringIO()
    d = BarDisplay(10, out)
    d.update({"lines": ["step  1/10 | loss 5.0"], "latest": {**LATEST, "step": 1}})
    d.update({"lines": [], "latest": LATEST})
    text = out.getvalue()
    last = text.split("\r")[-1]
    assert "step  1/10 | loss 5.0\n" in text  # console lines are written above the bar
    assert re.search(r"\| 3/10 \[\d\d:\d\d<[\d:?]+, loss 2\.5000 \| 6,843 tok/s \| rss max 583 MiB \(r2\)\]",
                     last), last
    d.close()


def test_auto_mode_picks_the_bar_on_a_terminal_and_lines_otherwise():
    master, slave = os.openpty()  # a pty that reports no window size, as under `script`
    with os.fdopen(slave, "w") as tty:
        bar = make_display(10, "auto", tty)
        assert isinstance(bar, BarDisplay)
        bar.update({"lines": [], "latest": LATEST})
        tty.flush()
        # Read until the update's draw arrives: the first read may hold only the initial 0/10.
        shown, deadline = "", time.monotonic() + 5
        while "3/10" not in shown and select.select([master], [], [], max(0.0, deadline - time.monotonic()))[0]:
            shown += os.read(master, 65536).decode()
        bar.close()
    os.close(master)
    # Drawn at a fixed width, not at the reported width 0 (which would draw nothing).
    assert re.search(r"30%\|\S+ *\| 3/10 \[", shown) and "loss 2.5000" in shown, shown
    assert isinstance(make_display(5, "auto", io.StringIO()), LineDisplay)
    assert isinstance(make_display(5, "bar", io.StringIO()), BarDisplay)


def test_console_thread_shows_polled_lines_then_the_final_summary():
    out = io.StringIO()
    payloads = [{"lines": ["a"], "latest": None}, RuntimeError("collector busy"), {"lines": ["b"], "latest": None}]

    def poll():
        item = payloads.pop(0) if payloads else {"lines": [], "latest": None}
        if isinstance(item, Exception):
            raise item
        return item

    t = ConsoleThread(poll, LineDisplay(2, out), interval_s=0.01)
    t.start()
    while payloads:
        t.stop_event.wait(0.01)
    t.finish({"lines": ["final"], "latest": None})
    assert out.getvalue().splitlines() == ["a", "b", "final"]
    assert not t.is_alive()


def test_collector_poll_gives_the_newest_step_and_the_rank_with_most_memory(tmp_path):
    dims = ParallelDims(pp=2, dp_shard=1)
    c = MetricsCollector(str(tmp_path), 2, dims.last_stage_ranks(), 5, log_freq=2, enable_tensorboard=False)
    assert c.poll() == {"lines": [], "latest": None}
    c.report([_report(1, 0, dims, rss=300 * MiB),
              _report(1, 1, dims, loss=4.0, tokens=512, step_time=0.5, rss=200 * MiB)])
    c.report([_report(2, 0, dims, step_time=0.25, rss=300 * MiB),
              _report(2, 1, dims, loss=3.0, tokens=512, step_time=0.25, rss=400 * MiB)])
    p = c.poll()
    assert [line.split(" |")[0] for line in p["lines"] if line.startswith("step")] == ["step 1/5", "step 2/5"]
    assert p["latest"] == {"step": 2, "total": 5, "loss": 3.0, "tokens_per_s": 512 / 0.25,
                           "max_memory": {"rank": 1, "bytes": 400 * MiB + 1, "kind": "rss"}}
    assert c.poll()["lines"] == []  # drained
    c.finish()
