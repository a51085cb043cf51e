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


@pytest.fixture
def patched(monkeypatch):
    """The simulation's shims installed through monkeypatch, so each test undoes them."""
    from ray_titan.dry_run import fake_device, fake_group

    for module in (fake_device, fake_group):
        monkeypatch.setattr(module, "_patch", lambda owner, name, value: monkeypatch.setattr(owner, name, value))
    return monkeypatch


def test_a_stage_without_recv_meta_gets_its_neighbours_shapes_from_the_object_exchange(patched):
    """Torch 2.11's stages have no ``_recv_meta`` (nor ``_StageForwardMeta``, which the dry run
    imported unconditionally: ImportError): their shape inference receives the previous stage's
    outputs with ``dist.recv_object_list`` and sends theirs with ``send_object_list``. Both are
    answered in the stage module only: the hidden state as a meta tensor, and nothing sent."""
    import types

    import torch.distributed as dist
    from torch.distributed.pipelining import stage as pp_stage

    from ray_titan.dry_run.fake_group import _install_stage_meta_shims

    patched.delattr(pp_stage.PipelineStage, "_recv_meta", raising=False)
    _install_stage_meta_shims(types.SimpleNamespace(hidden=(2, 8, 16), hidden_dtype=torch.bfloat16))  # type: ignore[arg-type]
    objects: list = [None]
    pp_stage.dist.recv_object_list(objects, src=0, group=None, device=torch.device("cuda"), use_batch=True)
    ((t,),) = objects
    assert (tuple(t.shape), t.dtype, t.device.type, t.requires_grad) == ((2, 8, 16), torch.bfloat16, "meta", False)
    assert pp_stage.dist.send_object_list([("outputs",)], dst=1) is None  # no process group: nothing sent
    assert pp_stage.dist.get_rank is dist.get_rank and dist.recv_object_list is not pp_stage.dist.recv_object_list


def test_the_schedules_see_the_fake_group_as_nccl(patched):
    """Torch 2.15's schedules refuse runtime shape inference on a group whose backend reads
    ``fake`` (the dry run answers it: the stage shims) and skip a GPU job's first-step vote and
    link warm-up there; they see ``nccl`` instead, other backends as they are."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from ray_titan.dry_run.fake_group import _schedules_see_nccl

    _schedules_see_nccl()
    patched.setattr(dist, "get_backend", lambda group=None: "fake" if group == "fake group" else "gloo")
    assert schedules.dist.get_backend("fake group") == "nccl" and schedules.dist.get_backend("g") == "gloo"
    assert schedules.dist.get_world_size is dist.get_world_size


def test_fsdp2_parameter_groups_are_found_in_a_list_or_torch_2_11s_single_slot(patched):
    """Torch 2.13 on keeps a module's FSDP2 parameter groups in ``FSDPState._fsdp_param_groups``;
    2.11 has one optional group in ``_fsdp_param_group`` (reading the list was an AttributeError)."""
    import types

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ray_titan.dry_run.tally import _fsdp_param_groups

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        m = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))
        groups = _fsdp_param_groups(m)
        assert len(groups) == 1 and len(groups[0].fsdp_params) == 2 and _fsdp_param_groups(torch.nn.Linear(1, 1)) == []
        for group, found in ((groups[0], groups), (None, [])):  # torch 2.11's state
            patched.setattr(m, "_get_fsdp_state", lambda g=group: types.SimpleNamespace(_fsdp_param_group=g))
            assert _fsdp_param_groups(m) == found
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """build_shim with the compiler replaced by a writer of a fake library, which records what the
    build directory held when it started (a real build would hang on torch's stale ``lock``)."""
    monkeypatch.setenv("RAY_TITAN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(shim, "_cannot_build", lambda: None)
    builds = []

    def compile_(out):
        builds.append(sorted(p.name for p in out.iterdir()))
        (out / "rt_fake_cuda.so").write_bytes(b"\x7fELF built")

    monkeypatch.setattr(shim, "_compile", compile_)
    return builds


def test_a_build_killed_half_way_neither_blocks_the_next_nor_leaves_a_library_taken_as_built(fake_build):
    """A first build killed by SIGKILL or a closed terminal left torch's ``lock`` file (and a
    truncated library) in the shared cache: every later dry run waited on the lock for ever, or
    loaded the truncated file ("invalid ELF header", "died (exit -7)"). The next build removes
    both and builds again; a damaged library is rebuilt too; a complete one is reused."""
    out = shim.cache_dir()
    out.mkdir(parents=True)
    (out / "lock").touch()
    (out / "rt_fake_cuda.so").write_bytes(b"\x7fEL")  # the linker was killed mid-write
    lib = shim.build_shim()
    assert fake_build == [["build.flock"]] and lib == out / "rt_fake_cuda.so" and lib.read_bytes() == b"\x7fELF built"
    assert shim.build_shim() == lib and len(fake_build) == 1  # complete: reused
    lib.write_bytes(b"\x00" * 8)  # damaged since
    assert shim.build_shim() == lib and len(fake_build) == 2 and lib.read_bytes() == b"\x7fELF built"


def test_a_live_builder_is_waited_for_and_a_dead_ones_lock_is_free_at_once(fake_build):
    """The build lock is an ``flock``: held while its builder lives (a second build waits, then
    finds the library built), released by the kernel when it dies (the open file closes)."""
    import fcntl
    import threading

    out = shim.cache_dir()
    out.mkdir(parents=True)
    holder = open(out / "build.flock", "a")  # closed by the timer thread: the builder dies
    fcntl.flock(holder, fcntl.LOCK_EX)

    def finish():
        (out / "rt_fake_cuda.so").write_bytes(b"\x7fELF other")
        (out / "rt_fake_cuda.so.sha256").write_text(shim._checksum(out / "rt_fake_cuda.so"))
        holder.close()

    threading.Timer(0.5, finish).start()
    assert shim.build_shim().read_bytes() == b"\x7fELF other" and fake_build == []


def test_an_unwritable_cache_is_one_line_naming_the_path(fake_build, monkeypatch, tmp_path):
    """A cache that cannot be written (read-only home, a file where the directory should be) was a
    traceback: now a ShimError (exit 2) naming the path and RAY_TITAN_CACHE."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("RAY_TITAN_CACHE", str(tmp_path / "file"))
    with pytest.raises(ShimError, match=r"^cannot build the simulated CUDA device in .*file.*RAY_TITAN_CACHE"):
        shim.build_shim()
