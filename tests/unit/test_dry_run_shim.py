"""How the dry run gets its simulated CUDA device (``ray_titan.dry_run.shim``), decided from the
facts of the torch build and the machine, and where the fake CUDA library is cached."""

from __future__ import annotations

import sys

import pytest
import torch

from ray_titan.dry_run import shim
from ray_titan.dry_run.shim import ShimError, choose_device

NO_COMPILER = "the simulated CUDA device needs a C++ compiler to build once ('c++' ... is not on PATH)"


def _no_gpu_asked() -> bool:
    raise AssertionError("asked for a GPU: without a driver that warns, and the library is enough")


def test_a_cuda_build_without_a_driver_simulates_with_the_fake_library():
    """A CUDA wheel on a machine without a GPU (torch's default install) gets the fake library,
    as a CPU build does; it used to get none and reach the real CUDA runtime, which failed with
    'CUDA driver version is insufficient' (exit 1)."""
    for cuda_built in (True, False):
        assert choose_device(cuda_built=cuda_built, rocm=False, cannot_build=None, gpu=_no_gpu_asked) == "shim"


def test_without_a_compiler_only_a_usable_gpu_stands_in_else_one_line_says_why():
    assert choose_device(cuda_built=True, rocm=False, cannot_build=NO_COMPILER, gpu=lambda: True) == "gpu"
    with pytest.raises(ShimError) as no_gpu:
        choose_device(cuda_built=True, rocm=False, cannot_build=NO_COMPILER, gpu=lambda: False)
    assert str(no_gpu.value) == f"this CUDA build of torch finds no usable GPU, and {NO_COMPILER}"
    with pytest.raises(ShimError, match=r"^the simulated CUDA device needs a C\+\+ compiler"):
        choose_device(cuda_built=False, rocm=False, cannot_build=NO_COMPILER, gpu=_no_gpu_asked)


def test_a_rocm_build_without_a_gpu_is_refused_naming_the_builds_that_work():
    assert choose_device(cuda_built=True, rocm=True, cannot_build=None, gpu=lambda: True) == "gpu"
    with pytest.raises(ShimError, match=r"ROCm build .* with a CPU or CUDA build of torch"):
        choose_device(cuda_built=True, rocm=True, cannot_build=None, gpu=lambda: False)


def test_the_cache_keeps_one_library_per_torch_build_python_and_source(monkeypatch, tmp_path):
    """Three torches on one machine (a CPU and a CUDA wheel of one version, two Pythons) must
    not share a library compiled against another's headers; nor may an edited shim source reuse
    the old library."""
    monkeypatch.setenv("RAY_TITAN_CACHE", str(tmp_path))
    seen = set()
    for version, tag, source in [("2.13.0+cpu", "cpython-311", "a"), ("2.13.0+cu130", "cpython-311", "a"),
                                 ("2.13.0+cu130", "cpython-312", "a"), ("2.13.0+cu130", "cpython-312", "b")]:
        monkeypatch.setattr(torch, "__version__", version)
        monkeypatch.setattr(sys.implementation, "cache_tag", tag)
        monkeypatch.setattr(shim, "SOURCE", source)
        d = shim.cache_dir()
        assert d.parent == tmp_path / "fake_cuda" and tag in d.name and version.replace("+", "_") in d.name
        seen.add(d)
    assert len(seen) == 4
