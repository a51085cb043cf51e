"""Shared fixtures: one local Ray cluster for the whole session (docs/design.md, Testing)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Set before Ray is imported anywhere: the tests' local cluster runs without token auth.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")

REPO = Path(__file__).resolve().parents[1]
# Subprocesses (Ray workers, torchrun ranks) import this checkout, not whichever one is installed.
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by every integration test; its GCS address is returned."""
    import ray

    from ray_titan.driver import init_local_cluster

    temp_dir = tempfile.mkdtemp(prefix="rt_ray_", dir="/tmp")
    # As the product starts Ray: with the dashboard, named to Ray Train's placement-group cleaner
    # (without it, another developer's cluster on this machine could stop our runs).
    init_local_cluster(num_cpus=2, _temp_dir=temp_dir, log_to_driver=True)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> str:
    """A cache dir holding the materialised python_stdlib corpus, shared by the session."""
    from ray_titan.data.corpus import materialize_python_stdlib

    path = tmp_path_factory.mktemp("corpus_cache")
    materialize_python_stdlib(path)
    return str(path)


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """Tiny random Hugging Face models of every family (``tests/support/hf_models.py``), saved once per
    session: ``(root, {family: transformers model})``, each in ``root / family``."""
    from ray_titan.models.registry import FAMILIES
    from tests.support.hf_models import make_hf_model

    root = tmp_path_factory.mktemp("hf_models")
    return root, {f: make_hf_model(f, root / f) for f in FAMILIES}


class LaunchRun:
    """A job run without Ray (``python -m ray_titan.launch`` on ``nproc`` ranks: one process, or
    torchrun's ranks, forked from the session's forkserver: ``tests/support/ranks.py``): the one-worker
    side of a parity check, or a mesh where Ray is not the subject (docs/design.md, Testing).
    ``steps``, ``step_column`` and ``tensorboard_dir`` as :class:`ray_titan.driver.RunResult`'s;
    a failed run raises."""

    def __init__(self, config: str | Path, overrides: list[str], dump: Path, nproc: int = 1):
        from ray_titan.config import merge_overrides
        from ray_titan.driver import RunResult
        from tests.support.ranks import launch

        dump.mkdir(parents=True, exist_ok=True)
        proc = launch(["--config", str(config), *merge_overrides([f"--job.dump_folder={dump}"], overrides)], nproc,
                      cwd=REPO)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        (run_dir,) = (p.parents[1] for p in dump.glob("*/metrics/steps.parquet"))
        self.run_dir = run_dir
        self.tensorboard_dir = run_dir / "tb"
        self.errors = [line.removeprefix("metrics error: ") for line in proc.stdout.splitlines()
                       if line.startswith("metrics error: ")]
        self._result = RunResult(run_dir=run_dir, steps=None, final_loss=None)

    @property
    def steps(self):
        return self._result.steps

    def step_column(self, column: str) -> list:
        return self._result.step_column(column)


# Steps of the shared one-process Llama run: all in the main job's LR warm-up (20 steps), whose
# rates do not depend on the run's length, so they are the first steps of any run of that job.
LLAMA_ONE_WORKER_STEPS = 10


@pytest.fixture(scope="session")
def llama_one_worker(tmp_path_factory, corpus_cache) -> LaunchRun:
    """The README's main job (``configs/debug_llama.toml``: model, seed, data, batch) on one
    process without Ray, no PP, no FSDP, for ``LLAMA_ONE_WORKER_STEPS`` steps: the parity reference
    of the Ray runs of that job (``tests/integration/test_main_job.py``, ``tests/integration/test_multinode.py``),
    run once for the session."""
    return LaunchRun(REPO / "configs" / "debug_llama.toml", [
        "--job.name=llama_one_worker", f"--data.cache_dir={corpus_cache}", f"--training.steps={LLAMA_ONE_WORKER_STEPS}",
        "--metrics.log_freq=1000", "--memory.breakdown_step=0", "--parallelism.pp=1", "--parallelism.dp_shard=1",
    ], tmp_path_factory.mktemp("llama_one_worker"))


def _tier(item: pytest.Item) -> int:
    """0: the static checks (seconds), 1: the unit tier, 2: integration (processes, Ray)."""
    if item.get_closest_marker("static"):
        return 0
    return 2 if "integration" in item.path.parts or item.get_closest_marker("ray") else 1


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    # The README's one test command runs the tiers in order, so a lint error fails in seconds.
    items.sort(key=_tier)  # stable: each tier keeps its files' order


_STATIC_FAILED = pytest.StashKey[str]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.failed and _tier(item) == 0:
        item.session.stash[_STATIC_FAILED] = item.name
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    # Every static check runs; the first test after them stops the run if one failed.
    if _tier(item) > 0 and (failed := item.session.stash.get(_STATIC_FAILED, None)):
        item.session.shouldstop = f"a static check failed ({failed}): fix it before the tests run"
        return True
    return None
