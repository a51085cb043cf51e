"""Corpus sources: the built-in ``python_stdlib`` corpus and user Parquet / JSON Lines files.

``python_stdlib`` is the ``.py`` files of the running interpreter's standard library (tests and
``site-packages`` excluded; about 12 MB on CPython 3.11), written once by
:func:`materialize_python_stdlib` into Parquet shards in a cache directory, so the default job
needs nothing downloaded. User sources are a file or a directory of ``*.parquet`` or ``*.jsonl``
files with a text column, the form Hugging Face data sets are published in.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson
import pyarrow.parquet as pq

from ray_titan.config.schema import ConfigError, Data

__all__ = ["check_source", "load_columns", "load_texts", "materialize_python_stdlib", "source_files"]

_SUFFIX = {"parquet": ".parquet", "jsonl": ".jsonl"}
_EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
_SHARD_BYTES = 4 << 20


def default_cache_dir() -> Path:
    """``$RAY_TITAN_CACHE``, else ``~/.cache/ray_titan``."""
    return Path(os.environ.get("RAY_TITAN_CACHE", Path.home() / ".cache" / "ray_titan"))


def materialize_python_stdlib(cache_dir: str | Path | None = None) -> Path:
    """Write the standard library's ``.py`` files as Parquet shards (columns ``path``, ``text``)
    once, and return their directory. Safe to call concurrently: the shards are written to a
    temporary directory that is renamed into place."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    tag = f"python_stdlib-{sys.implementation.cache_tag}"
    out = root / tag
    if (out / "_SUCCESS").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    files = sorted(
        p for p in stdlib.rglob("*.py")
        if not _EXCLUDED_DIRS.intersection(p.relative_to(stdlib).parts[:-1])
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{tag}-", dir=root))
    shard: dict[str, list[str]]
    shard, size, n = {"path": [], "text": []}, 0, 0
    for f in files + [None]:
        if f is not None:
            text = f.read_text(encoding="utf-8", errors="replace")
            shard["path"].append(str(f.relative_to(stdlib)))
            shard["text"].append(text)
            size += len(text)
        if shard["text"] and (f is None or size >= _SHARD_BYTES):
            pq.write_table(pa.table(shard), tmp / f"shard-{n:05d}.parquet")
            shard, size, n = {"path": [], "text": []}, 0, n + 1
    (tmp / "_SUCCESS").touch()
    try:
        tmp.rename(out)
    except OSError:  # another process won the race; its copy is identical
        if not (out / "_SUCCESS").exists():
            raise
    return out


def source_files(data: Data) -> tuple[list[Path], str]:
    """The files of a source and their format (``"parquet"`` or ``"jsonl"``), sorted by path.

    Raises :class:`ConfigError` for a missing path, a directory without matching files, or a
    built-in corpus's cache that cannot be written.
    """
    if data.source == "python_stdlib":
        try:
            return sorted(materialize_python_stdlib(data.cache_dir).glob("*.parquet")), "parquet"
        except OSError as e:  # a read-only, full or misnamed cache: the setting, not a traceback
            where = data.cache_dir or default_cache_dir()
            raise ConfigError(f"data.cache_dir = {str(where)!r} (where the built-in corpus is materialised): cannot "
                              f"write there: {e.strerror or e}; set data.cache_dir (or RAY_TITAN_CACHE) to a "
                              "writable directory") from None
    if not data.path:
        raise ConfigError(f"data.source = {data.source!r} needs data.path (a file or a directory)")
    path = Path(data.path)
    if not path.exists():
        raise ConfigError(f"data.path = {data.path!r} does not exist")
    suffix = _SUFFIX[data.source]
    files = sorted(path.rglob(f"*{suffix}")) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"data.path = {data.path!r} has no {suffix} files (data.source = {data.source!r})")
    return files, data.source


def _read(path: Path, fmt: str, columns: list[str] | None = None) -> pa.Table:
    if fmt == "parquet":
        return pq.read_table(path, columns=columns)
    table = _read_jsonl(path)
    return table.select(columns) if columns else table


def _read_jsonl(path: Path) -> pa.Table:
    """A JSON Lines file with lines of any length. pyarrow parses blocks of 1 MiB by default and
    cannot parse a line longer than its block ("straddling object"): such a file is read again
    with one block as long as its longest line."""
    try:
        return pajson.read_json(path)
    except pa.ArrowInvalid as e:
        if "straddling" not in str(e):
            raise
    return pajson.read_json(path, read_options=pajson.ReadOptions(block_size=_longest_line(path) + 2))


