"""The :class:`Checkpointer`: saves and restores this rank's share of the training state (model,
optimizer, scheduler, data position, RNG) with DCP, writing the manifest last."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ray_titan.checkpoint.manifest import (
    FORMAT,
    HF_DIR,
    MANIFEST,
    CheckpointError,
    _file_entries,
    _hf_files,
    _job_manifest,
    check_compatible,
    read_manifest,
    resolve_checkpoint,
    saved_reports,
)
from ray_titan.checkpoint.unpickler import SafeFileSystemReader, SafeLoadPlanner, check_metadata, load_metadata
from ray_titan.parallel.finite import all_finite

_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelParts(nn.Module):
    """This rank's pipeline stages seen as one module with the whole model's parameter names.

    Stage modules are copies of the whole model with the absent parts removed; their
    ``ModuleDict`` children (``layers``) are merged and the other children (embedding, norm,
    head) taken from the stage that has them. Holds references only.
    """

    def __init__(self, stages: Iterable[nn.Module]):
        super().__init__()
        for stage in stages:
            for name, child in stage.named_children():
                if isinstance(child, nn.ModuleDict):
                    if name not in self._modules:
                        self.add_module(name, nn.ModuleDict())
                    # ModuleDict.update accepts a ModuleDict at runtime; torch annotates it Mapping only.
                    cast(nn.ModuleDict, self._modules[name]).update(child)  # type: ignore[arg-type]
                elif self._modules.get(name, child) is not child:
                    raise ValueError(f"two pipeline stages on this rank both hold {name!r}")
                else:
                    self.add_module(name, child)



def _write_failure(step: int, write_dir: Path, e: BaseException, rank: int = 0) -> str:
    """Why writing checkpoint files failed, in words, for ``rank``'s message.

    ``e`` may be DCP's :class:`CheckpointException`, which collects every failed rank's error:
    this rank's own is reported if it has one, else the lowest failed rank's (named). torch's zip
    writer reports a full disk as "unexpected pos" (the ``OSError`` with ``ENOSPC`` is only its
    ``__context__``, and lost when DCP sends it to another rank), so the error chain is searched
    for an ``OSError`` and the free space at ``write_dir`` is measured and said."""
    where = ""
    if isinstance(e, CheckpointException) and e.failures:
        failed = rank if rank in e.failures else min(e.failures)
        where = "" if failed == rank else f" on rank {failed}"
        e = e.failures[failed][0]
    seen: list[BaseException] = []
    link: BaseException | None = e
    while link is not None and link not in seen:  # __cause__/__context__ may form a cycle
        seen.append(link)
        link = link.__cause__ or link.__context__
    e = next((x for x in seen if isinstance(x, OSError) and x.strerror), e)
    cause = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).strip().splitlines() or [""])[-1]
    head = f"step {step}: writing the checkpoint to {write_dir} failed{where}: {type(e).__name__}: {cause}"
    try:
        free = shutil.disk_usage(next(p for p in (write_dir, *write_dir.parents) if p.exists())).free
    except (OSError, StopIteration):
        return head
    full = "; the filesystem is full" if free < (1 << 20) else ""
    return f"{head} ({free / 2**20:.1f} MiB free there{full})"


def _broadcast(obj: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


class Checkpointer:
    """Saves and restores this rank's share of the training state.

    Args:
        cfg: the job. ``stages``: this rank's stage modules. ``loader``: a ``PackedLoader``.
        reporter: the metrics reporter (its unacknowledged reports go into each checkpoint).
        storage: :class:`RayTrainCheckpointStorage`, :class:`LocalCheckpointStorage`, or None
            (no checkpoints saved; ``checkpoint.load_path`` is still honoured).
        vocab_size: the tokenizer's, recorded in the manifest.
    """

    def __init__(self, cfg, rank: int, stages: Iterable[nn.Module], optimizer, scheduler, loader,
                 reporter, storage, vocab_size: int, device: torch.device):
        self.cfg, self.rank = cfg, rank
        stages = list(stages)
        self.parts = ModelParts(stages)
        self.optimizer, self.scheduler, self.loader = optimizer, scheduler, loader
        self.reporter, self.storage, self.device = reporter, storage, device
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.job = _job_manifest(cfg, vocab_size)
        # What an export to Hugging Face needs (ray_titan.checkpoint.hf_export): the model's arguments (a Hugging
        # Face checkpoint's sizes are no flavor), the tokenizer files, the imported config.json.
        args = getattr(stages[0], "args", None) if stages else None
        if dataclasses.is_dataclass(args) and not isinstance(args, type):
            self.job["model_args"] = dataclasses.asdict(args)
        self.job["tokenizer_path"] = cfg.data.tokenizer_path
        self.job["initial_load_hf"] = cfg.checkpoint.initial_load_hf
        # Read once, here: each checkpoint keeps a copy (export takes nothing from outside it).
        self.hf_files: dict[str, bytes] = {}
        if rank == 0 and storage is not None and cfg.checkpoint.enable:
            try:  # rank 0 alone reads them: raising here would leave the other ranks waiting
                self.hf_files = _hf_files(cfg)
            except CheckpointError as e:
                print(f"ray_titan: warning: {e}; the checkpoints carry no hf/ files, and an export of "
                      "them has no tokenizer", flush=True)
        self.resumed_from: str | None = None
        self.restarted = False
        """True when this worker group resumed its own run's checkpoint (a restart)."""

    # -- state dicts -------------------------------------------------------------------------
    def _state(self, step: int, model_only: bool, same_mesh: bool,
               metadata: Metadata | None = None) -> dict[str, Any]:
        sd: dict[str, Any] = {f"model.{k}": v for k, v in get_model_state_dict(self.parts).items()}
        if model_only:
            return sd
        osd = get_optimizer_state_dict(self.parts, self.optimizer, options=_OPTIM_OPTIONS)
        sd.update({f"optimizer.{k}": v for k, v in osd.items()})
        sd.update({f"lr_scheduler.{k}": v for k, v in self.scheduler.state_dict().items()})
        for k, v in self.loader.state_dict().items():  # ints, and arrays whose length varies
            key = f"dataloader.{k}"
            if isinstance(v, np.ndarray):
                v = torch.from_numpy(v)
                md = metadata.state_dict_metadata.get(key) if metadata is not None else None
                if isinstance(md, TensorStorageMetadata):  # size the slot from the checkpoint
                    v = torch.empty(md.size, dtype=v.dtype)
            sd[key] = v
        sd["train.step"] = step
        if same_mesh:
            sd.update(_rng_state(self.rank, self.device))
        return sd

    # -- save ------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether ``step`` is a checkpoint step: every ``checkpoint.interval`` and the last."""
        c = self.cfg.checkpoint
        return self.storage is not None and c.enable and (step % c.interval == 0 or step == self.cfg.training.steps)

    def save(self, step: int) -> None:
        """Write the state after ``step`` (every rank calls this at the same step). Raises
        :class:`CheckpointError`, writing nothing, if a parameter or optimizer state is not finite
        on some rank: such a checkpoint could only resume a broken run. Raises
        :class:`CheckpointError` on every rank, after removing this rank's files, when writing fails
        on any rank (the message names the directory, the cause and the MiB free there)."""
        state = self._state(step, False, True)
        if not all_finite([v for k, v in state.items() if k.startswith(("model.", "optimizer.state."))
                           and isinstance(v, torch.Tensor)], self.device):
            raise CheckpointError(f"step {step}: parameters or optimizer state are not finite; no checkpoint written")
        write_dir = self.storage.begin(step, self.rank)
        try:
            dcp.save(state, storage_writer=FileSystemWriter(str(write_dir)), no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as err:
            # DCP raises CheckpointException (a BaseException) on every rank when any rank fails.
            own = err.failures.get(self.rank) if isinstance(err, CheckpointException) else None
            interrupted = own is not None and not isinstance(own[0], Exception)
            why = "" if interrupted else _write_failure(step, write_dir, err, self.rank)  # free space before removal
            shutil.rmtree(write_dir, ignore_errors=True)  # its space goes back to the metrics
            if own is not None and interrupted:
                raise own[0] from err  # this rank was interrupted (KeyboardInterrupt, SystemExit)
            raise CheckpointError(why) from err
        reports = self.reporter.unacknowledged() if hasattr(self.reporter, "unacknowledged") else []
        why = ""
        try:
            rdir = write_dir / "reports"
            rdir.mkdir(parents=True, exist_ok=True)
            (rdir / f"rank{self.rank}.json").write_text(json.dumps(reports))
            for name, data in self.hf_files.items():  # rank 0's only; listed in the manifest like the rest
                (write_dir / HF_DIR).mkdir(exist_ok=True)
                (write_dir / HF_DIR / name).write_bytes(data)
        except OSError as err:
            why = _write_failure(step, write_dir, err, self.rank)
        if self.world > 1:  # every rank learns of a failed write, or the others would wait in the gather
            failed = torch.tensor([1.0 if why else 0.0], device=self.device)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if failed.item() and not why:
                why = f"step {step}: another rank could not write its files of this checkpoint; nothing kept"
        if why:
            shutil.rmtree(write_dir, ignore_errors=True)
            raise CheckpointError(why)
        entries = {} if self.storage.shared else _file_entries(write_dir)
        gathered: list[Any] | None = [entries]
        if self.world > 1:
            gathered = [None] * self.world if self.rank == 0 else None
            dist.gather_object(entries, gathered, dst=0)
        if self.rank == 0:
            files: dict[str, Any] = {}
            if self.storage.shared:
                files = _file_entries(write_dir)
            else:
                assert gathered is not None  # rank 0 gathers every rank's entries
                for e in gathered:
                    files.update(e)
            manifest = {"format": FORMAT, "step": step, "saved_at": time.time(), **self.job, "files": files}
            tmp = write_dir / (MANIFEST + ".tmp")
            tmp.write_text(json.dumps(manifest, indent=1))
            os.replace(tmp, write_dir / MANIFEST)
        if self.world > 1 and self.storage.shared:
            dist.barrier()
        self.storage.commit(step, write_dir, self.rank, {"step": step})

    # -- restore ---------------------------------------------------------------------------------
    def restore(self) -> int:
        """Load the checkpoint this run starts from, if any, and return its step (0: none).

        A restarted worker group resumes its own run's latest checkpoint (from Ray Train);
        otherwise ``checkpoint.load_path``. Raises :class:`CheckpointError` for a missing,
        incomplete, corrupt or unfitting checkpoint.
        """
        own = self.storage.resume_from() if self.storage is not None else None
        if own is not None:
            with own.as_directory() as d:
                return self._load(Path(d), model_only=False, own=True)
        if self.cfg.checkpoint.load_path:
            path = resolve_checkpoint(self.cfg.checkpoint.load_path)
            return self._load(path, model_only=self.cfg.checkpoint.load_model_only, own=False)
        return 0

    def _load(self, path: Path, model_only: bool, own: bool) -> int:
        problem = None
        if self.rank == 0:  # one check, shared with every rank
            try:
                # CRC-32 of every file: pre-flight did it for checkpoint.load_path; a restarted
                # worker group's own checkpoint is checked here, once, on rank 0.
                manifest = read_manifest(path, verify_checksums=own)
                check_metadata(load_metadata(path), path, manifest["files"])
                check_compatible(manifest, self.cfg, self.job["model"]["vocab_size"], path, model_only or own)
            except CheckpointError as e:
                problem = str(e)
        problem = _broadcast(problem)
        if problem:
            raise CheckpointError(problem)
        manifest = read_manifest(path)
        same_mesh = manifest["mesh"] == self.job["mesh"]
        reader = SafeFileSystemReader(str(path))
        metadata = reader.read_metadata()
        sd = self._state(0, model_only, same_mesh, metadata)
        # A checkpoint saved on CPU holds no CUDA generator state: not a reason to refuse it.
        reseed = _drop_missing_device_rng(sd, metadata.state_dict_metadata, self.rank)
        # A last stage's copies of the embedding that the saving layout did not hold: read as it.
        copies = _EmbeddingCopies(sd, metadata)
        _check_keys(sd, metadata, path)
        try:
            dcp.load(sd, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=not dist.is_initialized())
        except CheckpointError:
            raise
        except Exception as e:  # a layout DCP cannot reshard into this mesh
            raise CheckpointError(
                f"checkpoint {path} (saved on mesh {manifest['mesh']}) could not be loaded into this job's mesh "
                f"{self.job['mesh']}: {e}; load it on the mesh that saved it, or with checkpoint.load_model_only = true"
            ) from e
        copies.fill(sd)
        if not all_finite([v for k, v in sd.items() if k.startswith("model.") and isinstance(v, torch.Tensor)],
                          self.device):
            raise CheckpointError(f"checkpoint {path} holds non-finite model weights; load an earlier checkpoint")
        set_model_state_dict(self.parts, {k[6:]: v for k, v in sd.items() if k.startswith("model.")})
        self.resumed_from, self.restarted = str(path), own
        if model_only:
            return 0
        set_optimizer_state_dict(self.parts, self.optimizer,
                                 {k[10:]: v for k, v in sd.items() if k.startswith("optimizer.")},
                                 options=_OPTIM_OPTIONS)
        self.scheduler.load_state_dict({k[13:]: v for k, v in sd.items() if k.startswith("lr_scheduler.")})
        self.loader.load_state_dict({k[len("dataloader."):]: v.numpy() if isinstance(v, torch.Tensor) else v
                                     for k, v in sd.items() if k.startswith("dataloader.")})
        if same_mesh:
            _restore_rng(sd, self.rank, self.device, self.cfg.training.seed, int(sd["train.step"]))
            if reseed and self.rank == 0:
                print(f"ray_titan: checkpoint {path} was saved on CPU and holds no CUDA generator state: each "
                      "rank's CUDA generator is seeded from training.seed, the step and the rank (random ops on "
                      "the GPU, e.g. dropout, do not continue the saved run's stream)", file=sys.stderr, flush=True)
        if own and hasattr(self.reporter, "resend"):  # same run: metrics not yet on disk at the save
            world = dist.get_world_size() if dist.is_initialized() else 1
            saved = saved_reports(path)
            # An elastic group that shrank: rank 0 delivers the lost ranks' reports too.
            ranks = [self.rank] + ([r for r in saved if r >= world] if self.rank == 0 else [])
            for r in ranks:
                if saved.get(r):
                    self.reporter.resend(saved[r])
        return int(sd["train.step"])


def _rng_state(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's random generator states as a checkpoint keeps them: ``rng.rank<r>.cpu``
    (``torch.get_rng_state``), and ``rng.rank<r>.cuda`` when ``device`` is a CUDA device."""
    sd = {f"rng.rank{rank}.cpu": torch.get_rng_state()}
    if device.type == "cuda":
        sd[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state(device)
    return sd


def _drop_missing_device_rng(sd: dict[str, Any], saved: Any, rank: int) -> bool:
    """Remove the CUDA generator key from the state ``sd`` to load when the checkpoint (whose
    keys are ``saved``) lacks it, as one saved on CPU does; True if removed. The opposite case
    needs nothing: a CUDA checkpoint loaded on CPU has a key ``sd`` does not ask for, and DCP
    loads only the keys asked for."""
    key = f"rng.rank{rank}.cuda"
    if key in sd and key not in saved:
        del sd[key]
        return True
    return False


def _device_rng_seed(seed: int, step: int, rank: int) -> int:
    """The CUDA generator seed of ``rank`` resuming at ``step`` from a checkpoint that holds no
    CUDA generator state: deterministic in (``training.seed``, step, rank), distinct per rank."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1, np.uint64)[0])


def _restore_rng(sd: dict[str, Any], rank: int, device: torch.device, seed: int, step: int) -> None:
    """Set this rank's generators from a loaded state (:func:`_rng_state`'s keys): the CPU one
    always; on CUDA the CUDA one from its saved state, or, when the checkpoint has none (saved
    on CPU), seeded with :func:`_device_rng_seed`."""
    torch.set_rng_state(sd[f"rng.rank{rank}.cpu"])
    if device.type != "cuda":
        return
    key = f"rng.rank{rank}.cuda"
    if key in sd:
        torch.cuda.set_rng_state(sd[key], device)
    else:
        with torch.cuda.device(device):
            torch.cuda.manual_seed(_device_rng_seed(seed, step, rank))


class _EmbeddingCopies:
    """A last pipeline stage's copies of the token embedding (a tied model's output head,
    ``output.weight``; multi-token prediction's ``mtp_embeddings.weight``:
    ``ray_titan.parallel.pipeline.build_stage_module``) are kept equal to it
    (``ray_titan.parallel.tied``), so a checkpoint saved on a layout without them (no pipeline, or
    the copy's stage also held the embedding) holds them as the embedding only. Each value of
    such a copy that the checkpoint lacks (its weight, its optimizer state ``optimizer.state.<fqn>.*``
    and settings ``optimizer.param_groups.<fqn>.*``) is read from the embedding's: built before
    the load, it puts the copy's slot in ``sd`` under the embedding's key where ``sd`` has none
    (DCP fills it in place, resharded to the copy's layout), else sets it aside;
    :meth:`fill` after the load puts every copy back, the set-aside ones equal to the embedding's
    loaded value."""

    EMBEDDING = "tok_embeddings.weight"
    COPIES = ("output.weight", "mtp_embeddings.weight")
    PREFIXES = ("model.", "optimizer.state.", "optimizer.param_groups.")

    def __init__(self, sd: dict[str, Any], metadata: Metadata):
        have = metadata.state_dict_metadata
        self.source: dict[str, str] = {}  # a copy's key -> the embedding's key it is read from
        for key in [k for k in sd if k not in have]:
            for prefix in self.PREFIXES:
                for copy in self.COPIES:
                    rest = key.removeprefix(prefix + copy)
                    if key.startswith(prefix) and rest != key and rest[:1] in ("", ".") \
                            and prefix + self.EMBEDDING + rest in have:
                        self.source[key] = prefix + self.EMBEDDING + rest
        self.renamed: dict[str, str] = {}  # the embedding's key -> the copy's loaded under it
        self.aside: dict[str, Any] = {}  # a copy's key -> its value, equal to its source after the load
        for key, src in self.source.items():
            if src in sd:
                self.aside[key] = sd.pop(key)
            else:
                self.renamed[src] = key
                sd[src] = sd.pop(key)

    @torch.no_grad()
    def fill(self, sd: dict[str, Any]) -> None:
        """After the load: every copy back under its own key, loaded."""
        for key, value in self.aside.items():
            loaded = sd[self.source[key]]
            if isinstance(value, torch.Tensor):
                value.copy_(loaded)  # in place: the copy's own tensor (its DTensor layout)
                sd[key] = value
            else:  # a param group's setting (lr, betas)
                sd[key] = loaded
        for src, key in self.renamed.items():
            sd[key] = sd.pop(src)


def _check_keys(sd: dict[str, Any], metadata: Metadata, path: Path) -> None:
    """Every value this job needs is in the checkpoint with the same shape (clear errors where
    DCP's own would be obscure)."""
    have = metadata.state_dict_metadata
    missing = [k for k in sd if k not in have]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} value(s) this job needs: {shown}")
    for k, v in sd.items():
        md = have[k]
        if isinstance(v, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint {path}: {k} is not a tensor in the checkpoint")
            if tuple(md.size) != tuple(v.shape):
                raise CheckpointError(
                    f"checkpoint {path}: {k} has shape {tuple(md.size)} in the checkpoint, {tuple(v.shape)} in this job"
                )
