"""Beyond one machine, on a real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``:
a head and two worker nodes, separate raylets on loopback, each with its own CPUs and a custom
resource naming it): the placement of ranks on nodes, and an elastic run that loses a node and
gets it back without changing its loss curve.

The driver of each run is a subprocess joined to the cluster by ``RAY_ADDRESS`` (this pytest
process may be connected to the session's one-node cluster; a process joins one cluster only).
A run is held at a known step (``tests/support/multinode_pause.py``) while a node is removed (its raylet
and its workers killed) or added. Only nodes this module started are stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from ray_titan.config import ConfigError, load_config
from ray_titan.parallel.elastic import fitting_worker_counts, mesh_for_workers
from ray_titan.preflight.checks import validate_job
from tests.conftest import LLAMA_ONE_WORKER_STEPS, REPO

STEPS, INTERVAL = 8, 3
# pp=2 × dp_shard=2: two workers (0.5 CPU each) fill a worker node.
JOB = ["--parallelism.pp=2", "--parallelism.dp_shard=2", f"--training.steps={STEPS}",
       f"--checkpoint.interval={INTERVAL}", "--metrics.log_freq=1", "--metrics.flush_every_steps=1",
       "--ray.cpus_per_worker=0.5", "--memory.breakdown_step=0"]
NODE_CPUS = 1

_DRIVER = """
import json, sys
import ray_titan
from ray_titan.config import load_config
from tests.support.multinode_pause import PauseAt
a = json.loads(sys.argv[1])
cfg = load_config(a["config"], a["overrides"])
r = ray_titan.train(cfg, progress="lines", callbacks=[PauseAt(a["pause_dir"], a["pauses"])])
json.dump({"run_dir": str(r.run_dir), "losses": r.losses(), "restarts": r.restarts, "errors": r.errors},
          open(a["out"], "w"))
"""


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.2)


class Run:
    """A driver subprocess on the cluster; ``finish()`` returns its summary (RunResult's figures)."""

    def __init__(self, address: str, root: Path, name: str, overrides: list[str],
                 pauses: list[tuple[int, int, str]] = ()):
        self.dir = root / name
        self.dir.mkdir()
        self.log = self.dir / "driver.log"
        args = {"config": str(REPO / "configs" / "debug_llama.toml"), "out": str(self.dir / "result.json"),
                "pause_dir": str(self.dir), "pauses": list(pauses),
                "overrides": [f"--job.name={name}", f"--job.dump_folder={self.dir / 'dump'}", *JOB, *overrides]}
        env = {**os.environ, "RAY_ADDRESS": address}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", _DRIVER, json.dumps(args)], cwd=REPO, env=env,
                                         stdout=log, stderr=subprocess.STDOUT)

    def paused(self, name: str, ranks: int) -> bool:
        assert self.proc.poll() is None, f"the run ended early:\n{self.log.read_text()[-4000:]}"
        return len(list(self.dir.glob(f"{name}.[0-9]*"))) == ranks

    def release(self, name: str) -> None:
        (self.dir / f"{name}.done").touch()

    def finish(self, timeout: float = 300) -> dict:
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        assert rc == 0, self.log.read_text()[-6000:]
        result = json.loads((self.dir / "result.json").read_text())
        result["steps"] = pq.read_table(Path(result["run_dir"]) / "metrics" / "steps.parquet")
        result["log"] = self.log.read_text()
        return result


@pytest.fixture(scope="module")
def cluster():
    """Head (no CPUs: drivers, the collector and Ray Train's controller only) + nodes a and b."""
    from ray._common.utils import get_default_ray_temp_dir
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="rt_mn_", dir="/tmp")
    # Cluster records its head's address in Ray's default temp dir (/tmp/ray) whatever temp_dir
    # says, and fails where no Ray node has ever made that directory (a fresh machine).
    os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "resources": {"node_head": 1}, "temp_dir": temp_dir,
        # A killed raylet is declared dead after ~3 s instead of ~15 s.
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3},
    })
    nodes = {name: c.add_node(num_cpus=NODE_CPUS, resources={f"node_{name}": 1}, temp_dir=temp_dir)
             for name in ("a", "b")}
    c.wait_for_nodes()
    try:
        yield c, nodes
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("multinode")


@pytest.fixture(scope="module")
def one_process(llama_one_worker):
    """The same model, seed and data on one process without Ray (pp = dp_shard = 1): the
    session's (tests/conftest.py), whose first ``STEPS`` steps are this job's (its checkpoints and
    metrics settings do not change the curve)."""
    assert STEPS <= LLAMA_ONE_WORKER_STEPS
    return llama_one_worker.steps.filter(pc.less_equal(llama_one_worker.steps["step"], STEPS))


@pytest.fixture(scope="module")
def elastic_run(cluster, root, corpus_cache):
    """pp=2 × dp_shard=2 with ``ray.num_workers = [2, 4]``: node b is removed at step 4 (after the
    step-3 checkpoint), the run goes on as pp=2 × dp_shard=1 on node a; at step 7 (after the
    step-6 checkpoint) a node comes back and Ray grows the group to 4 workers again."""
    c, nodes = cluster
    run = Run(c.address, root, "elastic", [
        f"--data.cache_dir={corpus_cache}", "--ray.num_workers=[2, 4]", "--ray.max_failures=2",
        "--ray.elastic_resize_interval_s=2"], pauses=[(4, 4, "lose"), (7, 2, "grow")])
    try:
        _wait_for(lambda: run.paused("lose", 4), 240, "4 ranks at step 4")
        c.remove_node(nodes.pop("b"))
        run.release("lose")
        _wait_for(lambda: run.paused("grow", 2), 240, "the 2-rank group at step 7")
        nodes["b"] = c.add_node(num_cpus=NODE_CPUS, resources={"node_b": 1}, temp_dir=c.head_node.get_temp_dir_path())
        return run.finish()
    finally:
        run.release("grow")  # a group that was never resized must not wait out its pause
        if run.proc.poll() is None:
            run.proc.kill()


