"""The worker's C allocator: which one a config asks for, what the driver preloads, and the
in-use / free figures and trim under jemalloc (in a child process started with the preload, as
a Ray Train worker is)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ray_titan.allocator as allocator
from ray_titan.allocator import active_allocator, jemalloc_library, worker_env_vars
from ray_titan.config import ConfigError, JobConfig
from ray_titan.config.units import MiB
from ray_titan.preflight.checks import validate_job

JEMALLOC = jemalloc_library()
needs_jemalloc = pytest.mark.skipif(JEMALLOC is None, reason="the installed Ray ships no libjemalloc.so")


def test_system_preloads_nothing_and_a_test_process_runs_glibc():
    assert worker_env_vars("system") == {}
    assert active_allocator() == "glibc"


@needs_jemalloc
def test_auto_and_jemalloc_preload_rays_library_ahead_of_the_drivers_preload(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    assert worker_env_vars("auto") == worker_env_vars("jemalloc") == {"LD_PRELOAD": JEMALLOC}
    monkeypatch.setenv("LD_PRELOAD", "/opt/libother.so")
    monkeypatch.setenv("MALLOC_CONF", "narenas:2")
    assert worker_env_vars("auto") == {"LD_PRELOAD": f"{JEMALLOC} /opt/libother.so", "MALLOC_CONF": "narenas:2"}


def test_where_ray_is_not_installed_auto_is_the_systems_and_jemalloc_says_why(monkeypatch):
    # The launcher's pre-flight on a node without Ray: ray is not imported (it would fail), only located.
    monkeypatch.setitem(sys.modules, "ray", None)
    assert jemalloc_library() is None and worker_env_vars("auto") == {}
    with pytest.raises(ValueError, match=r"'jemalloc', but Ray, whose wheel ships it, is not installed"):
        worker_env_vars("jemalloc")
    validate_job(JobConfig.from_dict({"memory": {"allocator": "auto"}}))  # no ImportError


def test_without_rays_jemalloc_auto_falls_back_and_jemalloc_is_a_config_error(monkeypatch):
    monkeypatch.setattr(allocator, "jemalloc_library", lambda: None)
    assert worker_env_vars("auto") == {}
    with pytest.raises(ValueError, match="memory.allocator = 'bogus': expected one of auto, jemalloc, system"):
        worker_env_vars("bogus")
    cfg = JobConfig.from_dict({"memory": {"allocator": "jemalloc"}})
    with pytest.raises(ConfigError, match=r"memory.allocator = 'jemalloc'.*no jemalloc library.*'auto' or 'system'"):
        validate_job(cfg)


_CHILD = r"""
import json, torch
from ray_titan.allocator import active_allocator, host_heap, malloc_trim
from ray_titan.config.units import MiB
from ray_titan.metrics.worker.memory import host_memory
out = {"allocator": active_allocator(), "before": host_heap()}
t = torch.ones(64 * MiB // 4)
out["during"] = host_heap()
del t
out["after"] = host_heap()
out["rss_before_trim"] = host_memory()[0]
out["trimmed"] = malloc_trim()
out["after_trim"] = host_heap()
out["rss_after_trim"] = host_memory()[0]
print(json.dumps(out))
"""


@needs_jemalloc
def test_under_jemalloc_in_use_follows_a_tensor_and_trim_returns_its_free_pages():
    env = {**os.environ, **worker_env_vars("jemalloc")}
    got = json.loads(subprocess.run([sys.executable, "-c", _CHILD], env=env, check=True,
                                    capture_output=True, text=True).stdout)
    assert got["allocator"] == "jemalloc"
    (in0, _), (in1, _), (in2, free2) = got["before"], got["during"], got["after"]
    assert 64 * MiB <= in1 - in0 < 65 * MiB
    assert abs(in2 - in0) < MiB
    assert got["trimmed"] is True
    # What the purge gave back leaves both the allocator's free bytes and RSS.
    assert got["after_trim"][1] < free2
    assert got["rss_after_trim"] < got["rss_before_trim"]


_LAZY_CHILD = r"""
import json, time, torch
from ray_titan.allocator import host_heap, jemalloc_muzzy_decay_ms, lazy_free_bytes
from ray_titan.config.units import MiB
from ray_titan.metrics.worker.memory import host_memory
def series():
    return host_memory()[0] - host_heap()[1]  # what the leak verdict watches: RSS less malloc's free bytes
out = {"muzzy": jemalloc_muzzy_decay_ms(), "before": series()}
blocks = [torch.ones(MiB // 4) for _ in range(200)]
del blocks
lazy = 0
for _ in range(30):  # jemalloc decays idle pages as it runs: allocate and free until some go lazily
    time.sleep(0.1)
    small = [torch.ones(1000) for _ in range(1000)]
    del small
    lazy = max(lazy, lazy_free_bytes())
out.update(after=series(), lazy=lazy, after_uncorrected=series() + lazy_free_bytes())
print(json.dumps(out))
"""


@needs_jemalloc
def test_pages_handed_back_with_madv_free_are_not_read_as_growth():
    """With jemalloc's muzzy decay on (MALLOC_CONF), idle pages go back with MADV_FREE: they stay
    in RSS (LazyFree) while jemalloc stops counting them as resident. The host series counts
    them as free, so 200 MiB allocated and freed leaves it where it was."""
    env = {**os.environ, **worker_env_vars("jemalloc"), "MALLOC_CONF": "dirty_decay_ms:500,muzzy_decay_ms:100000"}
    got = json.loads(subprocess.run([sys.executable, "-c", _LAZY_CHILD], env=env, check=True,
                                    capture_output=True, text=True).stdout)
    assert got["muzzy"] == 100000 and got["lazy"] > 10 * MiB
    assert abs(got["after"] - got["before"]) < 8 * MiB
    assert got["after_uncorrected"] - got["before"] > 10 * MiB  # what jemalloc's own count would read
