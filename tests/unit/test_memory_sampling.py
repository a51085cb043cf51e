"""Memory sampling and snapshots without a GPU: the host fields from /proc, and the device code
paths against a stand-in allocator API (the calls and keys of torch.accelerator / torch.cuda)."""

from __future__ import annotations

import pickle

import pytest
import torch

import ray_titan.metrics.worker.memory as memory
from ray_titan.config.units import MiB
from ray_titan.metrics.fields import MEMORY_FIELDS
from ray_titan.metrics.worker.memory import (
    MemorySnapshots,
    find_oom,
    host_available,
    host_heap,
    oom_site,
    sample_memory,
)
from ray_titan.parallel.pipeline import SCHEDULES, build_pipeline_schedule


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


def test_cuda_snapshots_record_bounded_history_and_dump_on_request_and_on_oom(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kw: calls.append(("record", enabled, kw)))

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
    # From the start only the live allocations' Python stacks (bounded by the live blocks); the
    # event ring only during the requested step, dropped after its snapshot (issue 29).
    state = ("record", "state", {"context": "state", "stacks": "python"})
    assert [c if c[0] == "record" else c[1].rsplit("/", 1)[1] for c in calls] == [
        state, ("record", "all", {"context": "all", "stacks": "python", "max_entries": 1000}),
        "rank3-step2.pickle", ("record", None, {}), state, "rank3-oom-step3.pickle", ("record", None, {})]
    assert [p.name for p in snaps.paths] == ["rank3-step2.pickle", "rank3-oom-step3.pickle"]
    msg = str(error)
    assert msg.startswith("rank 3 (pp=1, dp_shard=1) ran out of memory at step 3: peak device allocated 13 MiB, "
                          "reserved 20 MiB of 81920 MiB, peak host RSS ")
    assert "rank3-oom-step3.pickle" in msg and "Tried to allocate 2.00 GiB" in msg


class TransformerBlock(torch.nn.Module):
    """A stand-in decoder block: its class name is one InjectOOM hooks."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


@pytest.fixture(scope="module")
def world_of_one():
    """A one-rank gloo process group in this process: every stage of a schedule on rank 0."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_an_oom_inside_any_schedule_is_found_through_its_wrapping(world_of_one, schedule, where):
    """torch's pipelining re-raises what a stage's forward or backward raised as a plain
    RuntimeError: find_oom must see the OOM behind it, and oom_site say where it was."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    from ray_titan.callbacks import CallbackContext, InjectOOM

    n = 1 if issubclass(SCHEDULES[schedule].torch_class, PipelineScheduleSingle) else 2
    stages = {s: TransformerBlock() for s in range(n)}
    sched = build_pipeline_schedule(schedule, stages, n, 2, lambda out, y: (out - y).pow(2).mean(),
                                    torch.device("cpu"), world_of_one, dict.fromkeys(range(n), 0))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    sched.step(x, target=y)  # the first step infers the stages' shapes outside the wrapped forward
    ctx = CallbackContext(0, {"pp": 0}, 1, torch.device("cpu"), None, None)  # type: ignore[arg-type]
    inject = InjectOOM(rank=0, step=3, where=where, host=True)
    inject.on_step_begin(ctx, 3)
    with pytest.raises(Exception) as info:
        sched.step(x, target=y)
    inject.on_train_end(ctx)
    oom = find_oom(info.value)
    assert isinstance(oom, MemoryError) and "simulated allocation failure" in str(oom)
    # What the loop used to catch by type alone: every schedule wraps it.
    assert type(info.value) is RuntimeError
    if where == "forward":
        assert oom_site(info.value, stages) == "in the forward of pipeline stage 0"
    else:
        assert oom_site(info.value, stages) == ("in the backward of pipeline stage 0" if n == 1
                                                else "in the backward of one of pipeline stages 0, 1")


def test_find_oom_follows_causes_contexts_and_groups():
    def raised(make):
        try:
            make()
        except BaseException as e:
            return e

    def wrapped_cuda_oom():
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError:
            raise ValueError("while handling")  # noqa: B904 (an implicit __context__ is the point)

    e = raised(wrapped_cuda_oom)
    assert isinstance(find_oom(RuntimeError("outer").with_traceback(None)), type(None))
    assert isinstance(find_oom(e), torch.OutOfMemoryError)
    group = BaseExceptionGroup("many", [ValueError("a"), MemoryError("host")])
    assert isinstance(find_oom(group), MemoryError)
    looped = RuntimeError("a")
    looped.__context__ = RuntimeError("b")
    looped.__context__.__context__ = looped  # a cycle ends the search, not the process
    assert find_oom(looped) is None
    assert oom_site(RuntimeError("elsewhere")) is None