def _by_rank(table, step: int) -> dict[int, dict]:
    rows = [r for r in table.to_pylist() if r["step"] == step]
    return {r["rank"]: r for r in rows}


def _curve(table) -> list[float]:
    rows = sorted((r["step"], r["step_loss"]) for r in table.to_pylist() if r["rank"] == 0)
    return [loss for _, loss in rows]


@pytest.mark.ray
def test_each_stage_is_on_one_node_while_the_run_has_both_nodes(elastic_run):
    """Steps 1-3 (4 ranks, nodes a and b): each stage's dp_shard group on one node, the two
    stages on two nodes (Ray Train numbers ranks node by node; the mesh is row-major)."""
    t = elastic_run["steps"]
    for step in range(1, INTERVAL + 1):
        rows = _by_rank(t, step)
        assert sorted(rows) == [0, 1, 2, 3]
        stage_nodes = {pp: {r["node"] for r in rows.values() if r["pp"] == pp} for pp in (0, 1)}
        assert all(len(n) == 1 for n in stage_nodes.values()), stage_nodes
        assert stage_nodes[0] != stage_nodes[1]
    assert "layout of 4 ranks on 2 node(s)" in elastic_run["log"]


@pytest.mark.ray
def test_elastic_run_shrinks_on_node_loss_grows_back_and_keeps_the_loss_curve(elastic_run, one_process):
    """Every step's loss equals the uninterrupted run's: the one-process run of the same model,
    seed and data (which the fixed-size mesh equals, tests/integration/test_parallel_parity.py), so one
    Ray run serves the placement, node-loss and elastic assertions."""
    t = elastic_run["steps"]
    assert elastic_run["errors"] == []
    np.testing.assert_allclose(elastic_run["losses"], _curve(one_process), rtol=1e-4)
    sizes = {s: {r["world_size"] for r in _by_rank(t, s).values()} for s in range(1, STEPS + 1)}
    # Steps 1-3: 4 ranks; node b lost at step 4 → replayed from the step-3 checkpoint on 2 ranks;
    # capacity back at step 7 → replayed from the step-6 checkpoint on 4 ranks.
    assert sizes == {1: {4}, 2: {4}, 3: {4}, 4: {2}, 5: {2}, 6: {2}, 7: {4}, 8: {4}}
    keys = sorted(zip(t["step"].to_pylist(), t["rank"].to_pylist()))
    assert keys == sorted((s, r) for s in range(1, STEPS + 1) for r in range(next(iter(sizes[s]))))
    attempts = {s: {r["attempt"] for r in _by_rank(t, s).values()} for s in range(1, STEPS + 1)}
    assert attempts == {s: {0 if s <= 3 else 1 if s <= 6 else 2} for s in range(1, STEPS + 1)}
    assert elastic_run["restarts"] == 2
    shrunk = _by_rank(t, 5)
    assert {r["dp_shard"] for r in shrunk.values()} == {0} and {r["pp"] for r in shrunk.values()} == {0, 1}
    assert len({r["node"] for r in shrunk.values()}) == 1  # the node left
    assert "layout of 2 ranks on 1 node(s)" in elastic_run["log"]


# -- without Ray ---------------------------------------------------------------------------------


def _cfg(*overrides: str):
    return load_config(REPO / "configs" / "debug_llama.toml", ["--parallelism.pp=2", "--parallelism.dp_shard=2",
                                                                *overrides])


def test_elastic_mesh_shrinks_data_parallel_axes_only():
    cfg = _cfg("--parallelism.dp_replicate=2", "--ray.num_workers=[2, 8]", "--training.global_batch_size=24",
               "--parallelism.microbatches=2")
    assert fitting_worker_counts(cfg) == [2, 4, 6, 8]
    par = mesh_for_workers(cfg, 4).parallelism
    assert (par.pp, par.dp_replicate, par.dp_shard, par.tp) == (2, 1, 2, 1)
    par = mesh_for_workers(cfg, 6).parallelism
    assert (par.pp, par.dp_replicate, par.dp_shard) == (2, 3, 1)
    assert mesh_for_workers(cfg, 5) is None  # pp = 2 does not divide it
    assert mesh_for_workers(cfg, 8) is cfg


@pytest.mark.parametrize(("overrides", "message"), [
    (["--ray.num_workers=[3, 4]", "--ray.max_failures=1"], r"no mesh fits min = 3 workers .* counts that fit: \[4\]"),
    (["--ray.num_workers=[2, 8]", "--ray.max_failures=1"], r"max = 8 must be the mesh's size"),
    (["--ray.num_workers=[4, 2]"], r"1 <= min <= max"),
    (["--ray.num_workers=[2, 4]"], r"ray.max_failures >= 1 and checkpoint.enable = true"),
])
def test_bad_elastic_ranges_are_refused_before_any_worker(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_job(_cfg("--checkpoint.enable=true", *overrides))
