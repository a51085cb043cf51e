"""The checkpoint metadata unpickler runs no code: crafted payloads and random opcode streams.

DCP's ``.metadata`` is a pickle, and checkpoint directories are often shared storage. These tests
feed :class:`ray_titan.checkpoint.MetadataUnpickler` what a hostile user would write, and check with
an audit hook (PEP 578, independent of the unpickler) that nothing runs a command, compiles or
executes code, imports, or reaches the default ``find_class``.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_titan.checkpoint import ALLOWED_GLOBALS, MetadataUnpickler

# Audit events that mean code ran, or that a global was looked up the unrestricted way.
_DANGEROUS = ("os.system", "subprocess.Popen", "exec", "compile", "import", "os.exec", "os.posix_spawn",
              "os.spawn", "os.fork", "os.kill", "ctypes.", "pickle.find_class", "builtins.input", "open")
_armed = threading.local()
_seen: list[str] = []


def _hook(event: str, args: tuple) -> None:
    if getattr(_armed, "on", False) and event.startswith(_DANGEROUS):
        _seen.append(event)


sys.addaudithook(_hook)  # cannot be removed; it does nothing unless armed in this thread


def _load(data: bytes):
    """Unpickle ``data`` with the metadata unpickler; returns (result or exception, audit events)."""
    _seen.clear()
    _armed.on = True
    try:
        result = MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # refusals, and whatever malformed streams raise
        result = e
    finally:
        _armed.on = False
    return result, list(_seen)


def _str(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def _stack_global_call(module: str, name: str, *args: str) -> bytes:
    """Protocol 4: ``STACK_GLOBAL module name``, then call it with ``args`` (strings)."""
    return b"\x80\x04" + _str(module) + _str(name) + b"\x93(" + b"".join(map(_str, args)) + b"tR."


def test_protocol_4_dotted_name_through_an_allowed_module_is_refused(tmp_path):
    """The reported hole: DCP's metadata module imports ``os``, so ``os.system`` is reachable
    as a dotted name under it."""
    marker = tmp_path / "pwned"
    payload = _stack_global_call("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}")
    # Negative control: the default unpickler resolves that dotted name (a harmless call here).
    assert pickle.loads(_stack_global_call("torch.distributed.checkpoint.metadata", "os.getcwd")) == os.getcwd()
    result, events = _load(payload)
    assert isinstance(result, pickle.UnpicklingError)
    assert str(result) == "refusing to unpickle torch.distributed.checkpoint.metadata.os.system"
    assert events == [] and not marker.exists()


class _Reduce:
    def __init__(self, *target):
        self.target = target

    def __reduce__(self):
        return self.target




def test_names_that_the_old_allow_list_admitted_are_refused():
    # Anything under torch.distributed.checkpoint.metadata was allowed: its imports included.
    for name in ("os", "torch", "dataclass", "field", "Metadata.__init__"):
        result, _ = _load(b"\x80\x04" + _str("torch.distributed.checkpoint.metadata") + _str(name) + b"\x93.")
        assert isinstance(result, pickle.UnpicklingError), name


def test_real_dcp_metadata_still_loads(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata

    state = {"w": torch.zeros(3, 4), "h": torch.ones(2, dtype=torch.bfloat16), "n": 5, "rng": torch.get_rng_state()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    result, events = _load((tmp_path / ".metadata").read_bytes())
    assert isinstance(result, Metadata) and events == []
    assert tuple(result.state_dict_metadata["w"].size) == (3, 4)
    assert result.state_dict_metadata["h"].properties.dtype == torch.bfloat16


# -- property: random opcode streams ------------------------------------------------------------

_TARGETS = sorted(ALLOWED_GLOBALS) + [
    ("os", "system"), ("posix", "system"), ("builtins", "eval"), ("builtins", "exec"), ("builtins", "getattr"),
    ("builtins", "__import__"), ("subprocess", "Popen"), ("torch", "load"), ("pickle", "loads"),
    ("torch.distributed.checkpoint.metadata", "os.system"), ("torch.distributed.checkpoint.metadata", "os"),
    ("torch.distributed.checkpoint.metadata", "torch.load"), ("torch", "Size.__new__"),
    ("collections", "OrderedDict.fromkeys"), ("pathlib", "PosixPath.write_text"), ("copyreg", "_reconstructor"),
]
_COMMANDS = ["echo pwned", "import os", "__import__('os').system('true')", "/dev/null", "x", ""]


def _piece() -> st.SearchStrategy[bytes]:
    target = st.sampled_from(_TARGETS)
    return st.one_of(
        st.builds(lambda t: b"c" + t[0].encode() + b"\n" + t[1].encode() + b"\n", target),  # GLOBAL
        st.builds(lambda t: _str(t[0]) + _str(t[1]) + b"\x93", target),  # STACK_GLOBAL
        st.builds(lambda t: b"i" + t[0].encode() + b"\n" + t[1].encode() + b"\n", target),  # INST
        st.builds(_str, st.sampled_from(_COMMANDS)),
        st.builds(lambda n: b"K" + bytes([n]), st.integers(0, 255)),  # BININT1
        st.builds(lambda n: b"\x82" + bytes([n]), st.integers(1, 255)),  # EXT1
        st.builds(lambda n: b"h" + bytes([n]), st.integers(0, 3)),  # BINGET
        st.builds(lambda n: b"q" + bytes([n]), st.integers(0, 3)),  # BINPUT
        st.builds(lambda n: b"J" + struct.pack("<i", n), st.integers(-(2**31), 2**31 - 1)),  # BININT
        st.sampled_from([
            b"R", b"b", b"\x81", b"\x92", b"o", b"(", b"t", b"\x85", b"\x86", b"\x87", b")", b"]", b"}",
            b"a", b"e", b"s", b"u", b"d", b"l", b"\x94", b"0", b"2", b"N", b"\x88", b"\x89", b"Q",
            b"\x8f", b"\x90", b"\x91",
        ]),
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_piece(), min_size=1, max_size=24), st.sampled_from([b"", b"\x80\x02", b"\x80\x04", b"\x80\x05"]))
def test_random_opcode_streams_never_run_code(pieces, proto):
    returned = []

    class Recording(MetadataUnpickler):
        def find_class(self, module, name):
            obj = super().find_class(module, name)
            returned.append(obj)
            return obj

    data = proto + b"".join(pieces) + b"."
    _seen.clear()
    _armed.on = True
    try:
        Recording(io.BytesIO(data)).load()
    except Exception:
        pass
    finally:
        _armed.on = False
    assert _seen == []
    allowed = list(ALLOWED_GLOBALS.values())
    assert all(any(obj is a for a in allowed) for obj in returned)


@pytest.mark.parametrize("payload, refused", [
    (_Reduce(os.system, ("echo pwned",)), "posix.system"),
    (_Reduce(eval, ("__import__('os').system('echo pwned')",)), "builtins.eval"),
    (_Reduce(exec, ("import os",)), "builtins.exec"),
    (_Reduce(getattr, ("x", "upper")), "builtins.getattr"),
    (_Reduce(torch.load, ("/dev/null",)), "torch.serialization.load"),
    (_Reduce(__import__("subprocess").Popen, (["true"],)), "subprocess.Popen"),
    (_Reduce(__import__("dataclasses").dataclass, (int,)), "dataclasses.dataclass"),
])
@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_reduce_payloads_are_refused(payload, refused, protocol):
    data = pickle.dumps(payload, protocol=protocol)
    result, events = _load(data)
    assert isinstance(result, pickle.UnpicklingError)
    if protocol >= 3:  # protocols 0-2 name some modules as Python 2 did (__builtin__, commands)
        assert str(result) == f"refusing to unpickle {refused}"
    assert str(result).endswith("." + refused.rsplit(".", 1)[1]) and events == []
