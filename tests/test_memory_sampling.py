"""Memory sampling and snapshots without a GPU: the host fields from /proc, and the device code
paths against a stand-in allocator API (the calls and keys of torch.accelerator / torch.cuda)."""

from __future__ import annotations

import pickle

import torch

import ray_titan.metrics.memory as memory
from ray_titan.metrics.memory import MEMORY_FIELDS, MemorySnapshots, host_available, host_heap, sample_memory

MiB = 2**20


def test_host_available_is_positive_and_below_total():
    total = int(open("/proc/meminfo").readline().split()[1]) * 1024
    assert 0 < host_available() <= total


def test_heap_in_use_follows_tensor_allocations_and_ignores_freed_space():
    """A CPU tensor's storage is malloc'd: the in-use figure rises by its size and falls back when
    it is freed, small and large (mmapped) allocations alike."""
    for nbytes in (64 * 1024, 48 * MiB):
        before = host_heap()[0]
        t = torch.ones(nbytes // 4)
        during = host_heap()[0]
        del t
        after = host_heap()[0]
        assert during - before >= nbytes and during - before < nbytes + MiB
        assert abs(after - before) < MiB


class _FakeAccelerator:
    """Answers like the caching allocator's ``memory_stats`` and records peak resets."""

    def __init__(self):
        self.resets = 0

    def memory_stats(self, device):
        return {"allocated_bytes.all.current": 10 * MiB, "active_bytes.all.current": 11 * MiB,
                "reserved_bytes.all.current": 16 * MiB, "active_bytes.all.peak": 12 * MiB,
                "reserved_bytes.all.peak": 20 * MiB, "num_alloc_retries": 2, "num_ooms": 1,
                "allocated_bytes.all.peak": 13 * MiB}

    def reset_peak_memory_stats(self, device):
        self.resets += 1


def test_device_fields_come_from_the_allocator_stats_and_peaks_are_reset(monkeypatch):
    fake = _FakeAccelerator()
    monkeypatch.setattr(memory, "_accelerator", lambda: fake)
    monkeypatch.setattr(memory, "_capacity", lambda device: 80 * 1024 * MiB)
    s = sample_memory(torch.device("cuda", 0))
    assert set(s) == set(MEMORY_FIELDS) and all(v is not None for v in s.values())
    assert (s["device_allocated_bytes"], s["device_active_bytes"], s["device_reserved_bytes"]) == (
        10 * MiB, 11 * MiB, 16 * MiB)
    assert (s["device_peak_active_bytes"], s["device_peak_reserved_bytes"]) == (12 * MiB, 20 * MiB)
    assert (s["device_alloc_retries"], s["device_ooms"], s["device_capacity_bytes"]) == (2, 1, 80 * 1024 * MiB)
    assert fake.resets == 1  # peaks are "since the previous sample"


def test_cuda_snapshots_record_history_and_dump_on_request_and_on_oom(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kw: calls.append(("record", enabled, kw.get("max_entries"))))

    def dump(path):
        calls.append(("dump", path))
        with open(path, "wb") as f:
            pickle.dump({"segments": []}, f)

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    monkeypatch.setattr(memory, "_accelerator", lambda: _FakeAccelerator())
    monkeypatch.setattr(memory, "_capacity", lambda device: 80 * 1024 * MiB)
    snaps = MemorySnapshots(tmp_path, 3, {"pp": 1, "dp_shard": 1}, torch.device("cuda", 0), steps=[2],
                            max_entries=1000)
    snaps.start()
    for step in (1, 2):
        snaps.before_step(step)
        snaps.after_step(step)
    error = snaps.oom(3, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    snaps.close()
    assert calls[0] == ("record", "all", 1000) and calls[-1] == ("record", None, None)
    assert [c[1].rsplit("/", 1)[1] for c in calls if c[0] == "dump"] == ["rank3-step2.pickle", "rank3-oom-step3.pickle"]
    assert [p.name for p in snaps.paths] == ["rank3-step2.pickle", "rank3-oom-step3.pickle"]
    msg = str(error)
    assert msg.startswith("rank 3 (pp=1, dp_shard=1) ran out of memory at step 3: peak device allocated 13 MiB, "
                          "reserved 20 MiB of 81920 MiB, peak host RSS ")
    assert "rank3-oom-step3.pickle" in msg and "Tried to allocate 2.00 GiB" in msg
