"""Where run directories live: a local path or any URI pyarrow's filesystem layer understands.

``job.dump_folder`` (and so the run directory, and Ray Train's ``RunConfig.storage_path`` under
it) may be a local path, ``file:///shared/runs``, ``s3://bucket/runs``, ``gs://bucket/runs``,
``hdfs://namenode/runs``, ... — the same set Ray Train's ``storage_path`` accepts, because both
resolve it with :func:`pyarrow.fs.FileSystem.from_uri`. Credentials come from the environment as
pyarrow reads them (``AWS_*``, ``GOOGLE_APPLICATION_CREDENTIALS``, ...).

Local paths and ``file://`` URIs are used directly. For a remote URI, writers that need a local
directory (Parquet parts, TensorBoard event files) write to a local staging directory and a
:class:`Mirror` uploads it to the URI after each flush and at the end, so the remote copy is at
most one flush behind, as the local one is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs

__all__ = [
    "Mirror",
    "StorageError",
    "check_writable",
    "exists",
    "is_remote",
    "join",
    "local_path",
    "makedirs",
    "read_bytes",
    "read_text",
    "resolve",
    "staging_dir",
    "write_bytes",
    "write_text",
]


def _scheme(uri: str) -> str:
    return urlparse(uri).scheme if "://" in uri else ""


def is_remote(uri: str | Path) -> bool:
    """True for a URI that is not on this machine's filesystem (any scheme but ``file``)."""
    return _scheme(str(uri)) not in ("", "file")


def local_path(uri: str | Path) -> Path | None:
    """The absolute local path of a plain path or ``file://`` URI (``~`` expanded); None if remote."""
    uri = str(uri)
    if is_remote(uri):
        return None
    if _scheme(uri) == "file":
        uri = urlparse(uri).path
    return Path(uri).expanduser().resolve()


def resolve(uri: str | Path) -> tuple[pafs.FileSystem, str]:
    """``(filesystem, path inside it)`` for a local path or URI.

    Raises ``pyarrow.ArrowInvalid`` (or ``ArrowNotImplementedError``) for a scheme pyarrow does
    not know or a filesystem it was built without.
    """
    local = local_path(uri)
    if local is not None:
        return pafs.LocalFileSystem(), str(local)
    return pafs.FileSystem.from_uri(str(uri))


def join(uri: str | Path, *parts: str) -> str:
    """``uri/part/...``: a local path stays a path, a URI stays a URI (``s3://b/runs`` + ``x``)."""
    local = local_path(uri)
    if local is not None:
        return str(local.joinpath(*parts))
    return "/".join([str(uri).rstrip("/"), *parts])


def makedirs(uri: str | Path) -> None:
    """Create the directory (and parents); object stores without directories accept this too."""
    fs, path = resolve(uri)
    fs.create_dir(path, recursive=True)