def _longest_line(path: Path) -> int:
    """Bytes in the longest line of a file (newline excluded), read 16 MiB at a time."""
    longest = current = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            newlines = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == ord("\n"))
            if len(newlines) == 0:
                current += len(chunk)
                continue
            longest = max(longest, current + int(newlines[0]), int(np.diff(newlines).max(initial=0)))
            current = len(chunk) - int(newlines[-1]) - 1
    return max(longest, current)


def _has_text(column: pa.ChunkedArray | pa.Array) -> bool:
    """Whether any value of a string column is non-null and non-empty."""
    return bool(pc.any(pc.greater(pc.binary_length(column), 0)).as_py())


def _first_text(files: list[Path], fmt: str, column: str) -> bool:
    """Whether any document of the source has text, reading as little as it can: Parquet one row
    group at a time (a corpus with text answers after its first), JSON Lines file by file."""
    for f in files:
        if fmt == "parquet":
            pf = pq.ParquetFile(f)
            if any(_has_text(pf.read_row_group(i, columns=[column]).column(0)) for i in range(pf.num_row_groups)):
                return True
        elif _has_text(_read(f, fmt, [column]).column(0)):
            return True
    return False


def _columns(data: Data) -> list[tuple[str, str, str]]:
    """``(setting, column, kind)`` of the columns ``data.format`` reads."""
    if data.format == "prompt_response":
        return [("prompt_column", data.prompt_column, "string"), ("response_column", data.response_column, "string")]
    if data.format == "messages":
        return [("messages_column", data.messages_column, "a list of {role, content}")]
    return [("text_column", data.text_column, "string")]


def _is_kind(t: pa.DataType, kind: str) -> bool:
    if kind == "string":
        return pa.types.is_string(t) or pa.types.is_large_string(t)
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_struct(t.value_type) and all(
        t.value_type.get_field_index(k) >= 0 for k in ("role", "content"))


def check_source(data: Data) -> None:
    """Check that every file of the source exists and has the columns ``data.format`` reads
    (``data.text_column`` as a string column for text), and that the source has rows (for text,
    rows with text).

    Also checks that some document has text (not all empty or null). Reads Parquet footers and
    then row groups until one has text (one, for a real corpus); JSON Lines files are parsed.
    Raises :class:`ConfigError`.
    """
    files, fmt = source_files(data)
    rows = 0
    for f in files:
        try:
            if fmt == "parquet":
                meta = pq.read_metadata(f)
                schema, n = meta.schema.to_arrow_schema(), meta.num_rows
            else:
                table = _read(f, fmt)
                schema, n = table.schema, table.num_rows
        except (pa.ArrowInvalid, OSError) as e:
            raise ConfigError(f"data.path file {str(f)!r} is not readable as {fmt}: {e}") from None
        rows += n
        for setting, column, kind in _columns(data):
            if column not in schema.names:
                raise ConfigError(
                    f"data.{setting} = {column!r} is not a column of {str(f)!r}; "
                    f"its columns are {schema.names}"
                )
            if not _is_kind(schema.field(column).type, kind):
                raise ConfigError(
                    f"data.{setting} = {column!r} in {str(f)!r} has type {schema.field(column).type}, not {kind}"
                )
    if rows == 0:
        raise ConfigError(f"data.path = {data.path!r} has no documents (0 rows in {len(files)} file(s))")
    if data.format == "text" and not _first_text(files, fmt, data.text_column):
        raise ConfigError(
            f"data.text_column = {data.text_column!r} is empty or null in all {rows} rows of data.path = "
            f"{data.path!r} ({len(files)} file(s)): nothing to train on but BOS/EOS; name the column that holds "
            "the text"
        )


def load_columns(data: Data, columns: list[str]) -> pa.Table:
    """``columns`` of every file of the source, in file order, as one table (rows whose
    columns are all null dropped): the examples of a supervised fine-tuning source."""
    files, fmt = source_files(data)
    table = pa.concat_tables([_read(f, fmt, columns) for f in files], promote_options="permissive")
    valid = None
    for name in columns:
        v = table[name].is_valid()
        valid = v if valid is None else pc.or_(valid, v)
    return table.filter(valid)


def load_texts(data: Data) -> pa.ChunkedArray:
    """All documents of the source, in file order, as an Arrow string array (nulls dropped)."""
    files, fmt = source_files(data)
    chunks = [
        c.cast(pa.large_string())
        for f in files
        for c in _read(f, fmt, [data.text_column]).column(0).chunks
    ]
    col = pa.chunked_array(chunks, type=pa.large_string())
    return col.filter(col.is_valid())
