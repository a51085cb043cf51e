"""The configuration reference, generated from the config classes so it cannot drift.

:func:`reference_markdown` renders ``docs/configuration.md`` (every section of
:class:`~ray_titan.config.JobConfig`, every setting's type, constraints, default and
description); :func:`settings_help` the same settings as ``--section.key`` lines for
``ray-titan train --help``; :func:`to_toml` a resolved config as TOML (``ray-titan config show``).
Descriptions are the attribute docstrings in ``ray_titan/config/schema.py`` (pydantic
``use_attribute_docstrings``). Regenerate the committed reference with
``ray-titan config docs --output docs/configuration.md``.
"""

from __future__ import annotations

import json
import math
import textwrap
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from ray_titan.config.schema import JobConfig

__all__ = ["reference_markdown", "sections", "settings_help", "to_toml"]

DOC_PATH = "docs/configuration.md"
REGENERATE = f"ray-titan config docs --output {DOC_PATH}"


def sections() -> list[tuple[str, type[BaseModel]]]:
    """``(section name, section class)`` of the ``[section]`` tables, in :class:`JobConfig` order."""
    return [(name, f.annotation) for name, f in JobConfig.model_fields.items()
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)]


def array_sections() -> list[tuple[str, type[BaseModel]]]:
    """``(name, item class)`` of the ``[[name]]`` arrays of tables (e.g. ``callbacks``)."""
    out = []
    for name, f in JobConfig.model_fields.items():
        args = get_args(f.annotation)
        if get_origin(f.annotation) is list and args and issubclass(args[0], BaseModel):
            out.append((name, args[0]))
    return out


def _type_name(ann: Any) -> str:
    origin = get_origin(ann)
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in get_args(ann))
    if origin in (Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in get_args(ann))
    if ann is type(None):
        return "unset"
    return getattr(ann, "__name__", str(ann))


def _constraints(field: FieldInfo) -> str:
    ops = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    out = []
    for m in field.metadata:
        for attr, op in ops.items():
            if getattr(m, attr, None) is not None:
                out.append(f"{op} {getattr(m, attr)}")
    return ", ".join(out)


def toml_value(v: Any) -> str:
    """A Python value as a TOML literal (str, bool, int, float, list)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else "nan" if math.isnan(v) else repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(v, dict):
        # TOML has no null: an unset entry of an inline table is left out.
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items() if x is not None) + "}"
    return str(v)


def _default(field: FieldInfo) -> Any:
    return field.get_default(call_default_factory=True)


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def reference_markdown() -> str:
    """``docs/configuration.md``: one table per section, in :class:`JobConfig` order."""
    out = [
        "# Configuration reference",
        "",
        f"Generated from `ray_titan/config/schema.py` by `{REGENERATE}`; do not edit by hand",
        "(`tests/integration/test_cli.py` fails when this file and the config classes disagree).",
        "",
        "A job config is a TOML file with one table per section below; any setting can be",
        "overridden on the command line as `--section.key=value` (the value is read as TOML).",
        "`ray-titan config show CONFIG [overrides]` prints a resolved config with every default.",
        "Unknown settings and wrong types are errors. *unset* means the setting has no value",
        "(TOML has no null: leave it out).",
        "",
    ]
    for name, cls in sections():
        out += [f"## `[{name}]`", "", _one_line(cls.__doc__), "",
                "| setting | type | default | description |", "|---|---|---|---|"]
        for key, f in cls.model_fields.items():
            typ = _type_name(f.annotation)
            if c := _constraints(f):
                typ += f", {c}"
            default = _default(f)
            shown = "*unset*" if default is None else f"`{toml_value(default)}`"
            desc = _one_line(f.description).replace("|", "\\|")
            out.append(f"| `{key}` | {typ} | {shown} | {desc} |")
        out.append("")
    for name, cls in array_sections():
        out += [f"## `[[{name}]]`", "", _one_line(JobConfig.model_fields[name].description),
                "Each `[[" + name + "]]` table (config file only, no command-line override):", "",
                "| setting | type | default | description |", "|---|---|---|---|"]
        for key, f in cls.model_fields.items():
            default = _default(f)
            shown = "*required*" if f.is_required() else f"`{toml_value(default)}`"
            desc = _one_line(f.description).replace("|", "\\|")
            out.append(f"| `{key}` | {_type_name(f.annotation)} | {shown} | {desc} |")
        out.append("")
    return "\n".join(out)


def settings_help() -> str:
    """Every setting as ``--section.key=VALUE (default)  description`` lines, for ``--help``."""
    lines = []
    for name, cls in sections():
        lines.append(f"[{name}] {_one_line(cls.__doc__)}")
        for key, f in cls.model_fields.items():
            default = _default(f)
            shown = "unset" if default is None else toml_value(default)
            lines.append(f"  --{name}.{key}  ({_type_name(f.annotation).replace(chr(92), '')}; default {shown})")
            lines += textwrap.wrap(_one_line(f.description), 96, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def to_toml(cfg: JobConfig) -> str:
    """The whole resolved config as TOML that :func:`ray_titan.config.load_config` reads back to
    the same config; unset settings appear as comments."""
    out = []
    for name, _ in sections():
        out.append(f"[{name}]")
        for key, value in getattr(cfg, name).model_dump().items():
            out.append(f"# {key} = (unset)" if value is None else f"{key} = {toml_value(value)}")
        out.append("")
    for name, _ in array_sections():
        for item in getattr(cfg, name):
            out.append(f"[[{name}]]")
            out += [f"{k} = {toml_value(v)}" for k, v in item.model_dump().items() if v is not None]
            out.append("")
    return "\n".join(out)