def exists(uri: str | Path) -> bool:
    """Whether a file or directory exists at ``uri``."""
    fs, path = resolve(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def write_text(uri: str | Path, text: str) -> None:
    """Write a small UTF-8 file (a config, a summary) in one piece (:func:`write_bytes`)."""
    write_bytes(uri, text.encode())


def read_text(uri: str | Path) -> str:
    """Read a small UTF-8 file."""
    return read_bytes(uri).decode()


def write_bytes(uri: str | Path, data: bytes) -> None:
    """Write a file in one piece (a safetensors shard, a copied tokenizer file): locally through
    a temporary file renamed into place, so a failed write (a full disk) leaves no empty or torn
    file (an object store publishes an object whole anyway). Raises :class:`StorageError` naming
    the file and the cause."""
    local = local_path(uri)
    try:
        if local is None:
            fs, path = resolve(uri)
            with fs.open_output_stream(path) as f:
                f.write(data)
            return
        tmp = local.with_name(local.name + ".tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        raise StorageError(uri, f"cannot write it: {e.strerror or e}") from None


def read_bytes(uri: str | Path) -> bytes:
    """Read a whole file. Raises ``FileNotFoundError`` when it does not exist."""
    fs, path = resolve(uri)
    with fs.open_input_stream(path) as f:
        return f.read()


class StorageError(OSError):
    """A directory cannot be written, or its storage does not answer: ``where`` (the directory)
    and ``cause``; the message is both."""

    def __init__(self, where: str | Path, cause: str):
        super().__init__(f"{where}: {cause}")
        self.where, self.cause = str(where), cause


PROBE_NAME = ".ray_titan_write_probe-"

# Run in a child process: a pyarrow call to an unreachable bucket can block for minutes, deaf to
# Ctrl-C, and only a process can be stopped at a deadline.
_REMOTE_PROBE = """
import sys, uuid
import pyarrow.fs as pafs
try:
    fs, path = pafs.FileSystem.from_uri(sys.argv[1])
except Exception as e:
    sys.exit("pyarrow cannot open it: " + str(e))
fs.create_dir(path, recursive=True)
probe = path.rstrip("/") + "/" + sys.argv[2] + uuid.uuid4().hex
with fs.open_output_stream(probe) as f:
    f.write(b"ray_titan")
fs.delete_file(probe)
"""


def check_writable(uri: str | Path, timeout_s: float) -> None:
    """Prove that files can be written in the directory ``uri`` by writing and removing a small
    probe file there (creating the directory if needed; directories created only for the probe
    are removed again). A remote URI is probed in a child process stopped after ``timeout_s``
    seconds. Raises :class:`StorageError` naming the directory and the cause (read-only
    filesystem, not a directory, permission, no answer within ``timeout_s``, ...)."""
    local = local_path(uri)
    if local is None:
        try:
            out = subprocess.run([sys.executable, "-c", _REMOTE_PROBE, str(uri), PROBE_NAME],
                                 capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise StorageError(uri, f"no answer from its storage within {timeout_s:g} s "
                                    "(unreachable endpoint or bucket, or missing credentials?)") from None
        if out.returncode:
            last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
            raise StorageError(uri, last if last.startswith("pyarrow cannot") else f"cannot write there: {last}")
        return
    created, doing = [], "cannot create it"
    try:
        for parent in [local, *local.parents][::-1]:
            if not parent.exists():
                parent.mkdir()
                created.append(parent)
        doing = "cannot write there"
        probe = local / f"{PROBE_NAME}{uuid.uuid4().hex}"
        with open(probe, "wb") as f:
            f.write(b"ray_titan")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        where = str(e.filename or local)
        named = where != str(local) and PROBE_NAME not in where  # a parent directory that failed
        raise StorageError(local, f"{doing}: {e.strerror or e}" + (f" ({where})" if named else "")) from None
    finally:
        for d in reversed(created):
            try:
                d.rmdir()
            except OSError:
                pass


def staging_dir(uri: str) -> Path:
    """A local directory standing in for the remote directory ``uri`` on this node (created)."""
    name = urlparse(uri).netloc + urlparse(uri).path
    path = Path(tempfile.gettempdir()) / "ray_titan_staging" / name.strip("/")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Mirror:
    """Uploads a local directory to a destination (local path or URI) on :meth:`sync`.

    Files are copied whole with :func:`pyarrow.fs.copy_files`, so a reader of the destination
    sees complete files; only files new or changed (size or modification time) since the last
    sync are copied, so a run's uploads stay linear in what it writes. Files deleted locally are
    not deleted remotely (a consolidated ``steps.parquet`` then sits beside the parts it replaced,
    and :func:`ray_titan.metrics.sinks.read_steps` prefers it).
    """

    def __init__(self, local_dir: str | Path, destination: str):
        self.local_dir, self.destination = Path(local_dir), destination
        self._uploaded: dict[str, tuple[int, int]] = {}  # relative path -> (bytes, mtime ns) sent

    def sync(self) -> list[str]:
        """Copy every file that is new or changed since the last sync to the destination,
        overwriting; returns their relative paths. A failed copy is retried at the next sync."""
        if not self.local_dir.is_dir():
            return []
        changed = []
        for p in sorted(self.local_dir.rglob("*")):
            if p.is_file():
                st = p.stat()
                rel = p.relative_to(self.local_dir).as_posix()
                if self._uploaded.get(rel) != (st.st_size, st.st_mtime_ns):
                    changed.append((rel, (st.st_size, st.st_mtime_ns)))
        if not changed:
            return []
        dst_fs, dst = resolve(self.destination)
        made: set[str] = set()
        for rel, stamp in changed:
            target = f"{dst.rstrip('/')}/{rel}"
            if (parent := target.rsplit("/", 1)[0]) not in made:
                dst_fs.create_dir(parent, recursive=True)
                made.add(parent)
            pafs.copy_files(str(self.local_dir / rel), target,
                            source_filesystem=pafs.LocalFileSystem(), destination_filesystem=dst_fs)
            self._uploaded[rel] = stamp
        return [rel for rel, _ in changed]
