"""The run's outcome typed at the driver's boundary: each reason a run stopped has its own name."""

from __future__ import annotations

from ray_titan.metrics.collector.collector import MetricsCollector
from ray_titan.metrics.outcome import RunOutcome, StopReason


def _collector(tmp_path) -> MetricsCollector:
    return MetricsCollector(str(tmp_path), 1, [0], 4, enable_tensorboard=False)


def test_a_nonfinite_loss_and_a_memory_leak_are_told_apart(tmp_path):
    c = _collector(tmp_path / "nan")
    c.stop_run("non-finite loss nan at step 2")
    nan = RunOutcome.from_summary(c.finish())
    assert (nan.stop_reason, nan.nonfinite_loss, nan.memory_leak) == (
        StopReason.NONFINITE_LOSS, "non-finite loss nan at step 2", None)

    c = _collector(tmp_path / "leak")
    c.stop_reason = "rank 0: memory grows 3 MiB per step"  # what the leak policy sets (collector.stop_reason)
    leak = RunOutcome.from_summary(c.finish())
    assert (leak.stop_reason, leak.memory_leak, leak.nonfinite_loss) == (
        StopReason.MEMORY_LEAK, "rank 0: memory grows 3 MiB per step", None)

    done = RunOutcome.from_summary(_collector(tmp_path / "done").finish())
    assert done.stop_reason is StopReason.COMPLETED and done.final_loss_is_finite


def test_a_collector_that_cannot_finish_leaves_no_loss_and_says_why():
    outcome = RunOutcome.collector_failed(TimeoutError("no answer in 120 s"))
    assert outcome.final_loss is None and outcome.stop_reason is StopReason.COMPLETED
    assert outcome.errors == ["metrics collector failed to finish: no answer in 120 s"]
    assert not RunOutcome(final_loss=float("nan")).final_loss_is_finite


def test_the_driver_raises_each_reason_as_its_own_error(tmp_path, capsys):
    import pytest

    from ray_titan.driver.run import _raise_if_stopped
    from ray_titan.driver.signals import SignalGuard
    from ray_titan.metrics.outcome import MemoryLeakError
    from ray_titan.trainer.nonfinite import NonFiniteError

    signals = SignalGuard(note="")
    failed = RuntimeError("worker group failed")
    with pytest.raises(MemoryLeakError, match="grows"):  # the leak policy ended the worker group
        _raise_if_stopped(failed, RunOutcome(memory_leak="rank 0 grows"), signals, tmp_path, "no checkpoint")
    with pytest.raises(RuntimeError, match="worker group failed"):
        _raise_if_stopped(failed, RunOutcome(nonfinite_loss="nan"), signals, tmp_path, "no checkpoint")
    with pytest.raises(NonFiniteError, match="nan at step 2"):
        _raise_if_stopped(None, RunOutcome(nonfinite_loss="nan at step 2"), signals, tmp_path, "no checkpoint")
    _raise_if_stopped(None, RunOutcome(final_loss=5.5), signals, tmp_path, "no checkpoint")  # finished: no error
    assert "run failed" in capsys.readouterr().err


def test_sigterm_takes_the_ctrl_c_path_and_keeps_its_own_status():
    """SIGTERM (what schedulers send) under the driver's guard calls whatever handles Ctrl-C then
    (Ray Train's, which aborts the worker group) and is remembered for the exit status (143);
    the process is not ended while the run stops in time. The Ray runs of the integration test
    send Ctrl-C and SIGHUP, whose path adds only the terminal's streams to this one."""
    import os
    import signal
    import time

    from ray_titan.driver.signals import SignalGuard

    seen: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with SignalGuard(grace_s=60) as guard:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 5
            while not seen and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        signal.signal(signal.SIGINT, old)
    assert seen == [signal.SIGINT] and guard.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) != guard._on_sigterm  # given back
