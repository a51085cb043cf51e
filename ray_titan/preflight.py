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

from ray_titan import storage
from ray_titan.allocator import worker_env_vars
from ray_titan.callbacks import load_callback
from ray_titan.checkpoint import CheckpointError, check_compatible, read_manifest, resolve_checkpoint
from ray_titan.config.schema import ConfigError, JobConfig
from ray_titan.data.build import source_settings, training_documents, validation_documents
from ray_titan.data.corpus import check_source
from ray_titan.data.ray_data import dataset_format
from ray_titan.data.sft import ChatTemplate, find_chat_template
from ray_titan.data.tokenizer import build_tokenizer
from ray_titan.models.registry import get_model_args, is_moe

__all__ = ["job_warnings", "validate_job"]


def job_warnings(cfg: JobConfig) -> list[str]:
    """Settings that are valid but probably not what was meant (the driver prints them)."""
    out = []
    if cfg.lr_scheduler.warmup_steps >= cfg.training.steps:
        out.append(
            f"lr_scheduler.warmup_steps = {cfg.lr_scheduler.warmup_steps} is not below training.steps "
            f"= {cfg.training.steps}: the learning rate never reaches optimizer.lr = {cfg.optimizer.lr:g}"
        )
    return out


def _check_dump_folder(cfg: JobConfig) -> None:
    dump = cfg.job.dump_folder
    try:
        storage.resolve(dump)
    except Exception as e:  # unknown scheme, pyarrow built without that filesystem, bad URI
        raise ConfigError(
            f"job.dump_folder = {dump!r}: pyarrow cannot open it ({e}); use a local path or a URI "
            "of a filesystem pyarrow supports (file://, s3://, gs://, hdfs://, abfs://)"
        ) from None
    if storage.is_remote(dump) and cfg.metrics.save_rank_reports:
        raise ConfigError(
            f"metrics.save_rank_reports = true writes local files on every worker, but job.dump_folder "
            f"= {dump!r} is remote; use a local or shared-filesystem dump_folder, or set it to false"
        )


