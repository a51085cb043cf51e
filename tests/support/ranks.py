"""``python -m ray_titan.launch`` without an interpreter start per process: each rank is a child of
one forkserver that imported torch and ray_titan once for the test session, with the environment
torchrun gives its ranks (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), running :func:`ray_titan.launch.torchrun.main` on the same arguments. The launcher's code
path is unchanged; what is saved is ~4 CPU-seconds of imports per process (on 2 cores, a 4-rank
launch took ~8 s more before its first step).

Tests about the ``torchrun`` and ``python -m`` entry points themselves (``tests/integration/test_train_loop.py``,
``tests/integration/test_cli.py``) start real processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Launched", "forkserver", "free_port", "join_all", "launch", "rendezvous_store"]

_PRELOAD = ["ray_titan.launch", "ray_titan.trainer", "tests.support.ranks"]


def forkserver() -> mp.context.ForkServerContext:
    """The session's forkserver context, preloading torch and ray_titan (the first caller's
    environment is the server's; each child sets its own)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (for a rendezvous or a server started a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def rendezvous_store() -> Iterator[dict[str, str]]:
    """A TCPStore hosted by this process on a port the OS picks, as torchrun's agent hosts it;
    yields the environment (``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE``)
    that makes every rank's ``env://`` or ``tcp://`` rendezvous a client of it. No rank binds a
    port, so none picked earlier by :func:`free_port` can be taken by another process meanwhile
    (a Ray node starting beside the test) and hang the launch."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store


def join_all(procs: list[mp.process.BaseProcess], timeout: float) -> None:
    """Wait for every process, ``timeout`` seconds in all; kill those still running then (a hung
    collective must fail the test, not leave its ranks behind)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


@dataclass
class Launched:
    """A finished launch: every rank's exit code and rank 0's output (stdout and stderr)."""

    returncodes: list[int | None]
    stdout: str
    stderr: str

    @property
    def returncode(self) -> int:
        """0 when every rank exited 0, else the first other code (-9 for a rank killed on timeout)."""
        return next((c if c is not None else -9 for c in self.returncodes if c != 0), 0)


def _rank(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    with open(out, "w") as o, open(err, "w") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.update(env)
    os.chdir(cwd)
    code = 0
    try:
        from ray_titan.launch.torchrun import main

        main(argv)
    except SystemExit as e:  # as the interpreter reports it
        if e.code not in (None, 0):
            if not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch(argv: list[str], nproc: int = 1, cwd: str | Path = ".", env: dict[str, str] | None = None,
           timeout: float = 600) -> Launched:
    """Run the launcher on ``nproc`` ranks (one process without torchrun's variables when 1),
    ``OMP_NUM_THREADS=1`` and ``env`` added to each one's environment; wait at most ``timeout``
    seconds (then kill the ranks left)."""
    ctx = forkserver()
    logs = Path(tempfile.mkdtemp(prefix="rt_launch_"))
    outs = [(str(logs / f"rank{r}.out"), str(logs / f"rank{r}.err")) for r in range(nproc)]
    procs = []
    try:
        with rendezvous_store() as store_env:
            for r in range(nproc):
                rank_env = {"OMP_NUM_THREADS": "1", **(env or {})}
                if nproc > 1:
                    rank_env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc),
                                    LOCAL_WORLD_SIZE=str(nproc), **store_env)
                p = ctx.Process(target=_rank, args=(list(argv), rank_env, str(cwd), *outs[r]))
                p.start()
                procs.append(p)
            join_all(procs, timeout)
        texts = [(Path(o).read_text(), Path(e).read_text()) for o, e in outs]
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    errs = "".join(f"[rank {r}] {e}" if nproc > 1 else e for r, (_, e) in enumerate(texts) if e)
    return Launched([p.exitcode for p in procs], texts[0][0], errs)
