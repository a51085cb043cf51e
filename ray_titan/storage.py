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

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_CONFIG_BYTES",
    "MAX_TOKENIZER_BYTES",
    "FileTooLargeError",
    "Mirror",
    "StorageError",
    "check_reachable",
    "check_writable",
    "exists",
    "is_remote",
    "join",
    "local_path",
    "makedirs",
    "probe_location",
    "read_bytes",
    "read_text",
    "resolve",
    "sibling",
    "staged_output",
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
    """``uri/part/...``: a local path stays a path, a URI stays a URI (``s3://b/runs`` + ``x``);
    a URI's options stay at its end (``s3://b/m?endpoint_override=h`` + ``x``:
    ``s3://b/m/x?endpoint_override=h``)."""
    local = local_path(uri)
    if local is not None:
        return str(local.joinpath(*parts))
    base, sep, options = str(uri).partition("?")
    return "/".join([base.rstrip("/"), *parts]) + sep + options


def sibling(uri: str | Path, name: str) -> str:
    """The file ``name`` in the directory holding ``uri`` (``.../tokenizer.json`` ->
    ``.../tokenizer_config.json``): a local path stays a path; a URI's options stay at its end
    (``s3://b/m/tokenizer.json?endpoint_override=h`` -> ``s3://b/m/tokenizer_config.json?endpoint_override=h``),
    where cutting at the last ``/`` would drop them."""
    local = local_path(uri)
    if local is not None:
        return str(local.parent / name)
    base, sep, options = str(uri).partition("?")
    return base.rstrip("/").rsplit("/", 1)[0] + "/" + name + sep + options


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


def read_text(uri: str | Path, max_bytes: int | None = None, what: str = "") -> str:
    """Read a small UTF-8 file (``max_bytes``, ``what``: as :func:`read_bytes`)."""
    return read_bytes(uri, max_bytes, what).decode()


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


# Small files read whole are size-checked first against these bounds (read_bytes' max_bytes), so
# a huge or sparse file where a small one belongs is refused at once instead of read into memory;
# each is far above the real sizes.
MAX_CONFIG_BYTES = 16 * 2**20
"""A Hugging Face ``config.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` or
``generation_config.json``: kilobytes in released models (a ``tokenizer_config.json`` with a
long chat template and many added tokens: a few hundred KB)."""
MAX_TOKENIZER_BYTES = 256 * 2**20
"""A ``tokenizer.json``: Llama 3's is 9 MB, Gemma 3's (262k tokens) 33 MB."""


class FileTooLargeError(ValueError):
    """A file read whole is larger than its bound: ``file``, its ``size`` and the bound
    ``max_bytes`` (bytes); the message names all three and ``what`` the bound is."""

    def __init__(self, file: str | Path, size: int, max_bytes: int, what: str = ""):
        super().__init__(f"{file} has {size} bytes; valid: at most {max_bytes}{f' ({what})' if what else ''}")
        self.file, self.size, self.max_bytes = str(file), size, max_bytes


def read_bytes(uri: str | Path, max_bytes: int | None = None, what: str = "") -> bytes:
    """Read a whole file. ``max_bytes``: its size is checked first and a larger file refused
    with :class:`FileTooLargeError` (``what``: the bound's name or reason, for the message)
    before anything is read, so a huge or sparse file named where a small one belongs costs
    neither time nor memory. Raises ``FileNotFoundError`` when it does not exist."""
    fs, path = resolve(uri)
    if max_bytes is None:
        with fs.open_input_stream(path) as f:
            return f.read()
    with fs.open_input_file(path) as f:  # random access: its size without reading it
        size = f.size()
        if size > max_bytes:
            raise FileTooLargeError(uri, size, max_bytes, what)
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


