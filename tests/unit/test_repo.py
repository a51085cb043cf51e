"""The repository's promises: README commands and CI run the same thing, and the code keeps its
import contracts, lint and types."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

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
    # Then the compatibility job: the declared range's ends, in venvs of their own (DEVELOPERS.md).
    assert ci_lines == [test_cmd, "bash .ci/compat"]


def test_layout():
    for d in ("ray_titan", "jobs", "configs", "tests", "docker"):
        assert (REPO / d).is_dir(), d
    assert (REPO / "jobs" / "train.py").is_file() and (REPO / "configs" / "debug_llama.toml").is_file()


def test_test_modules_have_unique_names():
    """pytest imports test modules by basename (no packages under tests/): two files of one name in
    tests/unit and tests/integration stop the whole collection ("import file mismatch")."""
    seen: dict[str, str] = {}
    for f in sorted((REPO / "tests").rglob("test_*.py")):
        rel = str(f.relative_to(REPO))
        assert f.name not in seen, f"{rel} and {seen[f.name]} share a name; rename one"
        seen[f.name] = rel


# The static checks: the tests below, the pre-commit hooks (.pre-commit-config.yaml) and CI's first
# tier run these commands.
STATIC_CHECKS = {
    "ruff": ("python", "-m", "ruff", "check", "."),  # lint and import order
    "mypy": ("python", "-m", "mypy"),  # settings in pyproject.toml
    "import-linter": ("lint-imports",),  # layers, no cycles at any depth, models free of parallelism
}


def _check(name: str) -> None:
    cmd = STATIC_CHECKS[name]
    if cmd[0] == "python":
        cmd = (sys.executable, *cmd[1:])
    else:  # a console script of this environment
        cmd = (sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports())")
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-6000:]}\n{out.stderr[-3000:]}"


@pytest.mark.static
@pytest.mark.parametrize("name", list(STATIC_CHECKS))
def test_static_check(name: str) -> None:
    _check(name)


def test_pre_commit_runs_the_static_checks():
    import yaml

    hooks = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())["repos"][0]["hooks"]
    assert {h["id"]: tuple(h["entry"].split()) for h in hooks} == STATIC_CHECKS
    assert all(h["language"] == "system" and h["pass_filenames"] is False for h in hooks)


# Links: every relative link and image in the docs, every repository path a doc names in its text,
# and every docs/ path or design citation in code, points at something that exists.
DOC_FILES = ("README.md", "DEVELOPERS.md", "docker/README.md", "docs/**/*.md", "benchmarks/**/*.md")
_FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
_REPO_PATH = re.compile(r"(?<![\w./<-])((?:ray_titan|tests|benchmarks|configs|docker|jobs|docs)/[\w./-]*[\w/])")
_DESIGN_CITE = re.compile(r"design\.md\)?,? (?:lesson (\d+)|([A-Z][a-z]+)\b)")
_OLD_DESIGN = "DESIGN" + ".md"  # the design document before docs/design.md; not in this repository


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(md: str) -> set[str]:
    anchors, seen = set(), {}  # a repeated heading's anchors are slug, slug-1, slug-2, ...
    for heading in re.findall(r"^#{1,6} (.+)$", _FENCE.sub("", md), flags=re.M):
        slug = _slug(heading)
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _design_citations_missing(text: str, design: str) -> list[str]:
    anchors, lessons = _anchors(design), set(re.findall(r"^### (\d+)\. ", design, flags=re.M))
    missing = []
    for lesson, section in _DESIGN_CITE.findall(text):
        if lesson and lesson not in lessons:
            missing.append(f"design.md lesson {lesson}")
        elif section and _slug(section) not in anchors and not any(a.startswith(_slug(section)) for a in anchors):
            missing.append(f"design.md section {section}")
    return missing


def broken_links(root, files) -> list[str]:
    """Every broken reference in the Markdown ``files`` (paths relative to ``root``): a relative
    link or image whose file is missing, an ``#anchor`` with no such heading, a repository path
    named in the text (``ray_titan/...``, ``tests/...``, ``docs/...``) that does not exist, the old
    design document's name, and a ``design.md`` lesson or section that is not there."""
    design = (root / "docs" / "design.md").read_text() if (root / "docs" / "design.md").is_file() else ""
    broken = []
    for rel in files:
        path = root / rel
        text = path.read_text()
        prose = _FENCE.sub("", text)
        for target in _LINK.findall(prose):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{rel}: link {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                broken.append(f"{rel}: link {target}: no heading #{anchor} in {dest.name}")
        for named in _REPO_PATH.findall(text):  # a file (has a suffix) or a folder (ends in /)
            if re.search(r"(\.\w+|/)$", named) and not (root / named).exists():
                broken.append(f"{rel}: names {named}, which does not exist")
        if _OLD_DESIGN in text:
            broken.append(f"{rel}: names {_OLD_DESIGN}; the design is docs/design.md")
        broken += [f"{rel}: cites {m}, not in docs/design.md" for m in _design_citations_missing(text, design)]
    return broken


def test_doc_links_point_at_files_and_headings_that_exist():
    files = sorted({str(p.relative_to(REPO)) for pattern in DOC_FILES for p in REPO.glob(pattern)})
    assert "docs/design.md" in files and "README.md" in files and "benchmarks/results/README.md" in files
    assert broken_links(REPO, files) == []


def test_code_names_only_docs_that_exist():
    """Docstrings and comments cite docs/... pages and design.md lessons that exist."""
    design = (REPO / "docs" / "design.md").read_text()
    broken = []
    for pattern in ("ray_titan/**/*.py", "tests/**/*.py", "benchmarks/**/*.py", "jobs/**/*.py", "configs/*.toml",
                    "pyproject.toml", "docker/*"):
        for path in REPO.glob(pattern):
            if not path.is_file() or path.name == "test_repo.py":
                continue
            rel, text = path.relative_to(REPO), path.read_text()
            broken += [f"{rel}: names {d}" for d in re.findall(r"\bdocs/[\w./-]*\w", text) if not (REPO / d).exists()]
            broken += [f"{rel}: names {_OLD_DESIGN}" for _ in re.findall(re.escape(_OLD_DESIGN), text)]
            broken += [f"{rel}: cites {m}" for m in _design_citations_missing(text, design)]
    assert broken == []


def test_link_check_catches_what_is_broken(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("# Design\n\n### 1. One\n\n## Contracts\n")
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n\n## Some `code`, here\n\n[ok](#some-code-here) [ok](design.md#contracts) [gone](b.md)"
        " [bad anchor](design.md#nowhere) ![img](images/x.png) see `ray_titan/nowhere.py` and "
        f"{_OLD_DESIGN}; docs/design.md, lesson 1; docs/design.md, lesson 9; docs/design.md, Testing\n"
        "```\n[in code](ignored.md)\n```\n"
    )
    assert broken_links(tmp_path, ["docs/a.md"]) == [
        "docs/a.md: link b.md: no such file",
        "docs/a.md: link design.md#nowhere: no heading #nowhere in design.md",
        "docs/a.md: link images/x.png: no such file",
        "docs/a.md: names ray_titan/nowhere.py, which does not exist",
        f"docs/a.md: names {_OLD_DESIGN}; the design is docs/design.md",
        "docs/a.md: cites design.md lesson 9, not in docs/design.md",
        "docs/a.md: cites design.md section Testing, not in docs/design.md",
    ]


def test_a_unit_test_starts_no_process():
    """The unit tier's guard (tests/unit/conftest.py) refuses a subprocess and a multiprocessing child."""
    import multiprocessing

    with pytest.raises(RuntimeError, match="move it to tests/integration"):
        subprocess.run(["true"])
    with pytest.raises(RuntimeError, match="move it to tests/integration"):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_every_function_reads_in_one_screen():
    """Every function of the ``ray_titan`` package is at most 80 lines, docstring included, so
    each reads top to bottom."""
    import ast

    files = sorted((REPO / "ray_titan").rglob("*.py"))
    long = {f"{f.relative_to(REPO).as_posix()}::{n.name}": n.end_lineno - n.lineno + 1
            for f in files for n in ast.walk(ast.parse(f.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80}
    assert len(files) > 100 and "ray_titan/driver/run.py" in {f.relative_to(REPO).as_posix() for f in files}
    assert long == {}, long
