"""The wheels a GPU node without network needs to run ray_titan's first-contact run
(``python -m benchmarks.run gpu``), built here, where the package index is reachable:

    python -m benchmarks.wheelhouse --out wheelhouse [--python-version 3.12]
        [--platform manylinux_2_28_x86_64] [--torch-only] [--torchtitan]

and installed there with ``python -m pip install --no-index --find-links wheelhouse -r wheelhouse/requirements.txt``.

- :data:`CORE`: what a GPU node as it ships (torch, numpy, pyarrow and the usual scientific
  Python preinstalled) lacks: pydantic with its three dependencies, tensorboardX, crc32c.
  pydantic is resolved with its dependencies (its ``pydantic-core`` pin is exact); the others
  are downloaded ``--no-deps``.
- ``--torch-only``: also :data:`TORCH_ONLY`, what the launcher path imports that an environment
  with torch alone lacks (found by running the CPU rehearsal in a venv holding only torch). pyarrow
  is most of its size.
- ``--torchtitan``: torchtitan 0.3.0 and its dependencies (:data:`TORCHTITAN`), listed and sized
  on their own, in ``<out>-torchtitan`` (measured: 68.5 MiB in 59 wheels, wandb, pandas and
  datasets among them: too large to travel with a 64 MiB command): the run's torchtitan stage
  says it is absent without them.

Every wheel is binary (``--only-binary=:all:``) for ``--python-version`` and ``--platform``
(pip also accepts older manylinux tags of the same architecture). Prints each side's size;
the folder travels with the run's command, so it must stay far under 64 MiB.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

__all__ = ["CORE", "TORCHTITAN", "TORCH_ONLY", "download", "main", "platform_tags"]

CORE = {"resolved": ["pydantic>=2.5"], "no_deps": ["tensorboardX>=2.6", "crc32c>=2.3"]}
"""Project dependencies a GPU node with torch and the usual scientific Python lacks."""
TORCH_ONLY = ["numpy>=1.24", "pyarrow>=14,<19", "protobuf>=3.20", "packaging", "tqdm>=4.60"]
"""Also imported on the launcher path and absent where only torch is installed (tensorboardX
needs numpy, protobuf and packaging; the metrics table needs pyarrow). pyarrow below 19: its
18.1 wheel is 38 MiB against 26.0's 52 MiB, which keeps this wheelhouse (56.6 MiB) under the
64 MiB a command may carry to a lent node; 18.1 ran the first GPU contact (2026-11-27)."""
TORCHTITAN = "torchtitan==0.3.0"
"""torchtitan's side: its dependency tree for the target, resolved by pip (``pip install
--dry-run --report``), less torch's own tree and what the project's side already holds."""


LEGACY = {"manylinux1": 5, "manylinux2010": 12, "manylinux2014": 17}


def platform_tags(tag: str) -> list[str]:
    """``tag`` and every older manylinux tag of its architecture (legacy aliases included), newest
    first: pip's ``--platform`` matches only the tags it is given. Other tags are returned alone."""
    import re

    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", tag) or re.fullmatch(r"(manylinux1|manylinux2010|manylinux2014)_(\w+)",
                                                                   tag)
    if m is None:
        return [tag]
    glibc, arch = (int(m.group(1)) if m.group(1).isdigit() else LEGACY[m.group(1)]), m.group(2)
    tags = [f"manylinux_2_{v}_{arch}" for v in range(glibc, 4, -1)]
    return tags + [f"{name}_{arch}" for name, v in LEGACY.items() if v <= glibc]


def _pip(dest: Path, specs: list[str], target: list[str], deps: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--dest", str(dest), "--quiet",
           *target, *([] if deps else ["--no-deps"]), *specs]
    subprocess.run(cmd, check=True)


def _resolve(specs: list[str], target: list[str]) -> dict[str, str]:
    """The packages (normalised name -> version) pip resolves for ``specs`` on ``target``, with
    nothing installed and nothing downloaded but metadata."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--only-binary=:all:", "--target", str(Path(tmp) / "t"), "--report", str(report),
                        *target, *specs], check=True)
        items = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in items}


def download(out: Path, python_version: str, platforms: list[str], torch_only: bool = False,
             torchtitan: bool = False) -> dict[str, int]:
    """Download the wheels into ``out`` (torchtitan's side into :func:`torchtitan_folder`), each
    folder with a ``requirements.txt`` naming its every wheel; returns each side's size in bytes.
    Raises ``subprocess.CalledProcessError`` when pip cannot find a wheel for the target."""
    abi = "cp" + python_version.replace(".", "")
    target = ["--python-version", python_version, "--implementation", "cp", "--abi", abi,
              *[f"--platform={t}" for p in platforms for t in platform_tags(p)]]
    out.mkdir(parents=True, exist_ok=True)
    _pip(out, CORE["resolved"], target, deps=True)
    _pip(out, CORE["no_deps"] + (TORCH_ONLY if torch_only else []), target, deps=False)
    sizes = {"project": _write_requirements(out, out / "requirements.txt")}
    if torchtitan:
        tree = _resolve([TORCHTITAN], target)
        have = set(_resolve([f"torch=={tree['torch']}"], target)) | {
            "-".join(w.name.split("-")[:1]).lower().replace("_", "-") for w in out.glob("*.whl")}
        side = torchtitan_folder(out)
        _pip(side, [f"{n}=={v}" for n, v in sorted(tree.items()) if n not in have], target, deps=False)
        sizes["torchtitan"] = _write_requirements(side, side / "requirements.txt")
    return sizes


def torchtitan_folder(out: Path) -> Path:
    """Where torchtitan's side goes: ``<out>-torchtitan``, beside the project's, so the project's
    folder can travel alone."""
    return out.with_name(out.name + "-torchtitan")


def _write_requirements(folder: Path, path: Path) -> int:
    """``path`` lists every wheel in ``folder`` pinned (name==version); returns their total bytes."""
    wheels = sorted(folder.glob("*.whl"))
    path.write_text("".join(f"{'=='.join(w.name.split('-')[:2])}\n" for w in wheels))
    return sum(w.stat().st_size for w in wheels)


def main(argv: list[str] | None = None) -> int:
    """Build the wheelhouse (module docstring) and print what it holds and its size."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.wheelhouse", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument("--platform", action="append", default=None,
                    help="a wheel platform tag (repeatable; default manylinux_2_28_x86_64)")
    ap.add_argument("--torch-only", action="store_true", help="also what an environment with only torch lacks")
    ap.add_argument("--torchtitan", action="store_true", help="also torchtitan 0.3.0's side, listed apart")
    a = ap.parse_args(argv)
    sizes = download(a.out, a.python_version, a.platform or ["manylinux_2_28_x86_64"], a.torch_only, a.torchtitan)
    for side, n in sizes.items():
        folder = a.out if side == "project" else torchtitan_folder(a.out)
        names = ", ".join(w.name for w in sorted(folder.glob("*.whl")))
        print(f"{side}: {n / 2**20:.1f} MiB in {len(list(folder.glob('*.whl')))} wheels: {names}")
    print(f"install on the node: python -m pip install --no-index --find-links {a.out} -r {a.out / 'requirements.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
