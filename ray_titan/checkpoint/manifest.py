"""The checkpoint's manifest (``ray_titan_checkpoint.json``: step, mesh, model, optimizer, data
settings, every file's size and CRC-32), the checks that a directory is a complete checkpoint
that fits this job, and the names every other part agrees on (``MANIFEST``, ``HF_DIR``,
:class:`CheckpointError`)."""

from __future__ import annotations

import json
import os
import stat
import zlib
from pathlib import Path, PurePosixPath
from typing import Any

MANIFEST = "ray_titan_checkpoint.json"
HF_DIR = "hf"
"""The checkpoint's subdirectory holding the job's Hugging Face tokenizer files and the imported
``config.json`` (what ``ray-titan export`` writes beside the weights)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
"""The tokenizer files kept in a checkpoint's ``hf/`` and copied beside an export: the job's
``data.tokenizer_path`` (as ``tokenizer.json``) and those of the others beside it."""

# Files read whole are size-checked first against these bounds, so a huge or sparse file where a
# small one belongs is refused at once instead of read into memory; each is far above real sizes.
# (A Hugging Face config.json's and tokenizer.json's: storage.MAX_CONFIG_BYTES, MAX_TOKENIZER_BYTES.)
MAX_MANIFEST_BYTES = 64 * 2**20
"""A checkpoint's manifest: about 100 bytes per file it lists (a ``.distcp`` and a metrics report
per rank), so about 1 MB at 10,000 ranks."""
FORMAT = 2
"""2: the data position is (epoch, document, offset); 1 saved the loader's unread tokens."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit this job; the message names
    the path and the problem."""


def step_dir_name(step: int) -> str:
    """``step-NNNNNNNN``: sorts by step."""
    return f"step-{step:08d}"


def _outside(name: Any) -> str | None:
    """Why ``name`` (a file a checkpoint's manifest or ``.metadata`` names) could be outside the
    checkpoint directory, from the name alone; None for a relative path without ``..``."""
    if not isinstance(name, str) or not name or "\0" in name:
        return "not a file name"
    if PurePosixPath(name).is_absolute():
        return "an absolute path"
    if ".." in PurePosixPath(name).parts:
        return "a path with '..'"
    return None


def _inside(path: Path, name: Any) -> Path:
    """``path / name`` for a file the manifest of checkpoint ``path`` lists, after checking, before
    anything outside the checkpoint is opened or stat'ed, that it stays inside: a relative path
    without ``..`` through no symbolic link (ray_titan writes none; one could point anywhere), each
    component ``lstat``-ed from the top. Raises :class:`CheckpointError` naming the checkpoint, the
    entry and why; a missing component is left to the caller's "missing" check."""
    why = _outside(name)
    if why is None:
        at = path
        for part in PurePosixPath(name).parts:
            at = at / part
            try:
                if stat.S_ISLNK(os.lstat(at).st_mode):
                    why = f"a path through the symbolic link {at.relative_to(path).as_posix()}"
                    break
            except OSError:
                break
    if why is not None:
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST} lists {name!r}, {why}; a checkpoint's files are relative paths "
            "inside its directory, without '..' or symbolic links; not a checkpoint this ray_titan wrote"
        )
    return path / name


# -- manifest and completeness ----------------------------------------------------------------

def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _file_entries(directory: Path) -> dict[str, dict[str, int]]:
    """Every file under ``directory`` but the manifest: relative name -> bytes and CRC-32."""
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"):
            out[p.relative_to(directory).as_posix()] = {"bytes": p.stat().st_size, "crc32": _crc32(p)}
    return out


