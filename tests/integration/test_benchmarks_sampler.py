"""The benchmarks' CPU sampler on real processes."""

from __future__ import annotations

import pytest


def test_cpu_sampler_charges_a_busy_process_to_its_role(monkeypatch):
    import os
    import subprocess
    import sys
    import time

    import benchmarks.cpu
    from benchmarks.cpu import ROLES, CPUSampler, role_of

    assert role_of(7, "ray::MetricsCollector.report", driver_pid=1) == "collector actor"
    assert role_of(7, "/usr/bin/raylet --foo", driver_pid=1) == "ray system"
    assert role_of(7, "ray::RayTrainWorker._RayTrainWorker__execute", driver_pid=7) == "driver"
    # A child that spins for 1.5 s, with a role of its own: the machine may run real collectors.
    marker = f"rt-test-burner-{os.getpid()}"
    monkeypatch.setattr(benchmarks.cpu, "ROLES", [(marker, "collector actor"), *[(k, r if r != "collector actor"
                        else "other collectors") for k, r in ROLES]])
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass"
    with CPUSampler(interval_s=0.1) as sampler:
        t0 = time.time()
        subprocess.run([sys.executable, "-c", burn, marker], check=True)
        time.sleep(0.3)  # a last sample with the child gone
        t1 = time.time()
    roles, wall = sampler.cpu_by_role(t0 - 1, t1)
    assert 0 < wall <= t1 - t0 + 0.5
    # The child started and ended inside the window: processes not alive at both ends are left out.
    assert roles.get("collector actor", 0.0) == 0.0
    with CPUSampler(interval_s=0.1) as sampler:
        child = subprocess.Popen([sys.executable, "-c", burn, marker])
        time.sleep(0.3)
        t0 = time.time()
        time.sleep(0.8)  # the child spins for 1.5 s of CPU, so it is alive all through
        t1 = time.time()
        child.wait()
    roles, wall = sampler.cpu_by_role(t0, t1)
    # It spun all through the window (a share of it on a loaded machine).
    assert 0.1 < roles["collector actor"] <= wall + 0.05
    with pytest.raises(ValueError, match="fewer than two"):
        sampler.cpu_by_role(t1 + 100, t1 + 200)
