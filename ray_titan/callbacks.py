"""Worker-side callbacks: user code that runs inside the train loop on every worker.

A callback is an object with any of the methods below (subclass :class:`Callback` and override
what you need). It reaches the workers in one of two ways:

- the config: a ``[[callbacks]]`` table with ``target = "package.module:name"`` (a class with at
  least one of the event methods, importable on every worker) and optional ``kwargs``. The driver
  imports the target (running the module's code) and checks it without calling it; every worker
  imports and instantiates it: a config is code, treat it like a script;
- the driver API: ``ray_titan.train(cfg, callbacks=[MyCallback(...)])``: objects are pickled
  (cloudpickle) to every worker, so each worker gets its own copy.

Events, in order, on every rank:

==================  ===========================================================================
``on_train_start``  once, after the model, optimizer and data are built, before step 1
``on_step_begin``   before each step's data is fetched
``on_step_end``     after each step: optimizer and LR stepped, GC run, memory sampled; gets the
                    :class:`~ray_titan.metrics.worker.report.StepReport` about to be sent
``on_train_end``    once, after the last step (also when training failed: ``error`` is set)
==================  ===========================================================================

Each gets a :class:`CallbackContext` (rank, mesh coordinates, world size, device, run
directory, config). An exception raised by a callback fails the worker, and so the run.

:class:`InjectLeak` and :class:`InjectOOM` are fault injections for checking the memory verdict
and the out-of-memory handling on a real cluster (the tests use them).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ray_titan.config.schema import JobConfig
    from ray_titan.metrics.worker.report import StepReport

__all__ = ["EVENTS", "Callback", "CallbackContext", "CallbackList", "InjectLeak", "InjectOOM", "load_callback",
           "resolve_callback"]


@dataclass
class CallbackContext:
    """Where a callback runs: global ``rank``, ``coords`` on each mesh axis, ``world_size``,
    ``device``, ``run_dir`` (None when the loop runs without one) and the job ``config``."""

    rank: int
    coords: dict[str, int]
    world_size: int
    device: torch.device
    run_dir: Path | None
    config: JobConfig


class Callback:
    """Base class of worker-side callbacks; every event does nothing unless overridden."""

    def on_train_start(self, ctx: CallbackContext) -> None:
        pass

    def on_step_begin(self, ctx: CallbackContext, step: int) -> None:
        pass

    def on_step_end(self, ctx: CallbackContext, step: int, report: StepReport) -> None:
        pass

    def on_train_end(self, ctx: CallbackContext, error: BaseException | None = None) -> None:
        pass


EVENTS = ("on_train_start", "on_step_begin", "on_step_end", "on_train_end")
"""The callback events; a callback class must define at least one."""


def resolve_callback(target: str, kwargs: dict[str, Any] | None = None) -> type:
    """Import ``"package.module:name"`` and check, without calling anything, that it names a
    class with at least one of the :data:`EVENTS` methods that accepts ``kwargs``.

    Importing runs the module's top-level code (a config is code: treat it like a script), but a
    function such as ``os:system`` is refused here, never called. Raises ``ValueError`` naming the
    target for a malformed target, a failed import, a missing name, a target that is not such a
    class, or ``kwargs`` its constructor does not accept."""
    module, sep, name = target.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"callback target {target!r} is not of the form 'package.module:name'")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"callback target {target!r}: cannot import {module!r}: {e}") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"callback target {target!r}: {module!r} has no {name!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, type) or not any(callable(getattr(obj, e, None)) for e in EVENTS):
        what = "a class with no callback event" if isinstance(obj, type) else f"a {type(obj).__name__}, not a class"
        raise ValueError(
            f"callback target {target!r} is {what} (it is not called): give a class (e.g. a "
            f"ray_titan.callbacks.Callback subclass) defining at least one of {', '.join(EVENTS)}"
            + ("; factory functions are no longer accepted: wrap one in a class"
               if callable(obj) and not isinstance(obj, type) else "")
        )
    try:
        sig = inspect.signature(obj)
    except ValueError:  # no signature to inspect (a class implemented in C): the call checks the kwargs
        return obj
    params = sig.parameters
    unknown = [k for k in kwargs or {} if k not in params]
    problem = ""
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        problem = (f"unexpected keyword argument {', '.join(map(repr, unknown))}; it takes "
                   f"{', '.join(params) or 'no arguments'}")
    else:
        try:
            sig.bind(**(kwargs or {}))
        except TypeError as e:
            problem = str(e)
    if problem:
        raise ValueError(f"callback target {target!r} with kwargs {kwargs or {}}: TypeError: {problem}")
    return obj


def load_callback(target: str, kwargs: dict[str, Any] | None = None) -> Any:
    """Check ``target`` (:func:`resolve_callback`) and instantiate it with ``kwargs``: what each
    worker does. Raises ``ValueError`` naming the target for every refusal of
    :func:`resolve_callback` and for a constructor that fails."""
    cls = resolve_callback(target, kwargs)
    try:
        return cls(**(kwargs or {}))
    except Exception as e:
        raise ValueError(f"callback target {target!r} with kwargs {kwargs or {}}: {type(e).__name__}: {e}") from None


class CallbackList:
    """The callbacks of one worker, called in order; a callback lacking an event is skipped."""

    def __init__(self, callbacks: list[Any], ctx: CallbackContext):
        self.callbacks, self.ctx = list(callbacks), ctx

    def _call(self, event: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, event, None)
            if fn is not None:
                fn(self.ctx, *args)

    def on_train_start(self) -> None:
        self._call("on_train_start")

    def on_step_begin(self, step: int) -> None:
        self._call("on_step_begin", step)

    def on_step_end(self, step: int, report: StepReport) -> None:
        self._call("on_step_end", step, report)

    def on_train_end(self, error: BaseException | None = None) -> None:
        self._call("on_train_end", error)


class InjectLeak(Callback):
    """Retains ``mib_per_step`` MiB of host memory (touched, so resident) after every step from
    ``start_step`` on, on the ranks in ``ranks``: a leak of known rate for checking the verdict.

    On a CUDA worker with ``device=True`` it retains device memory instead."""

    def __init__(self, ranks: list[int], mib_per_step: float = 1.0, start_step: int = 1, device: bool = False):
        self.ranks, self.nbytes, self.start_step = set(ranks), int(mib_per_step * 2**20), start_step
        self.device = device
        self.kept: list[Any] = []

    def on_step_end(self, ctx: CallbackContext, step: int, report: StepReport) -> None:
        if ctx.rank not in self.ranks or step < self.start_step:
            return
        if self.device and ctx.device.type != "cpu":
            import torch

            self.kept.append(torch.ones(self.nbytes // 4, dtype=torch.float32, device=ctx.device))
        else:
            block = bytearray(self.nbytes)
            block[::4096] = b"\1" * len(block[::4096])  # touch every page: resident, not just mapped
            self.kept.append(block)


class InjectOOM(Callback):
    """Raises a simulated allocation failure on ``rank`` at step ``step``, for checking that an
    OOM leaves a snapshot and a clear error: ``torch.OutOfMemoryError``, or ``MemoryError`` (what
    a host allocation raises) with ``host=True``.

    ``where``: ``"step_begin"``, at the start of the step, outside the model; ``"forward"``, in the
    forward of the first decoder block (a module of a class named in :attr:`BLOCKS`) the rank
    runs in that step, so under PP inside the pipeline schedule; ``"backward"``, in the backward
    of that block's output. Raises ``ValueError`` for another ``where``.
    """

    BLOCKS = ("TransformerBlock", "MoEBlock")
    WHERE = ("step_begin", "forward", "backward")

    def __init__(self, rank: int, step: int, where: str = "step_begin", host: bool = False):
        if where not in self.WHERE:
            raise ValueError(f"InjectOOM: where = {where!r}; valid: {', '.join(map(repr, self.WHERE))}")
        self.rank, self.step, self.where, self.host = rank, step, where, host
        self._handle: Any = None

    def _error(self, rank: int) -> BaseException:
        import torch

        msg = f"simulated allocation failure: tried to allocate 2.00 GiB on rank {rank}"
        return MemoryError(msg) if self.host else torch.OutOfMemoryError(msg)

    def _remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def on_step_begin(self, ctx: CallbackContext, step: int) -> None:
        if ctx.rank != self.rank or step != self.step:
            return
        if self.where == "step_begin":
            raise self._error(ctx.rank)
        import torch
        from torch.nn.modules.module import register_module_forward_hook

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            # A global hook (the callback has no handle on the model): blocks by class name, which
            # FSDP's dynamic subclass keeps in its MRO.
            if not any(c.__name__ in self.BLOCKS for c in type(module).__mro__):
                return
            out = output[0] if isinstance(output, tuple) else output
            if self.where == "forward":
                self._remove()
                raise self._error(ctx.rank)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                self._remove()

                def fail(grad: torch.Tensor) -> None:
                    raise self._error(ctx.rank)

                out.register_hook(fail)

        self._handle = register_module_forward_hook(hook)

    def on_step_end(self, ctx: CallbackContext, step: int, report: StepReport) -> None:
        self._remove()

    def on_train_end(self, ctx: CallbackContext, error: BaseException | None = None) -> None:
        self._remove()