def validate_job(cfg: JobConfig, has_dataset: bool = False) -> None:
    """Cross-field checks the driver runs before any worker starts.

    Checks the mesh against the worker count, the model against the pipeline, the batch against
    microbatches and DP degree, the sequence length against the model, and that the data path
    exists and has the text column. ``has_dataset``: the driver was given a ``ray.data.Dataset``
    (``data.source = "ray_data"`` without a path). Raises :class:`ConfigError` naming the setting,
    its value and what would be valid.
    """
    par, tr = cfg.parallelism, cfg.training
    mesh = f"parallelism.pp × parallelism.dp_shard = {par.pp} × {par.dp_shard} = {cfg.world_size}"
    if cfg.ray.num_workers is not None and cfg.ray.num_workers != cfg.world_size:
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
    _check_dump_folder(cfg)
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
    try:
        margs = get_model_args(cfg.model.name, cfg.model.flavor)
    except KeyError as e:
        raise ConfigError(str(e.args[0])) from None
    if par.ep > 1:
        if not is_moe(cfg.model.name):
            raise ConfigError(
                f"parallelism.ep = {par.ep} but model.name = {cfg.model.name!r} has no experts; "
                "use ep = 1 or a mixture-of-experts model (deepseek_v2)"
            )
        if par.dp_shard % par.ep:
            raise ConfigError(
                f"parallelism.ep = {par.ep} must divide parallelism.dp_shard = {par.dp_shard} "
                "(expert parallelism borrows its ranks from dp_shard)"
            )
        if margs.n_routed_experts % par.ep:
            raise ConfigError(
                f"parallelism.ep = {par.ep} does not divide the {margs.n_routed_experts} routed experts "
                f"of {cfg.model.name}/{cfg.model.flavor}; use a divisor of {margs.n_routed_experts}"
            )

    if par.pipeline_schedule == "Interleaved1F1B":
        if par.stages_per_rank < 2:
            raise ConfigError(
                f"parallelism.stages_per_rank = {par.stages_per_rank} with pipeline_schedule = "
                "'Interleaved1F1B': the interleaved schedule needs >= 2 stages per rank; "
                "set parallelism.stages_per_rank = 2 or use '1F1B'"
            )
        if par.pp < 2:
            raise ConfigError(
                "parallelism.pipeline_schedule = 'Interleaved1F1B' needs parallelism.pp >= 2, "
                f"got pp = {par.pp}"
            )
    elif par.stages_per_rank != 1:
        raise ConfigError(
            f"parallelism.stages_per_rank = {par.stages_per_rank} needs pipeline_schedule = "
            f"'Interleaved1F1B' (got {par.pipeline_schedule!r}); set stages_per_rank = 1"
        )
    if margs.n_layers < cfg.num_stages:
        raise ConfigError(
            f"model {cfg.model.name}/{cfg.model.flavor} has n_layers = {margs.n_layers}, fewer than "
            f"the {cfg.num_stages} pipeline stages (parallelism.pp × parallelism.stages_per_rank = "
            f"{par.pp} × {par.stages_per_rank}); each stage needs at least one layer"
        )
    if par.pp > 1 and par.pipeline_schedule in ("1F1B", "Interleaved1F1B"):
        if par.microbatches < par.pp:
            raise ConfigError(
                f"parallelism.microbatches = {par.microbatches} is fewer than the {par.pp} pipeline "
                f"ranks (parallelism.pp): {par.pipeline_schedule} needs microbatches >= pp"
            )
    if par.pipeline_schedule == "Interleaved1F1B":
        rounds = max(1, par.microbatches // par.pp)
        if par.microbatches % rounds:
            raise ConfigError(
                f"parallelism.microbatches = {par.microbatches} with Interleaved1F1B on pp = {par.pp}: "
                f"the schedule runs {rounds} rounds of {par.pp} microbatches and needs microbatches to "
                f"be a multiple of {rounds}; use {rounds * par.pp} or {par.pp}"
            )
    per_step = par.microbatches * par.dp_shard
    if tr.global_batch_size % per_step:
        raise ConfigError(
            f"training.global_batch_size = {tr.global_batch_size} is not divisible by "
            f"parallelism.microbatches × parallelism.dp_shard = {par.microbatches} × {par.dp_shard}"
            f" = {per_step}; use a multiple of {per_step}"
        )
    if tr.seq_len > margs.max_seq_len:
        raise ConfigError(
            f"training.seq_len = {tr.seq_len} exceeds the model's maximum sequence length "
            f"{margs.max_seq_len} ({cfg.model.name}/{cfg.model.flavor}); use <= {margs.max_seq_len}"
        )
    _validate_memory(cfg)
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
    if cfg.checkpoint.load_path is not None:
        _check_load_path(cfg, tokenizer.vocab_size)


def _validate_memory(cfg: JobConfig) -> None:
    """Checks of ``[memory]``, ``[activation_checkpoint]`` and ``[[callbacks]]``."""
    mem, steps = cfg.memory, cfg.training.steps
    bad = sorted(s for s in mem.snapshot_steps if not 1 <= s <= steps)
    if bad:
        raise ConfigError(
            f"memory.snapshot_steps = {mem.snapshot_steps}: step(s) {bad} are outside the run "
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
    if mem.cpu_offload and cfg.parallelism.dp_shard < 2:
        raise ConfigError(
            f"memory.cpu_offload = true offloads FSDP2's shards, but parallelism.dp_shard = "
            f"{cfg.parallelism.dp_shard} applies no FSDP2; use dp_shard >= 2 or cpu_offload = false"
        )
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and ac.selective_option == "layer":
        n_layers = get_model_args(cfg.model.name, cfg.model.flavor).n_layers
        if ac.layer_freq > n_layers:
            raise ConfigError(
                f"activation_checkpoint.layer_freq = {ac.layer_freq} exceeds the model's {n_layers} "
                f"layers: only layer 0 would be checkpointed; use 1 .. {n_layers}"
            )
    for i, cb in enumerate(cfg.callbacks):
        try:
            load_callback(cb.target, cb.kwargs)
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


def _check_load_path(cfg: JobConfig, vocab_size: int) -> None:
    """``checkpoint.load_path`` exists, is complete and fits the job."""
    load_path = cfg.checkpoint.load_path
    assert load_path is not None  # the caller checks
    try:
        path = resolve_checkpoint(load_path)
        check_compatible(read_manifest(path), cfg, vocab_size, path, cfg.checkpoint.load_model_only)
    except CheckpointError as e:
        raise ConfigError(f"checkpoint.load_path = {cfg.checkpoint.load_path!r}: {e}") from None
