"""The memory verdict, synchronized GC and callbacks end to end on the shared local Ray cluster:
an injected leak of 1 MiB/step on one rank of pp=2 × dp_shard=2 is found on that rank only, at
its rate; with on_leak = "stop" it ends the run; GC runs on every rank at the same steps."""

from __future__ import annotations

import pyarrow as pa
import pytest

import ray_titan
from ray_titan.callbacks import InjectLeak
from ray_titan.config import load_config
from ray_titan.metrics.outcome import MemoryLeakError
from ray_titan.metrics.reading.steps import read_steps
from tests.conftest import REPO

pytestmark = pytest.mark.ray

LEAK_RANK, GC_FREQ = 1, 7


def _cfg(tmp_path, corpus_cache, *overrides):
    return load_config(REPO / "configs" / "debug_llama.toml", [
        f"--job.dump_folder={tmp_path}", f"--data.cache_dir={corpus_cache}", "--metrics.log_freq=1000",
        f"--training.gc_freq={GC_FREQ}", "--memory.breakdown_step=0", *overrides,
    ])


@pytest.fixture(scope="module")
def leak_run(ray_cluster, tmp_path_factory, corpus_cache):
    """60 steps on 4 workers; rank 1 retains 1 MiB of host memory after every step."""
    cfg = _cfg(tmp_path_factory.mktemp("leak"), corpus_cache, "--job.name=leak", "--training.steps=60")
    return ray_titan.train(cfg, callbacks=[InjectLeak(ranks=[LEAK_RANK], mib_per_step=1.0)])


def _rank(t: pa.Table, rank: int) -> pa.Table:
    return t.filter(pa.compute.equal(t["rank"], rank)).sort_by("step")


def test_injected_leak_is_growing_on_that_rank_only_at_its_rate(leak_run):
    t = leak_run.steps
    assert leak_run.errors == [] and t.num_rows == 60 * 4
    for rank in range(4):
        verdicts = _rank(t, rank)["memory_verdict"].to_pylist()
        if rank != LEAK_RANK:
            assert "growing" not in verdicts, rank
            continue
        warm_up_end = max(i for i, v in enumerate(verdicts, 1) if v == "warming_up") + 1
        first_growing = verdicts.index("growing") + 1
        assert first_growing <= warm_up_end + 30
        assert all(v == "growing" for v in verdicts[first_growing - 1:])
    final = leak_run.memory_verdicts[LEAK_RANK]
    assert final["verdict"] == "growing" and final["coords"] == {"pp": 0, "dp_shard": 1}
    assert final["slope_mib_per_step"] == pytest.approx(1.0, rel=0.25)
    assert final["oom_step"] > 60  # from the host memory still available
    assert {leak_run.memory_verdicts[r]["verdict"] for r in (0, 2, 3)} == {"stable"}


def test_gc_runs_on_every_rank_at_exactly_the_same_steps(leak_run):
    t = leak_run.steps
    expected = list(range(GC_FREQ, 61, GC_FREQ))
    for rank in range(4):
        rows = _rank(t, rank)
        gc_steps = [s for s, g in zip(rows["step"].to_pylist(), rows["gc_generation"].to_pylist()) if g is not None]
        assert gc_steps == expected, rank
        pauses = dict(zip(rows["step"].to_pylist(), rows["gc_pause_s"].to_pylist()))
        assert all(pauses[s] > 0 for s in expected) and all(pauses[s] == 0 for s in pauses if s not in expected)


def test_verdict_is_in_tensorboard(leak_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(leak_run.tensorboard_dir))
    acc.Reload()
    codes = [e.value for e in acc.Scalars(f"memory/rank{LEAK_RANK}/verdict")]
    assert codes[0] == 0 and codes[-1] == 2  # warming_up ... growing
    assert {e.value for e in acc.Scalars("memory/rank0/verdict")} <= {0, 1}


def test_on_leak_stop_ends_the_run_naming_rank_coordinates_and_rate(ray_cluster, tmp_path, corpus_cache):
    # Default thresholds: a healthy rank's RSS once rose +0.68 MiB/step to warm-up's forced end in
    # CI, above the 0.5 default, but that was malloc's free space, which the host series leaves out.
    cfg = _cfg(tmp_path, corpus_cache, "--job.name=stop", "--training.steps=300", "--memory.on_leak=stop",
               "--parallelism.pp=1")
    with pytest.raises(MemoryLeakError,
                       match=r"rank 1 \(pp=0, dp_shard=1\): memory growing \+\d\.\d+ MiB/step "
                             r"\(host RSS - malloc free\)"):
        ray_titan.train(cfg, callbacks=[InjectLeak(ranks=[1], mib_per_step=2.0)])
    (run_dir,) = tmp_path.glob("stop-*")
    steps = read_steps(run_dir)
    assert steps.num_rows < 100 * 2  # stopped long before step 300
    assert _rank(steps, 1)["memory_verdict"].to_pylist()[-1] == "growing"
