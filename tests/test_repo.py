"""The repository's promises to a newcomer: README commands and CI run the same thing."""

from __future__ import annotations

import re

from tests.conftest import REPO


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readme_install_and_test_commands():
    readme = _bash_blocks((REPO / "README.md").read_text())
    test_cmd = next(b for b in readme if "pytest" in b)
    main_cmd = next(b for b in readme if "ray-titan train --config configs/debug_llama.toml" in b)
    assert main_cmd.startswith("pip install torch==2.13.0 && pip install -e .")
    ci_lines = [l for l in (REPO / ".ci" / "run").read_text().splitlines() if l and not l.startswith(("#", "set ", "cd "))]
    assert ci_lines == [test_cmd]


def test_layout():
    for d in ("ray_titan", "jobs", "configs", "tests", "docker"):
        assert (REPO / d).is_dir(), d
    assert (REPO / "jobs" / "train.py").is_file() and (REPO / "configs" / "debug_llama.toml").is_file()
