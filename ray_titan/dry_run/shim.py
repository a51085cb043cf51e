"""The fake CUDA device of the dry run, on any torch build, built on first use.

A CPU build of PyTorch registers no device guard and no CUDA hooks, so tensors cannot be made
on ``cuda`` at all, even fake ones; a CUDA build on a machine without a GPU (or driver) has
them, but its guard and hooks call the CUDA runtime, which fails ("CUDA driver version is
insufficient"). This module compiles a small C++ library (with the compiler
``torch.utils.cpp_extension`` uses) that registers c10's ``FakeGuardImpl`` for CUDA and a
``CUDAHooksInterface`` answering "available, 8 devices" (at a priority above a CUDA build's own
hooks); loaded with ``ctypes`` *before* ``import torch`` (its static initialisers run then, so
torch's first look at CUDA finds them), then ``rt_fake_cuda_install()`` called after it (a CUDA
build registers its real guard on import), the process has a CUDA device that holds only fake
tensors (``FakeTensorMode``). The library is cached per torch build, Python and source under
``~/.cache/ray_titan/fake_cuda`` (:func:`cache_dir`); where it cannot be built, a CUDA build
with a usable GPU runs on the real runtime instead (:func:`choose_device`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["ShimError", "build_shim", "cache_dir", "choose_device"]

SOURCE = r"""
#include <c10/core/impl/FakeGuardImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <ATen/detail/CUDAHooksInterface.h>
namespace c10 { namespace impl {
C10_REGISTER_GUARD_IMPL(CUDA, FakeGuardImpl<DeviceType::CUDA>);
}}
namespace at {
// Registered under the key torch's own CUDA build uses, so getCUDAHooks() creates this one; at
// a higher priority than a CUDA build's own hooks, which then skip their registration.
struct FakeCUDAHooks : public CUDAHooksInterface {
  explicit FakeCUDAHooks(CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  int getNumGPUs() const override { return 8; }
  DeviceIndex deviceCount() const override { return 8; }
  DeviceIndex current_device() const override { return 0; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(DeviceIndex) const override {}
};
C10_REGISTER_CLASS_WITH_PRIORITY(CUDAHooksRegistry, CUDAHooks, c10::REGISTRY_PREFERRED, FakeCUDAHooks);
}
// A CUDA build registers its own device guard when torch is imported, after this library's
// static initialisers: the simulation calls this after ``import torch`` to put the fake one back.
extern "C" void rt_fake_cuda_install() {
  static c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> guard;
  c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)].store(&guard);
}
"""


class ShimError(RuntimeError):
    """The simulated CUDA device cannot be had here (no C++ compiler, the build failed, a torch
    build it does not support); the message says why and what would work."""


def cache_dir() -> Path:
    """Where the library is kept: ``$RAY_TITAN_CACHE`` or ``~/.cache/ray_titan``, then
    ``fake_cuda/torch-<version>-<git commit>-<python tag>-<source hash>``: one per torch build
    (a CPU and a CUDA wheel of one version differ in ``+cpu``/``+cu130``), per Python (the
    library links the interpreter's ``libtorch_python``) and per shim source."""
    import hashlib
    import sys

    import torch

    root = Path(os.environ.get("RAY_TITAN_CACHE", Path.home() / ".cache" / "ray_titan"))
    commit = (getattr(torch.version, "git_version", None) or "unknown")[:12]
    source = hashlib.sha256(SOURCE.encode()).hexdigest()[:12]
    key = f"torch-{torch.__version__.replace('+', '_')}-{commit}-{sys.implementation.cache_tag}-{source}"
    return root / "fake_cuda" / key


def choose_device(*, cuda_built: bool, rocm: bool, cannot_build: str | None, gpu: Callable[[], bool]) -> str:
    """How a rank gets its simulated CUDA device: ``"shim"`` (the fake CUDA library, on any CPU or
    CUDA build, with or without a GPU) or ``"gpu"`` (no library: a CUDA build's real runtime, only
    where the library cannot be built and a GPU is usable). ``cannot_build``: why the library
    cannot be built here, None if it can; ``gpu``: whether torch finds a usable GPU (asked only
    when needed: without a driver it warns). Raises :class:`ShimError` (one line: why, what
    would work) where neither is possible, and on a ROCm build without a GPU (its HIP device is
    registered as CUDA, which the library does not replace)."""
    if rocm:
        if gpu():
            return "gpu"
        raise ShimError("a ROCm build of torch without a usable GPU cannot simulate a CUDA device: "
                        "run the dry run with a CPU or CUDA build of torch")
    if cannot_build is None:
        return "shim"
    if cuda_built and gpu():
        return "gpu"
    where = "this CUDA build of torch finds no usable GPU, and " if cuda_built else ""
    raise ShimError(f"{where}{cannot_build}")


def _cannot_build() -> str | None:
    """Why the library cannot be built here (no compiler, no ninja), None if it can be. Looked up
    on PATH as torch's extension builder does, without importing it (on a CUDA build without a
    CUDA toolkit its import logs a warning, noise before the line saying what is missing)."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return (f"the simulated CUDA device needs a C++ compiler to build once ({compiler!r}, from $CXX or the "
                "default c++, is not on PATH): install g++ (or set CXX)")
    if shutil.which("ninja") is None:
        return "the simulated CUDA device is built with ninja, which is not installed: pip install ninja"
    return None


def _gpu_usable() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def build_shim() -> Path | None:
    """The path of the fake CUDA library, built if not cached (a few seconds); None where a GPU
    stands in (:func:`choose_device`). A cached library is used only if it matches the checksum
    written after its build finished (a build killed half way, or a file damaged since, is rebuilt);
    builds of one cache directory take turns on an ``flock`` the kernel releases when its builder
    dies, so a killed build never blocks the next. Raises :class:`ShimError` when neither library
    nor GPU is possible (naming the compiler ``torch.utils.cpp_extension`` looks for, or ninja),
    when the build fails (its output), or when the cache cannot be written (the path, and
    ``RAY_TITAN_CACHE`` to put it elsewhere)."""
    import torch

    lib = cache_dir() / "rt_fake_cuda.so"
    missing = None if _complete(lib) else _cannot_build()
    how = choose_device(cuda_built=torch.backends.cuda.is_built(), rocm=getattr(torch.version, "hip", None) is not None,
                        cannot_build=missing, gpu=_gpu_usable)
    if how == "gpu":
        return None
    if _complete(lib):
        return lib
    try:
        with _build_lock(lib.parent):
            if not _complete(lib):  # another process may have built it while this one waited
                _clear_build(lib.parent)
                _compile(lib.parent)
                if not lib.is_file():
                    raise ShimError(f"building the simulated CUDA device left no {lib}")
                _checksum_file(lib).write_text(_checksum(lib))
    except OSError as e:  # a read-only or full cache: one line, not a traceback
        where = e.filename or lib.parent
        raise ShimError(f"cannot build the simulated CUDA device in {where}: {e.strerror or e}; set "
                        "RAY_TITAN_CACHE to a writable directory") from None
    return lib


def _checksum_file(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _checksum(lib: Path) -> str:
    import hashlib

    return hashlib.sha256(lib.read_bytes()).hexdigest()


def _complete(lib: Path) -> bool:
    """Whether ``lib`` is a finished build: its checksum, written last, matches its bytes."""
    try:
        return _checksum_file(lib).read_text().strip() == _checksum(lib)
    except OSError:
        return False


@contextlib.contextmanager
def _build_lock(out: Path, wait_s: float = 600.0) -> Iterator[None]:
    """Hold ``out/build.flock`` exclusively. An ``flock`` dies with its process (SIGKILL, a closed
    terminal), unlike torch's own ``lock`` file, which outlived a killed build and made every later
    build wait on it forever. Raises :class:`ShimError` after ``wait_s`` seconds of another live
    builder (a hung compiler), naming it."""
    import fcntl
    import time

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "build.flock", "a") as f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ShimError(f"another process has been building the simulated CUDA device in {out} for "
                                    f"{wait_s:g} s: end it, or remove {out}") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _clear_build(out: Path) -> None:
    """Remove what an unfinished or damaged build left in ``out`` (only the holder of the build
    lock calls this, so no live build owns them): torch's ``lock`` file, which its builder waits on
    for ever, and the outputs ninja would otherwise take as up to date."""
    for f in out.iterdir():
        if f.name != "build.flock":
            shutil.rmtree(f) if f.is_dir() else f.unlink()


def _compile(out: Path) -> None:
    """Build ``rt_fake_cuda.so`` from :data:`SOURCE` in ``out`` with torch's extension builder."""
    import torch
    import torch.utils.cpp_extension as ce

    out.mkdir(parents=True, exist_ok=True)
    (out / "fake_cuda.cpp").write_text(SOURCE)
    torch_lib = Path(torch.__file__).parent / "lib"
    try:
        ce.load(name="rt_fake_cuda", sources=[str(out / "fake_cuda.cpp")], build_directory=str(out),
                is_python_module=False, verbose=False, extra_cflags=["-O1"],
                extra_ldflags=[f"-Wl,-rpath,{torch_lib}"])
    except Exception as e:  # the compiler's own output is in the message
        raise ShimError(f"building the simulated CUDA device in {out} failed: {e}") from None
