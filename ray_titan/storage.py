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

import tempfile
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs

__all__ = [
    "Mirror",
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
    """Write a small UTF-8 file (a config, a summary) in one piece."""
    write_bytes(uri, text.encode())


def read_text(uri: str | Path) -> str:
    """Read a small UTF-8 file."""
    return read_bytes(uri).decode()


def write_bytes(uri: str | Path, data: bytes) -> None:
    """Write a file in one piece (a safetensors shard, a copied tokenizer file)."""
    fs, path = resolve(uri)
    with fs.open_output_stream(path) as f:
        f.write(data)


def read_bytes(uri: str | Path) -> bytes:
    """Read a whole file. Raises ``FileNotFoundError`` when it does not exist."""
    fs, path = resolve(uri)
    with fs.open_input_stream(path) as f:
        return f.read()


def staging_dir(uri: str) -> Path:
    """A local directory standing in for the remote directory ``uri`` on this node (created)."""
    name = urlparse(uri).netloc + urlparse(uri).path
    path = Path(tempfile.gettempdir()) / "ray_titan_staging" / name.strip("/")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Mirror:
    """Uploads a local directory to a destination (local path or URI) on :meth:`sync`.

    Files are copied whole with :func:`pyarrow.fs.copy_files`, so a reader of the destination
    sees complete files; files deleted locally are not deleted remotely (a consolidated
    ``steps.parquet`` then sits beside the parts it replaced, and
    :func:`ray_titan.metrics.sinks.read_steps` prefers it).
    """

    def __init__(self, local_dir: str | Path, destination: str):
        self.local_dir, self.destination = Path(local_dir), destination

    def sync(self) -> None:
        """Copy every file under the local directory to the destination, overwriting."""
        if not self.local_dir.is_dir():
            return
        dst_fs, dst = resolve(self.destination)
        dst_fs.create_dir(dst, recursive=True)
        pafs.copy_files(str(self.local_dir), dst, source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=dst_fs)
