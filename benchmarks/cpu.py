"""CPU time of every process on this machine over a time window, grouped by role (Linux ``/proc``).

A throughput ratio on a shared machine moves by a few percent from run to run; the CPU time the
collector actor, the driver and Ray's own processes take is a direct, much steadier figure of
what the metrics path costs. :class:`CPUSampler` reads ``/proc/<pid>/stat`` (user + system
time) of every process every ``interval_s`` in a thread; :meth:`CPUSampler.cpu_by_role` gives
each role's CPU seconds between two Unix times.
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["ROLES", "CPUSampler", "read_cpu_times", "role_of"]

ROLES = [
    ("MetricsCollector", "collector actor"),
    ("RayTrainWorker", "train workers"),
    ("TrainController", "ray system"),
    ("raylet", "ray system"),
    ("gcs_server", "ray system"),
    ("dashboard", "ray system"),
    ("log_monitor", "ray system"),
    ("ray::", "other ray workers"),
]
"""(substring of the command line, role), first match wins; the benchmark process is ``driver``
and anything else ``other``."""

_TICK = os.sysconf("SC_CLK_TCK")


def role_of(pid: int, cmdline: str, driver_pid: int) -> str:
    """The role of a process (see :data:`ROLES`)."""
    if pid == driver_pid:
        return "driver"
    return next((role for key, role in ROLES if key in cmdline), "other")


def read_cpu_times() -> dict[int, tuple[float, str]]:
    """``{pid: (user + system CPU seconds so far, command line)}`` of every readable process."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read(200).replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended while we looked
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state is field 3
        out[int(name)] = ((int(fields[11]) + int(fields[12])) / _TICK, cmd)
    return out


class CPUSampler:
    """Samples :func:`read_cpu_times` every ``interval_s`` seconds in a daemon thread, from
    :meth:`start` to :meth:`stop` (a context manager does both)."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[int, tuple[float, str]]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> CPUSampler:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    __enter__ = start

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), read_cpu_times()))
            self._stop.wait(self.interval_s)

    def cpu_by_role(self, t0: float, t1: float) -> tuple[dict[str, float], float]:
        """CPU seconds per role between the samples nearest to Unix times ``t0`` and ``t1``, and
        the wall seconds between those samples. Processes alive at both samples only (one that
        started or ended in between is left out). Raises ``ValueError`` with fewer than two
        samples in the window."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            raise ValueError(f"fewer than two CPU samples between {t0:.1f} and {t1:.1f}")
        (ta, a), (tb, b) = inside[0], inside[-1]
        roles: dict[str, float] = {}
        for pid, (cpu, cmd) in b.items():
            if pid in a:
                role = role_of(pid, cmd, os.getpid())
                roles[role] = roles.get(role, 0.0) + cpu - a[pid][0]
        return roles, tb - ta
