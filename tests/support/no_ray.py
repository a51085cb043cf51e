"""ray_titan where Ray is not installed, as on a GPU node as it ships (issue 39).

:func:`no_ray_env` writes a ``sitecustomize.py`` that every Python process started with the
returned environment runs first (torchrun's ranks and the dry run's simulator included, as they
inherit ``PYTHONPATH``): ``sys.modules["ray"] = None``, so ``import ray`` raises ImportError and
``importlib.util.find_spec("ray")`` answers None as where Ray is absent, and every ``import ray``
statement that is even attempted (one a ``try`` swallows included) is appended with its stack to
the log that :func:`ray_imports` reads.

``python -m tests.support.no_ray SPEC.json`` runs, in this one process (one interpreter and torch
import for all), each ``[entry, argv]`` of SPEC in turn: ``launch`` is
``python -m ray_titan.launch``'s :func:`ray_titan.launch.torchrun.main`, ``cli`` is ``ray-titan``'s
:func:`ray_titan.cli.main`; an argument ``glob:PATTERN`` stands for the one path matching it
when its run starts (a run directory an earlier run made). After each it prints
``no_ray: exit <code>`` on stdout and stderr.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

__all__ = ["no_ray_env", "ray_imports", "split_runs"]

_SITECUSTOMIZE = '''\
import builtins, os, sys, traceback

sys.modules["ray"] = None  # as if not installed: import raises, find_spec answers None
_log, _import = os.environ["RT_RAY_IMPORT_LOG"], builtins.__import__


def _recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and (name == "ray" or name.startswith("ray.")):
        with open(_log, "a") as f:
            f.write(f"import {name} (pid {os.getpid()}):\\n" + "".join(traceback.format_stack(limit=8)))
    return _import(name, globals, locals, fromlist, level)


builtins.__import__ = _recording_import
'''

_REPO = Path(__file__).resolve().parents[2]


def no_ray_env(directory: Path) -> dict[str, str]:
    """This process's environment for a child that cannot import Ray (module docstring): the
    ``sitecustomize.py`` written to ``directory / "no_ray_site"``, first on ``PYTHONPATH`` before
    the repository; ``RT_RAY_IMPORT_LOG`` (``directory / "ray_imports.log"``, empty);
    ``OMP_NUM_THREADS=1``."""
    site = directory / "no_ray_site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    log = directory / "ray_imports.log"
    log.write_text("")
    path = os.pathsep.join(p for p in (str(site), str(_REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "RT_RAY_IMPORT_LOG": str(log), "OMP_NUM_THREADS": "1"}


def ray_imports(env: dict[str, str]) -> str:
    """Every ``import ray...`` attempted so far by the processes of ``env`` (:func:`no_ray_env`),
    with their stacks; empty when none was."""
    return Path(env["RT_RAY_IMPORT_LOG"]).read_text()


def split_runs(text: str) -> list[tuple[int, str]]:
    """The ``(exit code, output)`` of each run of ``python -m tests.support.no_ray``, in order,
    from its stdout or stderr."""
    runs, chunk = [], []
    for line in text.splitlines():
        if line.startswith("no_ray: exit "):
            runs.append((int(line.removeprefix("no_ray: exit ")), "\n".join(chunk)))
            chunk = []
        else:
            chunk.append(line)
    return runs


def _expand(arg: str) -> str:
    """``glob:PATTERN`` → the one path matching PATTERN now (a run directory named at run time)."""
    if not arg.startswith("glob:"):
        return arg
    pattern = Path(arg.removeprefix("glob:"))
    (match,) = pattern.parent.glob(pattern.name)
    return str(match)


def _run(entry: str, argv: list[str]) -> int:
    """One run of ``entry`` (``launch`` or ``cli``) on ``argv``; its exit status as the interpreter's."""
    try:
        argv = [_expand(a) for a in argv]
        if entry == "launch":
            from ray_titan.launch.torchrun import main

            main(argv)
            return 0
        from ray_titan.cli import main as cli

        return cli(argv)
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except Exception:  # the next runs go on; the test names this one
        traceback.print_exc()
        return 1


def main(spec_path: str) -> None:
    for entry, argv in json.loads(Path(spec_path).read_text()):
        code = _run(entry, argv)
        for stream in (sys.stdout, sys.stderr):
            print(f"no_ray: exit {code}", file=stream, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
