"""The model families have one home, the registry (``ray_titan.models.registry.FAMILIES``, each
family's ``SPEC`` in its own package); what cannot import it (the config schema, the import
contract, the docs) is checked against it here. How to add a family: ``ray_titan.models``."""

from __future__ import annotations

import importlib
import pkgutil
import re
import tomllib
from typing import get_args

import pytest

import ray_titan.models
from ray_titan.config.schema import Model
from ray_titan.models.registry import FAMILIES, MODELS, _collect
from ray_titan.models.spec import ModelSpec
from tests.conftest import REPO


def test_each_family_registers_its_own_spec():
    assert list(MODELS) == list(FAMILIES)
    for family in FAMILIES:
        spec = importlib.import_module(f"ray_titan.models.{family}").SPEC
        assert isinstance(spec, ModelSpec) and spec.name == family and MODELS[family] is spec
        assert "debug" in spec.flavors, f"{family} has no debug flavor"


def test_every_family_package_is_registered():
    packages = {m.name for m in pkgutil.iter_modules(ray_titan.models.__path__) if m.ispkg}
    assert packages == set(FAMILIES), "a package under ray_titan/models/ is a family: list it in FAMILIES"


def test_the_registry_refuses_a_spec_not_named_as_its_package(monkeypatch):
    monkeypatch.setattr(ray_titan.models.qwen3, "SPEC", MODELS["llama"])
    with pytest.raises(TypeError, match=r"ray_titan\.models\.qwen3\.SPEC must be a ModelSpec named 'qwen3'; it is "
                                        r"'llama'"):
        _collect(("llama", "qwen3"))
    monkeypatch.delattr(ray_titan.models.qwen3, "SPEC")
    with pytest.raises(TypeError, match=r"SPEC must be a ModelSpec named 'qwen3'; it is None"):
        _collect(("qwen3",))


def test_the_config_schema_lists_the_registered_families():
    """``model.name``'s ``Literal`` (the schema imports nothing of the project) is ``FAMILIES``, in
    its order (docs/configuration.md shows it)."""
    assert get_args(Model.model_fields["name"].annotation) == FAMILIES
    assert Model().name in FAMILIES


def _model_modules() -> set[str]:
    """Every module of ``ray_titan.models``, packages (``__init__``) left out."""
    return {m.name for m in pkgutil.walk_packages(ray_titan.models.__path__, "ray_titan.models.") if not m.ispkg}


def test_the_import_contract_lists_every_model_module_but_the_parallelize_steps():
    """Every module of every registered family but its ``parallelize`` (and ``__init__``, which
    imports it), and the shared ones but the registry and the spec (which name the parallelize
    step's type), are held to "Models know nothing of parallelism" (pyproject.toml)."""
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = (c for c in contracts if c["name"].startswith("Models know nothing of parallelism"))
    listed = set(contract["source_modules"])
    shared_exempt = ("ray_titan.models.registry", "ray_titan.models.spec")
    expected = {m for m in _model_modules() if m.rsplit(".", 1)[1] != "parallelize" and m not in shared_exempt}
    assert {f"ray_titan.models.{f}.model" for f in ("llama", "deepseek_v2")} <= expected
    assert sorted(expected - listed) == [], "add these to the contract's source_modules"
    assert sorted(listed - expected) == [], "these are not modules of ray_titan.models (or are parallelize steps)"


def _table(md: str, heading: str, first_column: str) -> list[list[str]]:
    """The rows (cells) of the Markdown table under ``heading`` whose first header cell is
    ``first_column`` (the first such table after the heading)."""
    section = md.split(f"\n{heading}\n", 1)[1]
    lines = section.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first_column} |"))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return rows


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_the_readme_model_tables_are_the_registry():
    """The README's model table: one row per registered family, in ``FAMILIES``' order, with the
    ``model_type`` values its adapter reads; the flavor table (docs/huggingface.md, which the
    README links): every flavor but ``debug``."""
    readme = (REPO / "README.md").read_text()
    families = _table(readme, "## Models", "`model.name` | architecture")
    assert [_ticked(r[0]) for r in families] == [[f] for f in FAMILIES]
    for row in families:
        hf = MODELS[_ticked(row[0])[0]].hf
        assert _ticked(row[2]) == [hf.model_type, *hf.model_type_aliases], row[0]
    guide = (REPO / "docs" / "huggingface.md").read_text()
    flavors = _table(guide, "## Flavors: sizes against the model cards", "`model.name` | `model.flavor`")
    listed = {(_ticked(r[0])[0], f) for r in flavors for f in _ticked(r[1])}
    assert listed == {(n, f) for n, s in MODELS.items() for f in s.flavors if f != "debug"}


def test_the_docs_name_every_family():
    """docs/huggingface.md's opening paragraph names every ``model_type`` a family reads; the
    layout of docs/design.md every family's package."""
    opening = (REPO / "docs" / "huggingface.md").read_text().split("\n\n")[1]
    named = set(re.findall(r'`(?:model_type = ")?(\w+)"?`', opening))
    assert {t for s in MODELS.values() for t in (s.hf.model_type, *s.hf.model_type_aliases)} <= named
    design = (REPO / "docs" / "design.md").read_text()
    layout = design[design.index("ray_titan/models/  "):].split("\nray_titan/parallel/", 1)[0]
    assert [f for f in FAMILIES if f"{f}/" not in layout] == []
