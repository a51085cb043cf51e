"""Pre-flight checks: everything the driver (or the launcher) verifies before any worker starts.

The schema (:mod:`ray_titan.config.schema`) checks each setting alone; this module checks the job
as a whole against the things it names: the mesh against the worker count, the model (from the
registry) against the pipeline, the batch against microbatches and data-parallel degree, the data
files and tokenizer, the checkpoint to load, the callbacks and the allocator. It imports the data,
model, checkpoint and callback modules, which is why it lives outside the schema (the schema
depends on nothing of the project).

Every error is a :class:`~ray_titan.config.schema.ConfigError` naming the setting, its value and
what would be valid.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from ray_titan import storage
from ray_titan.allocator import worker_env_vars
from ray_titan.callbacks import resolve_callback
from ray_titan.checkpoint import (
    CheckpointError,
    HFCheckpointError,
    check_compatible,
    check_hf_checkpoint,
    check_metadata,
    checkpoint_candidates,
    job_model_args,
    load_metadata,
    read_manifest,
)
from ray_titan.config.schema import ConfigError, JobConfig
from ray_titan.data.build import source_settings, training_documents, validation_documents
from ray_titan.data.corpus import check_source
from ray_titan.data.ray_data import dataset_format
from ray_titan.data.sft import ChatTemplate, find_chat_template
from ray_titan.data.tokenizer import build_tokenizer
from ray_titan.models.registry import MODELS, get_spec, is_moe
from ray_titan.parallel.elastic import fitting_worker_counts, is_elastic, mesh_for_workers
from ray_titan.parallel.schedules import SCHEDULES

__all__ = ["job_warnings", "validate_job"]


def job_warnings(cfg: JobConfig) -> list[str]:
    """Settings that are valid but probably not what was meant (the driver prints them)."""
    out = []
    if cfg.lr_scheduler.warmup_steps >= cfg.training.steps:
        out.append(
            f"lr_scheduler.warmup_steps = {cfg.lr_scheduler.warmup_steps} is not below training.steps "
            f"= {cfg.training.steps}: the learning rate never reaches optimizer.lr = {cfg.optimizer.lr:g}"
        )
    if cfg.memory.activation_offload != "none" and not cfg.ray.use_gpu:
        out.append(
            f"memory.activation_offload = {cfg.memory.activation_offload!r} with ray.use_gpu = false: the "
            "activations are in host memory already, so its hooks move nothing (they only count)"
        )
    return out


def _check_dump_folder(cfg: JobConfig) -> None:
    """``job.dump_folder`` takes a probe file (written and removed) within ``job.storage_timeout_s``."""
    dump = cfg.job.dump_folder
    if storage.is_remote(dump) and cfg.metrics.save_rank_reports:
        raise ConfigError(
            f"metrics.save_rank_reports = true writes local files on every worker, but job.dump_folder "
            f"= {dump!r} is remote; use a local or shared-filesystem dump_folder, or set it to false"
        )
    try:
        storage.check_writable(dump, cfg.job.storage_timeout_s)
    except storage.StorageError as e:
        where = "" if e.where == dump else f" ({e.where})"
        raise ConfigError(
            f"job.dump_folder = {dump!r}{where}: {e.cause}; use a writable local path, or a URI of a filesystem "
            "pyarrow supports (file://, s3://, gs://, hdfs://, abfs://) that answers within "
            f"job.storage_timeout_s = {cfg.job.storage_timeout_s:g} s, with credentials in the environment"
        ) from None


def _probe_locations(cfg: JobConfig, check_data: bool) -> None:
    """Every remote location the job reads answers within ``job.storage_timeout_s``
    (:func:`ray_titan.storage.probe_location`: a child process, so an unreachable bucket cannot
    hang pre-flight): ``checkpoint.initial_load_hf`` always (the model's sizes come from it), and
    with ``check_data`` the data, tokenizer, validation and checkpoint paths. Local paths cost
    nothing here. Raises :class:`ConfigError` naming the setting and the location."""
    named: list[tuple[str, str | None]] = [("checkpoint.initial_load_hf", cfg.checkpoint.initial_load_hf)]
    if check_data:
        named += [("checkpoint.load_path", cfg.checkpoint.load_path), ("data.path", cfg.data.path),
                  *((f"data.sources[{i}].path", s.path) for i, s in enumerate(cfg.data.sources)),
                  ("data.tokenizer_path", cfg.data.tokenizer_path),
                  ("validation.path", cfg.validation.path if cfg.validation.enable else None)]
    for setting, location in named:
        if location:
            storage.probe_location(setting, location, cfg.job.storage_timeout_s)


def validate_job(cfg: JobConfig, check_data: bool = True, has_dataset: bool = False) -> JobConfig:
    """Cross-field checks the driver runs before any worker starts.

    Checks the mesh against the worker count, the model against the pipeline, the batch against
    microbatches and DP degree, the sequence length against the model, that the data source(s)
    exist and have the columns ``data.format`` reads, the validation settings, that the run
    directory can be written, and that the checkpoint to load is complete (CRC-32 of every
    file), holds metadata the restricted unpickler accepts, and fits the job. ``check_data =
    False`` leaves out what reads or writes files (data, tokenizer, run directory, checkpoint to
    load): the memory plan checks a job that may run elsewhere. ``has_dataset``: the driver was
    given a ``ray.data.Dataset`` (``data.source = "ray_data"`` without a path). Raises
    :class:`ConfigError` naming the setting, its value and what would be valid.

    Returns ``cfg``, with ``checkpoint.load_path`` made the checkpoint it resolved to (a run
    directory's newest good one: a corrupt newer one is passed over with a warning), so the
    workers load the checkpoint checked here and verify nothing again.
    """
    _check_settings(cfg)
    _check_workers(cfg)
    _probe_locations(cfg, check_data)
    if check_data:
        _check_dump_folder(cfg)
    _check_extras(cfg)
    margs = _model_args(cfg)
    _check_expert_parallel(cfg, margs)
    _check_mtp(cfg, margs)
    _check_schedule(cfg)
    _check_tensor_parallel(cfg, margs)
    _check_document_mask(cfg, margs)
    _check_context_parallel(cfg, margs)
    _check_pipeline(cfg, margs)
    _check_batch(cfg, margs)
    _validate_memory(cfg)
    if not check_data:
        return cfg
    return _check_files(cfg, has_dataset)


def _check_workers(cfg: JobConfig) -> None:
    """The worker count against the mesh (or the elastic range), restarts against checkpointing,
    and the rank ``debug.kill_rank`` names against the mesh."""
    par = cfg.parallelism
    axes = [a for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if a in ("pp", "dp_shard") or getattr(par, a) > 1]
    mesh = (" × ".join(f"parallelism.{a}" for a in axes) + " = " + " × ".join(str(getattr(par, a)) for a in axes)
            + f" = {cfg.world_size}")
    if is_elastic(cfg):
        _check_elastic(cfg, mesh)
    elif cfg.ray.num_workers is not None and cfg.ray.num_workers != cfg.world_size:
        raise ConfigError(
            f"ray.num_workers = {cfg.ray.num_workers} but the mesh needs {mesh} workers; "
            f"set ray.num_workers = {cfg.world_size} (or leave it unset) or change the mesh"
        )
    if cfg.ray.max_failures and not cfg.checkpoint.enable:
        raise ConfigError(
            f"ray.max_failures = {cfg.ray.max_failures} with checkpoint.enable = false: a restarted "
            "worker group would start again from step 1; set checkpoint.enable = true or ray.max_failures = 0"
        )
    if cfg.debug.kill_at_step is not None and cfg.debug.kill_rank >= cfg.world_size:
        raise ConfigError(
            f"debug.kill_rank = {cfg.debug.kill_rank} but the mesh has ranks 0..{cfg.world_size - 1}"
        )


def _check_extras(cfg: JobConfig) -> None:
    """Settings that need a package not installed (wandb) or that the data source ignores."""
    if cfg.metrics.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "metrics.wandb = true but the wandb package is not installed; install it with "
            "pip install 'ray-titan[wandb]' (or pip install wandb), or set metrics.wandb = false"
        )
    if cfg.data.source == "python_stdlib" and cfg.data.path and not cfg.data.sources:
        raise ConfigError(
            f"data.path = {cfg.data.path!r} is set but data.source = 'python_stdlib' ignores it; "
            "set data.source = 'parquet' or 'jsonl' to train on it"
        )


def _check_expert_parallel(cfg: JobConfig, margs: Any) -> None:
    """``parallelism.ep > 1`` needs a mixture-of-experts model, an ep dividing dp_shard and an ep
    dividing the routed experts."""
    par = cfg.parallelism
    if par.ep > 1:
        if not is_moe(cfg.model.name):
            raise ConfigError(
                f"parallelism.ep = {par.ep} but model.name = {cfg.model.name!r} has no experts; "
                f"use ep = 1 or a mixture-of-experts model ({', '.join(n for n in MODELS if is_moe(n))})"
            )
        if par.dp_shard % par.ep:
            raise ConfigError(
                f"parallelism.ep = {par.ep} must divide parallelism.dp_shard = {par.dp_shard} "
                "(expert parallelism borrows its ranks from dp_shard only, never from tp, cp, dp_replicate "
                "or pp: ray_titan.parallel.dims); use an ep that divides dp_shard"
            )
        if margs.n_routed_experts % par.ep:
            raise ConfigError(
                f"parallelism.ep = {par.ep} does not divide the {margs.n_routed_experts} routed experts "
                f"of {cfg.model.name}/{cfg.model.flavor}; use a divisor of {margs.n_routed_experts}"
            )


def _check_mtp(cfg: JobConfig, margs: Any) -> None:
    """``model.mtp_layers > 0`` needs a family that builds multi-token prediction, under
    ``parallelism.tp > 1`` one whose parallelize plans the MTP depths (``ModelSpec.mtp_tp``) and,
    importing a Hugging Face checkpoint, at least that many MTP depths in it (checked with its
    files, :func:`_check_hf`). Context parallelism is refused in :func:`_check_context_parallel`."""
    depths = cfg.model.mtp_layers
    if not depths:
        return
    spec = get_spec(cfg.model.name)
    if not spec.mtp:
        raise ConfigError(
            f"model.mtp_layers = {depths} but model.name = {cfg.model.name!r} builds no multi-token prediction; "
            f"use model.mtp_layers = 0 or a family that does ({', '.join(n for n in MODELS if get_spec(n).mtp)})"
        )
    if cfg.parallelism.tp > 1 and not spec.mtp_tp:
        raise ConfigError(
            f"model.mtp_layers = {depths} with parallelism.tp = {cfg.parallelism.tp}: {cfg.model.name}'s "
            "multi-token-prediction depths have no tensor-parallel plan yet; use parallelism.tp = 1, "
            f"model.mtp_layers = 0 or a family whose depths have one "
            f"({', '.join(n for n in MODELS if get_spec(n).mtp_tp)})"
        )
    most = getattr(margs, "max_mtp_layers", None)  # a family whose layout holds fewer depths (Qwen3.5: 1)
    if most is not None and depths > most:
        raise ConfigError(
            f"model.mtp_layers = {depths} but model.name = {cfg.model.name!r} builds at most {most} "
            f"multi-token-prediction depth(s); valid: 0 to {most}"
        )


def _check_pipeline(cfg: JobConfig, margs: Any) -> None:
    """At least one layer per pipeline stage, and the microbatch count the pipeline schedule needs."""
    par = cfg.parallelism
    if margs.n_layers < cfg.num_stages:
        raise ConfigError(
            f"model {cfg.model.name}/{cfg.model.flavor} has n_layers = {margs.n_layers}, fewer than "
            f"the {cfg.num_stages} pipeline stages (parallelism.pp × parallelism.stages_per_rank = "
            f"{par.pp} × {par.stages_per_rank}); each stage needs at least one layer"
        )
    schedule = SCHEDULES[par.pipeline_schedule]
    least = schedule.min_microbatches(par.pp)
    if par.pp > 1 and schedule.placement == "loop" and par.microbatches < least:
        raise ConfigError(
            f"parallelism.microbatches = {par.microbatches} is fewer than the {par.pp} pipeline "
            f"ranks (parallelism.pp): {par.pipeline_schedule} needs microbatches >= pp"
        )
    if schedule.rounds:
        rounds = max(1, par.microbatches // par.pp)
        if par.microbatches % rounds:
            raise ConfigError(
                f"parallelism.microbatches = {par.microbatches} with {par.pipeline_schedule} on pp = {par.pp}: "
                f"the schedule runs {rounds} rounds of {par.pp} microbatches and needs microbatches to "
                f"be a multiple of {rounds}; use {rounds * par.pp} or {par.pp}"
            )
    if schedule.placement == "v" and par.microbatches < least:
        raise ConfigError(
            f"parallelism.microbatches = {par.microbatches} with {par.pipeline_schedule} on pp = {par.pp}: "
            f"the schedule needs microbatches >= {least}; use {least} or more"
        )


def _check_batch(cfg: JobConfig, margs: Any) -> None:
    """The global batch splits evenly over microbatches × DP ranks; the sequence fits the model."""
    par, tr = cfg.parallelism, cfg.training
    dp_names = "parallelism.dp_replicate × parallelism.dp_shard" if par.dp_replicate > 1 else "parallelism.dp_shard"
    dp_sizes = f"{par.dp_replicate} × {par.dp_shard}" if par.dp_replicate > 1 else f"{par.dp_shard}"
    per_step = par.microbatches * par.dp_replicate * par.dp_shard
    if tr.global_batch_size % per_step:
        raise ConfigError(
            f"training.global_batch_size = {tr.global_batch_size} is not divisible by "
            f"parallelism.microbatches × {dp_names} = {par.microbatches} × {dp_sizes}"
            f" = {per_step}; use a multiple of {per_step}"
        )
    if tr.seq_len > margs.max_seq_len:
        raise ConfigError(
            f"training.seq_len = {tr.seq_len} exceeds the model's maximum sequence length "
            f"{margs.max_seq_len} ({cfg.model.name}/{cfg.model.flavor}); use <= {margs.max_seq_len}"
        )


def _check_files(cfg: JobConfig, has_dataset: bool) -> JobConfig:
    """What reads files: the data sources, the chat template, the validation data, the tokenizer
    (its ids against its vocabulary and the model's), the checkpoint to load and the Hugging Face
    checkpoint. Returns ``cfg`` with ``checkpoint.load_path`` resolved."""
    _check_sources(cfg, has_dataset)
    if cfg.data.format == "messages":
        ChatTemplate(find_chat_template(cfg.data))
    _validate_validation(cfg)
    try:
        tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    except Exception as e:  # a missing, unreadable or special-token-less tokenizer.json
        raise ConfigError(
            f"data.tokenizer = {cfg.data.tokenizer!r}, data.tokenizer_path = "
            f"{cfg.data.tokenizer_path!r}: {e}"
        ) from None
    if tokenizer.max_id >= tokenizer.vocab_size:
        raise ConfigError(
            f"data.tokenizer_path = {cfg.data.tokenizer_path!r}: the tokenizer has token id {tokenizer.max_id} but "
            f"reports a vocabulary of {tokenizer.vocab_size} (ids 0 .. {tokenizer.vocab_size - 1}), which sizes the "
            "model's embedding; renumber its vocabulary and added tokens without gaps"
        )
    _check_vocab(cfg, tokenizer.vocab_size)
    if cfg.checkpoint.load_path is not None:
        cfg = _check_load_path(cfg, tokenizer.vocab_size)
    _check_hf(cfg, tokenizer.vocab_size)
    return cfg


_NAME_MAX = 200  # the run directory adds "-<UTC stamp>" (23 characters); file names stop at 255 bytes


def _check_settings(cfg: JobConfig) -> None:
    """Settings that are well typed but cannot work, or would be silently ignored."""
    name = cfg.job.name
    bad = [c for c in name if c in "/\\" or ord(c) < 32 or ord(c) == 127]
    if not name or bad or len(name.encode()) > _NAME_MAX:
        why = (f"contains {bad[0]!r}" if bad else "is empty" if not name
               else f"is {len(name.encode())} bytes long")
        raise ConfigError(
            f"job.name = {name!r} {why}: the run directory is <dump_folder>/<job.name>-<timestamp>, so the name "
            f"must be one file name of at most {_NAME_MAX} bytes, without path separators or control characters; "
            "use letters, digits, '-', '_' or '.'"
        )
    if cfg.data.tokenizer == "byte" and cfg.data.tokenizer_path:
        raise ConfigError(
            f"data.tokenizer_path = {cfg.data.tokenizer_path!r} is set but data.tokenizer = 'byte' ignores it; "
            "set data.tokenizer = 'huggingface' to use that tokenizer.json, or remove tokenizer_path"
        )
    steps, d = cfg.training.steps, cfg.debug
    for setting, value in (("kill_at_step", d.kill_at_step), ("kill_collector_at_step", d.kill_collector_at_step)):
        if value is not None and value > steps:
            raise ConfigError(
                f"debug.{setting} = {value} is beyond the run's last step (training.steps = {steps}): the fault "
                f"would never be injected; use 1 .. {steps}"
            )
    outside = sorted(s for s in d.nonfinite_loss_at_steps if not 1 <= s <= steps)
    if outside:
        raise ConfigError(
            f"debug.nonfinite_loss_at_steps = {d.nonfinite_loss_at_steps}: step(s) {outside} are outside the run "
            f"(1 .. training.steps = {steps})"
        )


def _check_elastic(cfg: JobConfig, mesh: str) -> None:
    """``ray.num_workers = [min, max]``: a range whose ends a mesh fits, on a restartable job."""
    n = cfg.ray.num_workers
    assert isinstance(n, list)
    if len(n) != 2 or not 1 <= n[0] <= n[1]:
        raise ConfigError(f"ray.num_workers = {n}: an elastic range is [min, max] with 1 <= min <= max")
    if n[1] != cfg.world_size:
        raise ConfigError(
            f"ray.num_workers = {n}: max = {n[1]} must be the mesh's size, {mesh} (the largest mesh "
            f"the run may grow to); use [{n[0]}, {cfg.world_size}] or change the mesh"
        )
    fits = fitting_worker_counts(cfg)
    if mesh_for_workers(cfg, n[0]) is None:
        raise ConfigError(
            f"ray.num_workers = {n}: no mesh fits min = {n[0]} workers (pp = {cfg.parallelism.pp} and tp = "
            f"{cfg.parallelism.tp} stay; dp_replicate × dp_shard shrinks, microbatches × dp must divide "
            f"training.global_batch_size = {cfg.training.global_batch_size}); counts that fit: {fits}"
        )
    if not cfg.ray.max_failures or not cfg.checkpoint.enable:
        raise ConfigError(
            f"ray.num_workers = {n} (elastic) with ray.max_failures = {cfg.ray.max_failures} and "
            f"checkpoint.enable = {cfg.checkpoint.enable}: every resize restarts the worker group from the "
            "latest checkpoint; set ray.max_failures >= 1 and checkpoint.enable = true"
        )


def _model_args(cfg: JobConfig):
    """The job's model arguments (flavor, or the Hugging Face ``config.json``), as a ConfigError."""
    try:
        return job_model_args(cfg)
    except KeyError as e:
        raise ConfigError(str(e.args[0])) from None
    except HFCheckpointError as e:
        raise ConfigError(f"checkpoint.initial_load_hf = {cfg.checkpoint.initial_load_hf!r}: {e}") from None


def _check_hf(cfg: JobConfig, vocab_size: int) -> None:
    """``checkpoint.initial_load_hf``: config.json, tensor names, shapes and dtypes (from the
    safetensors headers) and the tokenizer's fit; ``last_save_hf`` needs checkpoints."""
    ck = cfg.checkpoint
    if ck.last_save_hf and not ck.enable:
        raise ConfigError("checkpoint.last_save_hf = true exports the final checkpoint, but checkpoint.enable = "
                          "false saves none; set checkpoint.enable = true")
    if not ck.initial_load_hf:
        return
    try:
        spec, args = check_hf_checkpoint(ck.initial_load_hf)
    except HFCheckpointError as e:
        raise ConfigError(f"checkpoint.initial_load_hf = {ck.initial_load_hf!r}: {e}") from None
    if vocab_size > args.vocab_size:
        path = cfg.data.tokenizer_path
        setting = f"data.tokenizer_path = {path!r}" if path else f"data.tokenizer = {cfg.data.tokenizer!r}"
        raise ConfigError(
            f"{setting}: its vocabulary ({vocab_size} tokens) does not fit the "
            f"model's embedding ({args.vocab_size} rows, vocab_size in {ck.initial_load_hf}/config.json); "
            "use the checkpoint's own tokenizer"
        )
    if spec.name != cfg.model.name:
        raise ConfigError(
            f"checkpoint.initial_load_hf = {ck.initial_load_hf!r} holds a {spec.name} model but model.name = "
            f"{cfg.model.name!r}: load the job with ray_titan.checkpoint.resolve_hf_job (the launchers do)"
        )
    held = getattr(args, "n_mtp_layers", 0)
    if cfg.model.mtp_layers > held:
        raise ConfigError(
            f"model.mtp_layers = {cfg.model.mtp_layers} but checkpoint.initial_load_hf = {ck.initial_load_hf!r} "
            f"holds {held} multi-token-prediction depth(s) (model.layers.<num_hidden_layers + k>.*); "
            f"valid: 0 to {held}"
        )


_MULTI_STAGE = tuple(name for name, s in SCHEDULES.items() if s.stages_per_rank != 1)


def _check_schedule(cfg: JobConfig) -> None:
    """The pipeline schedule against pp and stages_per_rank: the V-shaped schedules hold
    exactly two stages per rank, the interleaved ones two or more, the others one."""
    par = cfg.parallelism
    sched, spr = par.pipeline_schedule, par.stages_per_rank
    if sched not in _MULTI_STAGE:
        if spr != 1:
            raise ConfigError(
                f"parallelism.stages_per_rank = {spr} needs pipeline_schedule = "
                + ", ".join(repr(s) for s in _MULTI_STAGE)
                + f" (got {sched!r}); set stages_per_rank = 1"
            )
        return
    need = SCHEDULES[sched].stages_per_rank
    if need is not None:
        if spr != need:
            raise ConfigError(
                f"parallelism.stages_per_rank = {spr} with pipeline_schedule = {sched!r}: the V-shaped "
                "schedule holds exactly 2 stages per rank (pp rank r: stages r and 2·pp − 1 − r); "
                "set parallelism.stages_per_rank = 2"
            )
    elif spr < 2:
        raise ConfigError(
            f"parallelism.stages_per_rank = {spr} with pipeline_schedule = {sched!r}: the interleaved "
            "schedule needs >= 2 stages per rank; set parallelism.stages_per_rank = 2 or use '1F1B'"
        )
    if par.pp < 2:
        raise ConfigError(f"parallelism.pipeline_schedule = {sched!r} needs parallelism.pp >= 2, got pp = {par.pp}")


def _check_tensor_parallel(cfg: JobConfig, margs: Any) -> None:
    """What tensor parallel splits must be divisible by ``parallelism.tp``: attention heads (and
    Llama's kv heads), feed-forward hidden units (DeepSeek: dense, routed and shared experts'),
    and, under sequence parallel, the sequence."""
    par = cfg.parallelism
    tp = par.tp
    if tp == 1:
        return
    model = f"{cfg.model.name}/{cfg.model.flavor}"
    if (why := getattr(margs, "tp_unsupported", None)) is not None:  # gpt-oss
        raise ConfigError(f"parallelism.tp = {tp} is not supported for {model}: {why}; use parallelism.tp = 1 "
                          "(dp_shard, ep and pp split it instead)")
    sizes = {"n_heads": margs.n_heads}
    if hasattr(margs, "n_kv_heads"):  # Llama, Qwen3, Qwen3-MoE
        sizes.update(n_kv_heads=margs.n_kv_heads)
    if hasattr(margs, "ffn_hidden_dim"):  # dense Llama / Qwen3
        sizes.update(ffn_hidden_dim=margs.ffn_hidden_dim)
    if hasattr(margs, "n_routed_experts"):  # DeepSeek, Qwen3-MoE
        sizes.update(inter_dim=margs.inter_dim, moe_inter_dim=margs.moe_inter_dim,
                     shared_experts_hidden=margs.n_shared_experts * margs.moe_inter_dim)
    for name, n in sizes.items():
        if n % tp:
            divisors = [d for d in range(1, n + 1) if n % d == 0 and d <= 64]
            raise ConfigError(
                f"parallelism.tp = {tp} does not divide the model's {name} = {n} ({model}): tensor "
                f"parallel splits them over the tp ranks; use a tp among {divisors}"
            )
    if par.sequence_parallel and cfg.training.seq_len % tp:
        raise ConfigError(
            f"training.seq_len = {cfg.training.seq_len} is not divisible by parallelism.tp = {tp}: sequence "
            f"parallel splits the sequence over the tp ranks; use a multiple of {tp} or "
            "parallelism.sequence_parallel = false"
        )


def _check_document_mask(cfg: JobConfig, margs: Any) -> None:
    """``training.document_mask`` with a model that cannot keep packed documents apart (Qwen3.5's
    Gated DeltaNet layers carry a state along the whole sequence): refused, with the reason."""
    why = getattr(margs, "document_mask_unsupported", None)
    if cfg.training.document_mask and why is not None:
        raise ConfigError(f"training.document_mask = true is not supported for {cfg.model.name}/{cfg.model.flavor}: "
                          f"{why}; use training.document_mask = false")


def _check_context_parallel(cfg: JobConfig, margs: Any) -> None:
    """What context parallelism (``parallelism.cp``, ``ray_titan.parallel.context``) needs: a
    sequence the causal load balancer can cut into ``2·cp`` equal chunks (and each rank's share
    into ``tp`` under sequence parallel), a family whose attention it covers, and no multi-token
    prediction. Expert parallelism composes with it (``ep`` within ``dp_shard``, the routed experts
    FSDP-sharded over ``dp_shard / ep × cp``: ``ray_titan.parallel.dims``)."""
    par = cfg.parallelism
    cp = par.cp
    if cp == 1:
        return
    model = f"{cfg.model.name}/{cfg.model.flavor}"
    if (why := getattr(margs, "cp_unsupported", None)) is not None:  # gpt-oss, Qwen3-MoE's aux_loss
        raise ConfigError(f"parallelism.cp = {cp} is not supported for {model}: {why}; use parallelism.cp = 1 "
                          "(tp, activation checkpointing or memory.cpu_offload reduce activations instead)")
    seq = cfg.training.seq_len
    if seq % (2 * cp):
        multiple = 2 * cp * (par.tp if par.tp > 1 and par.sequence_parallel else 1)
        raise ConfigError(
            f"training.seq_len = {seq} is not divisible by 2 × parallelism.cp = {2 * cp}: the causal load "
            f"balancer cuts each sequence into 2·cp equal chunks (cp rank i keeps chunks i and 2·cp − 1 − i); "
            f"use a multiple of {multiple}, e.g. {-(-seq // multiple) * multiple}")
    if par.tp > 1 and par.sequence_parallel and (seq // cp) % par.tp:
        raise ConfigError(
            f"training.seq_len = {seq} / parallelism.cp = {cp} = {seq // cp} tokens a cp rank, not divisible by "
            f"parallelism.tp = {par.tp}: sequence parallel splits each cp rank's tokens over the tp ranks; use a "
            f"multiple of {2 * cp * par.tp} or parallelism.sequence_parallel = false")
    if cfg.model.mtp_layers:
        raise ConfigError(
            f"parallelism.cp = {cp} with model.mtp_layers = {cfg.model.mtp_layers}: multi-token prediction's "
            "depth-shifted tokens and labels cross the cp ranks' slices, which it does not exchange yet; use "
            "parallelism.cp = 1 or model.mtp_layers = 0")
    if par.ep > 1 and par.dp_replicate > 1 and _torch_before(2, 13):
        import torch

        raise ConfigError(
            f"parallelism.cp = {cp} with parallelism.ep = {par.ep} and parallelism.dp_replicate = {par.dp_replicate} "
            f"needs torch >= 2.13 (this is {torch.__version__}): before it DeviceMesh cannot slice the routed "
            "experts' (dp_replicate, dp_shard / ep × cp) mesh, whose flattened dimension is not contiguous; use "
            "parallelism.dp_replicate = 1 or torch >= 2.13")


def _torch_before(major: int, minor: int) -> bool:
    """Whether the installed torch is older than ``major.minor`` (read at each call), by torch's
    own version comparison (``torch.torch_version.TorchVersion``)."""
    import torch
    from torch.torch_version import TorchVersion

    return TorchVersion(torch.__version__) < f"{major}.{minor}"


def _check_vocab(cfg: JobConfig, vocab_size: int) -> None:
    """The embedding's vocabulary is split over the tp ranks in ``ceil(vocab / tp)`` rows a rank
    (``ray_titan.parallel.tp.VocabParallelEmbedding``), which must leave each rank some; with
    loss parallel the output head's is split too, evenly."""
    par = cfg.parallelism
    rows = -(-vocab_size // par.tp)
    if par.tp > 1 and rows * (par.tp - 1) >= vocab_size:
        raise ConfigError(
            f"parallelism.tp = {par.tp} leaves a tp rank no row of the embedding's vocabulary of {vocab_size} "
            f"tokens (data.tokenizer = {cfg.data.tokenizer!r}; ceil({vocab_size}/{par.tp}) = {rows} rows a rank); "
            "use a smaller tp or a larger vocabulary"
        )
    if par.tp > 1 and par.loss_parallel and vocab_size % par.tp:
        raise ConfigError(
            f"parallelism.tp = {par.tp} with parallelism.loss_parallel = true does not divide the vocabulary "
            f"of {vocab_size} tokens (data.tokenizer = {cfg.data.tokenizer!r}): loss parallel splits it over "
            "the tp ranks; use a tp that divides it, a tokenizer whose vocabulary it divides, or "
            "parallelism.loss_parallel = false"
        )


def _check_activation_offload(cfg: JobConfig) -> None:
    """``memory.activation_offload``: a block count within the model, not with ``training.compile``."""
    off = cfg.memory.activation_offload
    if off == "none":
        return
    if cfg.training.compile:
        raise ConfigError(
            f"memory.activation_offload = {off!r} with training.compile = true: the saved-tensor hooks "
            "would run inside the compiled blocks, where dynamo traces them (untested, and the copies "
            "could not overlap compute); use one of the two")
    schedule = cfg.parallelism.pipeline_schedule
    if cfg.parallelism.pp > 1 and SCHEDULES[schedule].zero_bubble:
        raise ConfigError(
            f"memory.activation_offload = {off!r} with pipeline_schedule = {schedule!r}: a zero-bubble "
            "schedule runs each backward in two parts over the same saved tensors, so the weight step "
            "copies them back from the host a second time, unprefetched (the simulated GPU holds ~19 % more "
            "than the plan counts); use a schedule without the split (1F1B, Interleaved1F1B, GPipe)")
    if isinstance(off, int):
        n_layers = _model_args(cfg).n_layers
        if not 1 <= off <= n_layers:
            raise ConfigError(
                f"memory.activation_offload = {off}: a count of blocks is 1 .. the model's {n_layers} layers "
                "(or 'none', 'all')")


def _validate_memory(cfg: JobConfig) -> None:
    """Checks of ``[memory]``, ``[activation_checkpoint]`` and ``[[callbacks]]``."""
    mem, steps = cfg.memory, cfg.training.steps
    bad = sorted(s for s in mem.snapshot_steps if not 1 <= s <= steps)
    if bad:
        raise ConfigError(
            f"memory.snapshot_steps = {mem.snapshot_steps}: step(s) {bad} are outside the run "
            f"(1 .. training.steps = {steps})"
        )
    bad = sorted(s for s in cfg.profiling.trace_steps if not 1 <= s <= steps)
    if bad:
        raise ConfigError(
            f"profiling.trace_steps = {cfg.profiling.trace_steps}: step(s) {bad} are outside the run "
            f"(1 .. training.steps = {steps})"
        )
    if mem.warmup_max_steps < mem.leak_window_steps:
        raise ConfigError(
            f"memory.warmup_max_steps = {mem.warmup_max_steps} is below memory.leak_window_steps = "
            f"{mem.leak_window_steps}: a verdict needs a full window; use warmup_max_steps >= "
            f"{mem.leak_window_steps}"
        )
    try:
        worker_env_vars(mem.allocator)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if mem.cpu_offload and cfg.parallelism.dp_shard * cfg.parallelism.dp_replicate < 2:
        raise ConfigError(
            f"memory.cpu_offload = true offloads FSDP2's shards, but parallelism.dp_shard = "
            f"{cfg.parallelism.dp_shard} applies no FSDP2; use dp_shard >= 2 or cpu_offload = false"
        )
    _check_activation_offload(cfg)
    ac = cfg.activation_checkpoint
    schedule = cfg.parallelism.pipeline_schedule
    if cfg.parallelism.pp > 1 and SCHEDULES[schedule].zero_bubble and ac.mode == "selective" \
            and ac.selective_option == "op":
        # The input-gradient half runs backward with retain_graph and the weight half again over
        # the same region; torch's selective checkpoint allows one backward per region.
        raise ConfigError(
            f"activation_checkpoint.selective_option = 'op' with pipeline_schedule = {schedule!r}: a "
            "zero-bubble schedule runs each backward in two parts, and torch's selective op checkpoint "
            "allows one backward per region (the step fails with 'Trying to backward an extra time'); "
            "use activation_checkpoint.mode = 'full', selective_option = 'layer', or a schedule without "
            "the split (1F1B, Interleaved1F1B)"
        )
    if ac.mode == "selective" and ac.selective_option == "layer":
        n_layers = _model_args(cfg).n_layers
        if ac.layer_freq > n_layers:
            raise ConfigError(
                f"activation_checkpoint.layer_freq = {ac.layer_freq} exceeds the model's {n_layers} "
                f"layers: only layer 0 would be checkpointed; use 1 .. {n_layers}"
            )
    for i, cb in enumerate(cfg.callbacks):
        try:
            resolve_callback(cb.target, cb.kwargs)  # imports, calls nothing: workers instantiate it
        except ValueError as e:
            raise ConfigError(f"callbacks[{i}].target = {cb.target!r}: {e}") from None


def _check_sources(cfg: JobConfig, has_dataset: bool = False) -> None:
    """The training source, or every source of a mixture, exists and has documents."""
    data = cfg.data
    if data.source == "ray_data":
        _check_ray_data(cfg, has_dataset)
        return
    if not data.sources:
        check_source(data)
        return
    if data.path:
        raise ConfigError(f"data.path = {data.path!r} is set but data.sources (a mixture) replaces it; "
                          "give each source its own path in data.sources")
    names = [s.name for s in data.sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"data.sources names {names} repeat; give each source its own name")
    for i, d in enumerate(source_settings(data)):
        try:
            check_source(d)
        except ConfigError as e:
            raise ConfigError(f"data.sources[{i}] ({names[i]!r}): {e}") from None


def _check_ray_data(cfg: JobConfig, has_dataset: bool) -> None:
    """``data.source = "ray_data"``: text, a path (unless a dataset was given), no held-out share."""
    data = cfg.data
    if data.format != "text":
        raise ConfigError(f"data.source = 'ray_data' streams text documents; data.format = {data.format!r} needs "
                          "data.source = 'parquet' or 'jsonl'")
    if data.sources:
        raise ConfigError("data.source = 'ray_data' cannot be mixed with data.sources; use one or the other")
    if cfg.validation.enable and cfg.validation.source == "holdout":
        raise ConfigError("validation.source = 'holdout' needs a file source to hash; with data.source = "
                          "'ray_data' give validation a source of its own (validation.source, validation.path)")
    if has_dataset:
        return
    if not data.path:
        raise ConfigError("data.source = 'ray_data' needs data.path (Parquet or JSON Lines files, local or "
                          "object storage) or a dataset: ray_titan.train(cfg, dataset=ds)")
    if not storage.is_remote(data.path):  # object storage is read by Ray Data itself, on the cluster
        check_source(data.model_copy(update={"source": dataset_format(data.path)}))


def _validate_validation(cfg: JobConfig) -> None:
    """Checks of ``[validation]``: batch shape, its own source, or a non-empty held-out share."""
    v, tr = cfg.validation, cfg.training
    if not v.enable:
        return
    if v.batch_size is not None and v.batch_size % tr.global_batch_size:
        raise ConfigError(
            f"validation.batch_size = {v.batch_size} is not a multiple of training.global_batch_size = "
            f"{tr.global_batch_size}: validation runs the training step's microbatch shape; use a multiple "
            f"of {tr.global_batch_size} (or leave it unset)"
        )
    if v.source == "holdout":
        if v.path:
            raise ConfigError(f"validation.path = {v.path!r} is set but validation.source = 'holdout' ignores it; "
                              "set validation.source = 'parquet' or 'jsonl' to validate on it")
        held = validation_documents(cfg)
        train = [training_documents(cfg, d) for d in source_settings(cfg.data)]
        for what, n in [("held out", len(held))] + [("left to train on", len(t)) for t in train]:
            if n == 0:
                raise ConfigError(
                    f"validation.holdout_fraction = {v.holdout_fraction} leaves no document {what} in the "
                    "training source(s); choose another fraction or a validation source"
                )
        return
    if v.source != "python_stdlib" and not v.path:
        raise ConfigError(f"validation.source = {v.source!r} needs validation.path (a file or a directory)")
    try:
        check_source(cfg.data.model_copy(update={"source": v.source, "path": v.path}))
    except ConfigError as e:
        raise ConfigError(f"validation source: {e} (validation.path = {v.path!r})") from None


def _check_load_path(cfg: JobConfig, vocab_size: int) -> JobConfig:
    """``checkpoint.load_path`` exists, is complete and sound (sizes, CRC-32, metadata) and fits
    the job. For a directory of checkpoints (a run directory or its ``checkpoints/``), the newest
    sound one is taken, with a warning naming each newer one passed over. Returns ``cfg`` with
    ``load_path`` set to the checkpoint taken."""
    load_path = cfg.checkpoint.load_path
    assert load_path is not None  # the caller checks
    passed_over: list[str] = []
    try:
        candidates = checkpoint_candidates(load_path)
        for path in candidates:
            try:
                manifest = read_manifest(path, verify_checksums=True)
                # The same restricted unpickler as the workers': a crafted .metadata stops here.
                check_metadata(load_metadata(path), path, manifest["files"])
            except CheckpointError as e:
                if len(candidates) == 1:
                    raise
                passed_over.append(str(e))
                continue
            check_compatible(manifest, cfg, vocab_size, path, cfg.checkpoint.load_model_only)
            break
        else:
            raise CheckpointError(f"no sound checkpoint in {load_path}: " + "; ".join(passed_over))
    except CheckpointError as e:
        raise ConfigError(f"checkpoint.load_path = {load_path!r}: {e}") from None
    for problem in passed_over:
        print(f"ray_titan: warning: checkpoint.load_path = {load_path!r}: passing over a damaged checkpoint "
              f"({problem}); loading {path}", file=sys.stderr, flush=True)
    return cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"load_path": str(path)})})
