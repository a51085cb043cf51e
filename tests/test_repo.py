"""The repository's promises: README commands and CI run the same thing, and the code keeps its
import contracts, lint and types."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readme_install_and_test_commands():
    readme = _bash_blocks((REPO / "README.md").read_text())
    test_cmd = next(b for b in readme if "pytest" in b)
    main_cmd = next(b for b in readme if "ray-titan train --config configs/debug_llama.toml" in b)
    assert main_cmd.startswith("pip install torch==2.13.0 && pip install -e .")
    ci_lines = [
        ln for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith(("#", "set ", "cd "))
    ]
    assert ci_lines == [test_cmd]


def test_layout():
    for d in ("ray_titan", "jobs", "configs", "tests", "docker"):
        assert (REPO / d).is_dir(), d
    assert (REPO / "jobs" / "train.py").is_file() and (REPO / "configs" / "debug_llama.toml").is_file()


def _check(*cmd: str) -> None:
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-6000:]}\n{out.stderr[-3000:]}"


def test_import_contracts():
    """Layers, no cycles at any depth, models free of parallelism (pyproject.toml [tool.importlinter])."""
    _check(sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports())")


def test_ruff_lint_and_import_order():
    _check(sys.executable, "-m", "ruff", "check", ".")


def test_mypy():
    _check(sys.executable, "-m", "mypy")