def read_manifest(path: str | Path, verify_checksums: bool = False) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` after checking that it is complete: the manifest
    exists and parses, every name it lists is a file inside ``path`` (relative, without ``..``, through
    no symbolic link: checked for all before any is stat'ed), and each exists with its size (and
    CRC-32 when ``verify_checksums``). Raises :class:`CheckpointError` naming the path and the
    problem."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: it has no {MANIFEST} (a save that did not finish, "
            "or not a ray_titan checkpoint)"
        )
    size = mpath.stat().st_size
    if size > MAX_MANIFEST_BYTES:  # checked before the read: a huge file is not read into memory
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} has {size} bytes; valid: at most {MAX_MANIFEST_BYTES} "
                              "(MAX_MANIFEST_BYTES); not a checkpoint this ray_titan wrote")
    try:
        manifest = json.loads(mpath.read_text())
        files, step = manifest["files"], int(manifest["step"])
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt: {type(e).__name__}: {e}") from None
    if manifest.get("format") not in (1, FORMAT):
        raise CheckpointError(f"checkpoint {path}: format {manifest.get('format')!r}; this ray_titan reads 1, {FORMAT}")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} lists no DCP .metadata")
    # Every name first: nothing outside the checkpoint is stat'ed (its size would be disclosed) or read.
    checked = {name: _inside(path, name) for name in files}
    for name, entry in files.items():
        if not (isinstance(entry, dict) and all(isinstance(entry.get(k), int) for k in ("bytes", "crc32"))):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt: the entry of {name} is {entry!r}, "
                                  "not {'bytes': <int>, 'crc32': <int>}")
    for name, entry in files.items():
        f = checked[name]
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        if f.stat().st_size != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {name} has {f.stat().st_size} bytes, the manifest says {entry['bytes']}"
            )
        if verify_checksums and _crc32(f) != entry["crc32"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} fails its CRC-32 check")
    manifest["step"] = step
    return manifest


def saved_reports(path: Path, from_rank: int = 0) -> dict[int, list[dict[str, Any]]]:
    """The metric reports checkpoint ``path`` holds (``reports/rank<r>.json``: what rank ``r``
    had not yet seen on disk at the collector when it saved), by rank, for ranks >= ``from_rank``;
    empty where there are none. Raises ``OSError``/``ValueError`` for an unreadable file."""
    out = {}
    for f in sorted((path / "reports").glob("rank*.json")):
        if f.stem[4:].isdigit() and int(f.stem[4:]) >= from_rank:
            out[int(f.stem[4:])] = json.loads(f.read_text())
    return out


def find_latest(directory: str | Path) -> Path | None:
    """The complete checkpoint with the highest step among ``directory``'s ``step-*`` children
    (incomplete or corrupt ones are skipped), or None."""
    directory = Path(directory)
    candidates = sorted(directory.glob("step-*"), reverse=True) if directory.is_dir() else []
    for p in candidates:
        try:
            read_manifest(p)
            return p
        except CheckpointError:
            continue
    return None


def checkpoint_candidates(path: str | Path, setting: str = "checkpoint.load_path") -> list[Path]:
    """The checkpoints ``path`` may mean, the one to try first first: ``[path]`` if it is a
    checkpoint (it has a manifest or DCP metadata, or is named ``step-*``), else the complete
    ones (manifest and file sizes checked) in it or in its ``checkpoints/``, newest first.
    Raises :class:`CheckpointError` naming ``setting`` (where the path came from) and the path
    when there is none."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{setting} = {str(path)!r} does not exist")
    if (path / MANIFEST).exists() or (path / ".metadata").exists() or path.name.startswith("step-"):
        read_manifest(path)
        return [path]
    for d in (path, path / "checkpoints"):
        complete = [p for p in sorted(d.glob("step-*"), reverse=True) if _is_complete(p)] if d.is_dir() else []
        if complete:
            return complete
    raise CheckpointError(f"{setting} = {str(path)!r} holds no complete checkpoint (step-* with {MANIFEST})")


def _is_complete(path: Path) -> bool:
    try:
        read_manifest(path)
        return True
    except CheckpointError:
        return False


def resolve_checkpoint(path: str | Path, setting: str = "checkpoint.load_path") -> Path:
    """``path`` itself if it is a checkpoint (it has a manifest or DCP metadata), else the latest
    complete checkpoint in it or in its ``checkpoints/``. Raises :class:`CheckpointError` naming
    ``setting`` (where the path came from) and the path."""
    return checkpoint_candidates(path, setting)[0]


def _hf_files(cfg) -> dict[str, bytes]:
    """What a checkpoint of job ``cfg`` keeps in ``hf/`` for an export, by file name: the job's
    Hugging Face tokenizer (``data.tokenizer_path``, as ``tokenizer.json``) and the other
    :data:`TOKENIZER_FILES` beside it, and ``checkpoint.initial_load_hf``'s ``config.json``. Small
    files (kilobytes to tens of MB). Raises :class:`CheckpointError` naming the setting and the
    file that cannot be read."""
    from ray_titan import storage

    wanted: list[tuple[str, str, str, bool]] = []  # (name in hf/, file, setting, required)
    tokenizer = cfg.data.tokenizer_path if cfg.data.tokenizer == "huggingface" else None
    if tokenizer:
        wanted.append((TOKENIZER_FILES[0], tokenizer, "data.tokenizer_path", True))
        wanted += [(n, storage.sibling(tokenizer, n), "data.tokenizer_path", False) for n in TOKENIZER_FILES[1:]]
    if cfg.checkpoint.initial_load_hf:
        wanted.append(("config.json", storage.join(cfg.checkpoint.initial_load_hf, "config.json"),
                       "checkpoint.initial_load_hf", True))
    out = {}
    for name, file, setting, required in wanted:
        bound, what = ((storage.MAX_TOKENIZER_BYTES, "MAX_TOKENIZER_BYTES") if name == TOKENIZER_FILES[0]
                       else (storage.MAX_CONFIG_BYTES, "MAX_CONFIG_BYTES"))
        try:
            if required or storage.exists(file):
                out[name] = storage.read_bytes(file, bound, what)
        except Exception as e:
            raise CheckpointError(f"{setting}: cannot read {file} to keep it in the checkpoints (for "
                                  f"ray-titan export): {type(e).__name__}: {e}") from None
    return out


def _job_manifest(cfg, vocab_size: int) -> dict[str, Any]:
    p = cfg.parallelism
    return {
        # tp and dp_replicate only where they exist: a mesh without them reads as before.
        "mesh": {"pp": p.pp, "dp_shard": p.dp_shard, "stages_per_rank": p.stages_per_rank,
                 **{a: getattr(p, a) for a in ("dp_replicate", "tp") if getattr(p, a) > 1}},
        "world_size": cfg.world_size,
        "model": {"name": cfg.model.name, "flavor": cfg.model.flavor, "vocab_size": vocab_size},
        "optimizer": cfg.optimizer.name,
        "data": {"source": cfg.data.source, "path": cfg.data.path, "text_column": cfg.data.text_column,
                 "tokenizer": cfg.data.tokenizer, "seed": cfg.training.seed,
                 # Only where set, so that checkpoints of a single text source stay loadable.
                 **({"format": cfg.data.format} if cfg.data.format != "text" else {}),
                 **({"sources": [s.model_dump() for s in cfg.data.sources]} if cfg.data.sources else {})},
        "total_steps": cfg.training.steps,
    }


def check_compatible(manifest: dict[str, Any], cfg, vocab_size: int, path: str | Path, model_only: bool) -> None:
    """Refuse a checkpoint DCP cannot load into this job: another model or vocabulary (tensor
    shapes differ), another optimizer (its state differs), other data (the saved position would
    be meaningless), or no steps left. Any mesh is fine: DCP reshards. Raises
    :class:`CheckpointError`."""
    here = _job_manifest(cfg, vocab_size)
    if manifest["model"] != here["model"]:
        raise CheckpointError(
            f"checkpoint {path} holds model {manifest['model']}, this job builds {here['model']}: "
            "DCP reshards across meshes, not across model shapes; use the same model.name, model.flavor and tokenizer"
        )
    if model_only:
        return
    if manifest["format"] == 1:
        raise CheckpointError(
            f"checkpoint {path} was saved by an earlier ray_titan (format 1), which stored the data position "
            "as unread tokens; take its weights with checkpoint.load_model_only = true"
        )
    if manifest["optimizer"] != here["optimizer"]:
        raise CheckpointError(
            f"checkpoint {path} holds {manifest['optimizer']} optimizer state, this job uses "
            f"optimizer.name = {here['optimizer']!r}; use the same optimizer or checkpoint.load_model_only = true"
        )
    if manifest["data"] != here["data"]:
        raise CheckpointError(
            f"checkpoint {path} was saved reading data {manifest['data']}, this job reads {here['data']}: "
            "the saved data position would not apply; use the same data settings and training.seed, "
            "or checkpoint.load_model_only = true"
        )
    if manifest["step"] >= cfg.training.steps:
        raise CheckpointError(
            f"checkpoint {path} is at step {manifest['step']} but training.steps = {cfg.training.steps}: "
            "nothing left to train; raise training.steps"
        )
