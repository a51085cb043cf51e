"""The unit tier's promise, enforced: a unit test starts no process (no subprocess, fork, exec or
multiprocessing child; no Ray) — only pytest's own. A test that needs one belongs in
``tests/integration``. The static checks (marked ``static``) run tools as processes and are exempt."""

from __future__ import annotations

import multiprocessing.process
import sys
from pathlib import Path

import pytest

_EVENTS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec"}
_running: list[str] = []  # the unit test now running, if any


def _refuse(what: str) -> None:
    raise RuntimeError(f"{_running[0]} started a process ({what}): a unit test starts none; "
                       "move it to tests/integration")


def _audit(event: str, args: tuple) -> None:
    if _running and event in _EVENTS:
        _refuse(event)


sys.addaudithook(_audit)  # audit hooks cannot be removed: it is idle outside a unit test
_start = multiprocessing.process.BaseProcess.start


def _guarded_start(self: multiprocessing.process.BaseProcess) -> None:
    if _running:  # a forkserver's or spawn context's child starts without an audit event here
        _refuse("multiprocessing")
    _start(self)


multiprocessing.process.BaseProcess.start = _guarded_start  # type: ignore[method-assign]


_HERE = Path(__file__).parent


def _unit(item: pytest.Item) -> bool:
    # pytest calls runtest_protocol hooks of every conftest for every item: keep to this tier's.
    return _HERE in item.path.parents and not item.get_closest_marker("static")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _unit(item) and "ray_cluster" in getattr(item, "fixturenames", ()):
        pytest.fail(f"{item.nodeid} uses the Ray cluster: move it to tests/integration", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if not _unit(item):
        return (yield)
    _running.append(item.nodeid)
    try:
        return (yield)
    finally:
        _running.clear()
