"""The fake CUDA device a CPU-only torch build lacks, built on first use.

A CPU build of PyTorch registers no device guard and no CUDA hooks, so tensors cannot be made
on ``cuda`` at all, even fake ones. This module compiles a small C++ library (with the compiler
``torch.utils.cpp_extension`` uses) that registers c10's ``FakeGuardImpl`` for CUDA and a
``CUDAHooksInterface`` answering "available, 8 devices"; loaded with ``ctypes`` *before*
``import torch`` (its static initialisers run then, so torch's first look at CUDA finds them),
the process has a CUDA device that holds only fake tensors (``FakeTensorMode``). The library is
cached per torch version under ``~/.cache/ray_titan/fake_cuda``; on a CUDA build nothing is built.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["ShimError", "build_shim", "cache_dir"]

SOURCE = r"""
#include <c10/core/impl/FakeGuardImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <ATen/detail/CUDAHooksInterface.h>
namespace c10 { namespace impl {
C10_REGISTER_GUARD_IMPL(CUDA, FakeGuardImpl<DeviceType::CUDA>);
}}
namespace at {
// Registered under the key torch's own CUDA build uses, so getCUDAHooks() creates this one.
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
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCUDAHooks);
}
"""


class ShimError(RuntimeError):
    """The fake CUDA library cannot be built here (no C++ compiler, or the build failed); the
    message says which and what to install."""


def cache_dir() -> Path:
    """Where the library is kept: ``$RAY_TITAN_CACHE`` or ``~/.cache/ray_titan``, then
    ``fake_cuda/torch-<version>``."""
    import torch

    root = Path(os.environ.get("RAY_TITAN_CACHE", Path.home() / ".cache" / "ray_titan"))
    return root / "fake_cuda" / f"torch-{torch.__version__.replace('+', '_')}"


def build_shim() -> Path | None:
    """The path of the fake CUDA library, built if not cached (a few seconds); None on a CUDA
    build of torch, which needs none. Raises :class:`ShimError` without a C++ compiler (naming
    the one ``torch.utils.cpp_extension`` looks for) or when the build fails (its output)."""
    import torch
    import torch.utils.cpp_extension as ce

    if torch.backends.cuda.is_built():
        return None
    out = cache_dir()
    lib = out / "rt_fake_cuda.so"
    if lib.is_file():
        return lib
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise ShimError(f"the simulated CUDA device needs a C++ compiler to build once ({compiler!r}, from $CXX "
                        "or the default c++, is not on PATH): install g++ (or set CXX), or run on a CUDA build "
                        "of torch")
    if not ce.is_ninja_available():
        raise ShimError("the simulated CUDA device is built with ninja, which is not installed: pip install ninja")
    out.mkdir(parents=True, exist_ok=True)
    (out / "fake_cuda.cpp").write_text(SOURCE)
    torch_lib = Path(torch.__file__).parent / "lib"
    try:
        ce.load(name="rt_fake_cuda", sources=[str(out / "fake_cuda.cpp")], build_directory=str(out),
                is_python_module=False, verbose=False, extra_cflags=["-O1"],
                extra_ldflags=[f"-Wl,-rpath,{torch_lib}"])
    except Exception as e:  # the compiler's own output is in the message
        raise ShimError(f"building the simulated CUDA device in {out} failed: {e}") from None
    if not lib.is_file():
        raise ShimError(f"building the simulated CUDA device left no {lib}")
    return lib