def _probe_in_child(uri: str | Path, timeout_s: float, doing: str, script: str, *args: str) -> None:
    """Run ``script`` on ``uri`` in a child process stopped after ``timeout_s`` seconds (a pyarrow
    call to an unreachable bucket can block for minutes, deaf to Ctrl-C). Raises
    :class:`StorageError` naming ``uri``: no answer in time, or the child's last line of error
    (prefixed with ``doing`` unless pyarrow could not open the URI at all)."""
    try:
        out = subprocess.run([sys.executable, "-c", script, str(uri), *args],
                             capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise StorageError(uri, f"no answer from its storage within {timeout_s:g} s "
                                "(unreachable endpoint or bucket, or missing credentials?)") from None
    if out.returncode:
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        raise StorageError(uri, last if last.startswith("pyarrow cannot") else f"{doing}: {last}")


def check_writable(uri: str | Path, timeout_s: float) -> None:
    """Prove that files can be written in the directory ``uri`` by writing and removing a small
    probe file there (creating the directory if needed; directories created only for the probe
    are removed again). A remote URI is probed in a child process stopped after ``timeout_s``
    seconds. Raises :class:`StorageError` naming the directory and the cause (read-only
    filesystem, not a directory, permission, no answer within ``timeout_s``, ...)."""
    local = local_path(uri)
    if local is None:
        _probe_in_child(uri, timeout_s, "cannot write there", _REMOTE_PROBE, PROBE_NAME)
        return
    for attempt in range(3):
        # Another job probing the same new directory may remove it between our mkdir and our
        # probe (it created it; we found it): try again, and take no mkdir race as a failure.
        if _probe_local(local, last=attempt == 2):
            return


def _probe_local(local: Path, last: bool) -> bool:
    """One try of :func:`check_writable` on a local directory; False on "No such file or
    directory" (a concurrent probe removed the directory it had created) unless ``last``."""
    created, doing = [], "cannot create it"
    try:
        for parent in [local, *local.parents][::-1]:
            if not parent.exists():
                try:
                    parent.mkdir()
                    created.append(parent)
                except FileExistsError:
                    if not parent.is_dir():  # a file of that name: say so below
                        raise
        doing = "cannot write there"
        probe = local / f"{PROBE_NAME}{uuid.uuid4().hex}"
        with open(probe, "wb") as f:
            f.write(b"ray_titan")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
        return True
    except OSError as e:
        if e.errno == errno.ENOENT and not last:
            # Vanished under us, perhaps recreated by now: look again (a filesystem that takes no
            # new files, procfs and the like, answers the same on the last try and is named below).
            return False
        where = str(e.filename or local)
        named = where != str(local) and PROBE_NAME not in where  # a parent directory that failed
        cause = e.strerror or str(e)
        if e.errno == errno.ENOENT and Path(where).parent.is_dir():
            # procfs, sysfs and the like answer "No such file or directory" to any new name in a
            # directory that exists: say what refused it.
            kind = _filesystem_type(Path(where).parent)
            cause = (f"it is on a {kind} filesystem, which takes no new files (a kernel interface, not storage)"
                     if kind else "its filesystem takes no new files (a special filesystem such as /proc?)")
        raise StorageError(local, f"{doing}: {cause}" + (f" ({where})" if named else "")) from None
    finally:
        _remove_created(created)


def _remove_created(created: list[Path], wait_s: float = 2.0) -> None:
    """Remove the directories a probe created, deepest first. One that is not empty holds a
    concurrent probe's file or directory (it found ours and used it): wait up to ``wait_s`` for
    that probe to clean up, then leave it (something else lives there now: a run's directory)."""
    deadline = time.monotonic() + wait_s
    for d in reversed(created):
        while True:
            try:
                d.rmdir()
                break
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or time.monotonic() > deadline:
                    break  # gone already (ENOENT), or in use
                time.sleep(0.01)


def _filesystem_type(path: Path) -> str:
    """The type of the filesystem ``path`` is on (``proc``, ``sysfs``, ``ext4``, ...), from the
    mount table of Linux (``/proc/self/mountinfo``); ``""`` where there is none."""
    best, kind = "", ""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    target = str(path.resolve())
    for line in lines:
        fields, _, tail = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not tail:
            continue
        mount = parts[4].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, tail.split()[0]
    return kind


DEFAULT_TIMEOUT_S = 30.0
"""Seconds a storage probe waits for an answer unless told otherwise (``job.storage_timeout_s``'s
default, and ``ray-titan export --storage-timeout``'s)."""

# Run in a child process, as _REMOTE_PROBE: asks for one file's information, which needs the
# endpoint, the bucket and the credentials, and reads nothing.
_REMOTE_READ_PROBE = """
import sys
import pyarrow.fs as pafs
try:
    fs, path = pafs.FileSystem.from_uri(sys.argv[1])
except Exception as e:
    sys.exit("pyarrow cannot open it: " + str(e))
fs.get_file_info(path)
"""

_ANSWERED: set[str] = set()  # the storages (scheme, bucket, options) that answered a probe here


def check_reachable(uri: str | Path, timeout_s: float) -> None:
    """Prove that the storage holding ``uri`` answers before this process reads from it. A local
    path or ``file://`` URI: nothing to prove, returns at once (whether the file exists is for the
    reader to say). A remote URI: a child process asks pyarrow for ``uri``'s file information
    and is stopped after ``timeout_s`` seconds, as :func:`check_writable` does, so an unreachable
    endpoint or bucket cannot block this process (a pyarrow call can block for minutes, deaf to
    Ctrl-C); a storage (scheme, bucket and options) that answered once is not asked again.
    Raises :class:`StorageError` naming ``uri`` and the cause (no answer within ``timeout_s``, a
    scheme pyarrow cannot open, the storage's own error such as access denied)."""
    if not is_remote(uri):
        return
    parsed = urlparse(str(uri))
    key = f"{parsed.scheme}://{parsed.netloc}?{parsed.query}"
    if key in _ANSWERED:
        return
    _probe_in_child(uri, timeout_s, "cannot read it", _REMOTE_READ_PROBE)
    _ANSWERED.add(key)


def probe_location(setting: str, uri: str | Path, timeout_s: float,
                   timeout_setting: str = "job.storage_timeout_s") -> None:
    """The one probe before reading a location a user named (``setting``: where it came from,
    such as ``checkpoint.initial_load_hf``): :func:`check_reachable` within ``timeout_s`` seconds.
    Raises :class:`~ray_titan.config.schema.ConfigError` naming the setting, the location and the
    cause, and ``timeout_setting``, the setting that gives the wait."""
    from ray_titan.config.schema import ConfigError

    try:
        check_reachable(uri, timeout_s)
    except StorageError as e:
        raise ConfigError(
            f"{setting} = {str(uri)!r}: {e.cause}; use a local path or a URI of a filesystem pyarrow supports "
            f"that is reachable from here, with credentials in the environment ({timeout_setting} = {timeout_s:g} s "
            "is the wait)"
        ) from None


@contextlib.contextmanager
def staged_output(uri: str | Path, timeout_s: float = DEFAULT_TIMEOUT_S, last: tuple[str, ...] = ()) -> Iterator[str]:
    """Write the directory ``uri`` whole: the block writes into the local directory this yields,
    which becomes ``uri`` only when the block ends without an exception; an exception (Ctrl-C
    included) removes it and leaves ``uri`` as it was, so no reader sees a half-written directory.

    A local ``uri``: the staging directory is ``.<name>.partial-<random>`` beside it (the same
    filesystem), renamed into place at the end; where ``uri`` is an empty directory already (a
    mount point, or one whose parent the user cannot write), ``.partial-<random>`` inside it, whose
    files are moved up at the end (a failure leaves it empty again). A remote one: probed first (:func:`check_writable`
    within ``timeout_s`` seconds), staged in the local temporary directory and uploaded at the
    end, the files named in ``last`` after all others (the file whose presence marks the directory
    complete, such as a model's ``config.json``); a failed upload removes what it sent.
    Raises :class:`StorageError` naming ``uri`` before the block runs when it exists and is not an
    empty directory (nothing is overwritten), cannot be created, or does not answer."""
    local = local_path(uri)
    if local is not None:
        if local.exists() and (not local.is_dir() or any(local.iterdir())):
            raise StorageError(local, "already exists and is not an empty directory; remove it or choose another")
        # An empty directory that exists (a mount point, or one the user may write only inside)
        # is filled in place from a staging directory inside it; a new one is renamed into place.
        inside = local.is_dir()
        try:
            if not inside:
                local.parent.mkdir(parents=True, exist_ok=True)
            staging = (local / f".partial-{uuid.uuid4().hex[:8]}" if inside
                       else local.parent / f".{local.name}.partial-{uuid.uuid4().hex[:8]}")
            staging.mkdir()
        except OSError as e:
            raise StorageError(local, f"cannot create {e.filename or local}: {e.strerror or e}") from None
        try:
            yield str(staging)
            try:
                if inside:
                    for child in sorted(staging.iterdir(), key=lambda c: c.name in last):  # the marker last
                        os.rename(child, local / child.name)
                    staging.rmdir()
                else:
                    os.rename(staging, local)
            except OSError as e:
                raise StorageError(local, f"cannot put the finished files in place: {e.strerror or e}") from None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            if inside:  # files already moved up: leave the directory empty, as it was
                for child in local.iterdir():
                    if child.is_dir():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink(missing_ok=True)
            raise
        return
    check_writable(uri, timeout_s)
    fs, path = resolve(uri)
    root = path.rstrip("/")
    if fs.get_file_info(pafs.FileSelector(root, allow_not_found=True, recursive=False)):
        raise StorageError(uri, "already exists and is not empty; remove it or choose another")
    staging = Path(tempfile.mkdtemp(prefix="ray_titan_output-"))
    sent: list[str] = []
    try:
        yield str(staging)
        files = sorted((p for p in staging.rglob("*") if p.is_file()), key=lambda p: (p.name in last, str(p)))
        for p in files:
            target = f"{root}/{p.relative_to(staging).as_posix()}"
            fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
            pafs.copy_files(str(p), target, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
            sent.append(target)
    except BaseException:
        for target in sent:
            with contextlib.suppress(Exception):
                fs.delete_file(target)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
    and :func:`ray_titan.metrics.reading.steps.read_steps` prefers it).
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
