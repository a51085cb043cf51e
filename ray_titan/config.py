"""Job configuration: sections, TOML loading, dotted CLI overrides, validation.

A job is described by one :class:`JobConfig`. It is loaded from a TOML file whose tables are the
sections below, then overridden by dotted flags (``--training.steps=50``). Unknown keys and wrong
types are errors (pydantic, ``extra="forbid"``, strict types). Cross-field checks that need the
model registry or the data files live in :func:`validate_job`, which the driver calls before any
worker starts.

Every error names the setting, its value and what would be valid, and is a :class:`ConfigError`.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "ConfigError",
    "JobConfig",
    "load_config",
    "apply_overrides",
    "validate_job",
    "job_warnings",
]


class ConfigError(ValueError):
    """A job setting is invalid. The message names the setting, its value and what is valid."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


class Job(_Section):
    """The run's name and where run directories go."""

    name: str = "debug_llama"
    """Run name; the run directory is ``<dump_folder>/<name>-<timestamp>``."""
    dump_folder: str = "outputs"
    """Where run directories are created (relative paths are resolved by the driver)."""
    description: str = ""


class Model(_Section):
    """Which model: family and flavor from ``ray_titan.models.registry``."""

    name: Literal["llama"] = "llama"
    """Model family in the registry (``ray_titan.models.registry``)."""
    flavor: str = "debug"
    """Size within the family, e.g. ``debug`` or ``8B``."""


class Data(_Section):
    """Corpus source and tokenizer."""

    source: Literal["python_stdlib", "parquet", "jsonl"] = "python_stdlib"
    """``python_stdlib``: the running interpreter's standard library (built in, nothing downloaded);
    ``parquet`` / ``jsonl``: user files given by ``path``."""
    path: str | None = None
    """A file or a directory of ``*.parquet`` / ``*.jsonl`` files (required for those sources)."""
    text_column: str = "text"
    tokenizer: Literal["byte", "huggingface"] = "byte"
    """``byte``: 256 byte ids plus BOS and EOS. ``huggingface``: a ``tokenizer.json`` at ``tokenizer_path``."""
    tokenizer_path: str | None = None
    cache_dir: str | None = None
    """Where built-in corpora are materialised as Parquet; default ``~/.cache/ray_titan``."""


class Training(_Section):
    """Steps, batch (sequences), sequence length (tokens), seed, clipping and GC."""

    steps: int = Field(300, gt=0)
    global_batch_size: int = Field(16, gt=0)
    """Sequences per optimizer step, summed over all data-parallel ranks."""
    seq_len: int = Field(128, gt=0)
    """Tokens per sequence fed to the model (labels are the same sequence shifted by one)."""
    seed: int = Field(0, ge=0)
    max_norm: float = Field(1.0, ge=0)
    """Gradient-norm clipping threshold over the whole model; 0 disables clipping."""
    gc_freq: int = Field(50, gt=0)
    """Every rank runs a synchronized ``gc.collect(1)`` every ``gc_freq`` steps; automatic GC is off."""
    autocast: Literal["none", "bfloat16"] = "none"
    """``bfloat16``: forward passes (and the pipeline schedule's steps) run under
    ``torch.autocast`` in bf16: matmuls in bf16, weights, gradients and optimizer state in fp32."""
    threads_per_worker: int | None = Field(None, gt=0)
    """``torch.set_num_threads`` per worker; default: the worker's CPU share rounded up."""


class Parallelism(_Section):
    """Mesh sizes and the pipeline schedule. Workers = ``pp × dp_shard``."""

    pp: int = Field(2, gt=0)
    """Pipeline-parallel degree (mesh axis ``pp``)."""
    dp_shard: int = Field(2, gt=0)
    """FSDP2 sharding degree (mesh axis ``dp_shard``)."""
    pipeline_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B"] = "1F1B"
    microbatches: int = Field(4, gt=0)
    """Microbatches per step per DP rank (pipeline microbatches; gradient accumulation when pp = 1)."""
    stages_per_rank: int = Field(1, gt=0)
    """Pipeline stages held by each pp rank (>= 2 for Interleaved1F1B)."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """FSDP2 ``reshard_after_forward``: ``default`` reshards except under PP (where each microbatch
    would re-gather), ``always`` / ``never`` force it."""


class Optimizer(_Section):
    """Optimizer and its hyper-parameters (``lr`` is the peak learning rate)."""

    name: Literal["AdamW", "Adam", "SGD"] = "AdamW"
    lr: float = Field(3e-3, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    implementation: Literal["fused", "foreach", "for-loop"] = "fused"
    """PyTorch's optimizer kernel: ``fused`` updates all parameters in one kernel (CPU and CUDA);
    ``foreach`` in batched ops; ``for-loop`` one parameter at a time (PyTorch's CPU default,
    about 3.5× slower than ``fused`` for the debug model on one thread)."""


class LRScheduler(_Section):
    """Linear warm-up, then decay to ``min_lr_ratio × lr`` at the last step."""

    warmup_steps: int = Field(20, ge=0)
    decay: Literal["cosine", "linear", "none"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate as a fraction of ``optimizer.lr``."""


class Metrics(_Section):
    """What the collector records and prints, and the workers' bounds on reporting."""

    enabled: bool = True
    """The metrics collector and per-step memory sampling. ``false`` records nothing per step
    (no collector, no console lines, no Parquet; only ``<run_dir>/timings/``): for measuring
    what metrics cost (``benchmarks``), not for real runs."""
    log_freq: int = Field(10, gt=0)
    """Console line every ``log_freq`` steps. Every step is recorded whatever this is."""
    enable_tensorboard: bool = True
    flush_every_steps: int = Field(20, gt=0)
    """The collector writes a Parquet part and flushes TensorBoard every this many assembled steps."""
    save_rank_reports: bool = False
    """Each rank also writes its own reports to ``<run_dir>/metrics/ranks/rank{r}.jsonl``."""
    max_inflight_reports: int = Field(16, gt=0)
    """Report batches a worker may have in flight to the collector before it buffers locally."""
    max_buffered_reports: int = Field(10_000, gt=0)
    """Reports a worker buffers while the collector is slow; beyond this the oldest are dropped
    and counted (bounded so a stuck collector cannot grow a worker)."""


class RayConfig(_Section):
    """How the job is placed on Ray (section ``[ray]``)."""

    num_workers: int | None = Field(None, gt=0)
    """Training workers; must equal the mesh product. Default: the mesh product."""
    cpus_per_worker: float | None = Field(None, gt=0)
    """CPUs Ray reserves per worker. Default: 1, or a fraction so the job fits the cluster's CPUs."""
    num_cpus: int | None = Field(None, gt=0)
    """CPUs of a local cluster started by the driver (ignored when joining one). Default: this machine's."""
    max_failures: int = Field(0, ge=0)
    """Worker-group restarts Ray Train may make after a worker fails."""
    use_gpu: bool = False
    """One GPU per worker; the process group then uses NCCL (gloo otherwise)."""


class JobConfig(_Section):
    """The whole job. Defaults are ``configs/debug_llama.toml``: the README's main job."""

    job: Job = Field(default_factory=Job)
    model: Model = Field(default_factory=Model)
    data: Data = Field(default_factory=Data)
    training: Training = Field(default_factory=Training)
    parallelism: Parallelism = Field(default_factory=Parallelism)
    optimizer: Optimizer = Field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = Field(default_factory=LRScheduler)
    metrics: Metrics = Field(default_factory=Metrics)
    ray: RayConfig = Field(default_factory=RayConfig)

    @property
    def world_size(self) -> int:
        """Number of workers the mesh needs: ``pp × dp_shard``."""
        return self.parallelism.pp * self.parallelism.dp_shard

    @property
    def num_stages(self) -> int:
        """Pipeline stages in the whole model: ``pp × stages_per_rank``."""
        return self.parallelism.pp * self.parallelism.stages_per_rank

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JobConfig":
        """Build from nested dicts (a parsed TOML file). Raises :class:`ConfigError`."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(_format_validation_error(e)) from None


def _format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown setting {loc!r}")
        else:
            lines.append(f"{loc} = {err.get('input')!r}: {err['msg']}")
    return "invalid config: " + "; ".join(lines)


def _parse_value(text: str) -> Any:
    """A CLI value as TOML would read it (``3``, ``1e-3``, ``true``, ``"x"``, ``[1, 2]``);
    anything TOML cannot parse is a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--section.key=value`` (or ``section.key=value``) overrides to nested dicts.

    Raises :class:`ConfigError` for a flag that is not of that form.
    """
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for flag in overrides:
        body = flag[2:] if flag.startswith("--") else flag
        if "=" not in body or "." not in body.split("=", 1)[0]:
            raise ConfigError(
                f"override {flag!r} is not of the form --section.key=value "
                "(for example --training.steps=50)"
            )
        key, value = body.split("=", 1)
        section, _, name = key.partition(".")
        if "." in name:
            raise ConfigError(f"override {flag!r}: settings are two levels deep (section.key)")
        node = out.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {flag!r}: {section!r} is not a section")
        node[name] = _parse_value(value)
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Load a TOML job config (or the defaults when ``path`` is None) and apply overrides.

    Raises :class:`ConfigError` for a missing file, invalid TOML, unknown keys or wrong types.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    return JobConfig.from_dict(apply_overrides(data, overrides or []))


def job_warnings(cfg: JobConfig) -> list[str]:
    """Settings that are valid but probably not what was meant (the driver prints them)."""
    out = []
    if cfg.lr_scheduler.warmup_steps >= cfg.training.steps:
        out.append(
            f"lr_scheduler.warmup_steps = {cfg.lr_scheduler.warmup_steps} is not below training.steps "
            f"= {cfg.training.steps}: the learning rate never reaches optimizer.lr = {cfg.optimizer.lr:g}"
        )
    return out


def validate_job(cfg: JobConfig) -> None:
    """Cross-field checks the driver runs before any worker starts.

    Checks the mesh against the worker count, the model against the pipeline, the batch against
    microbatches and DP degree, the sequence length against the model, and that the data path
    exists and has the text column. Raises :class:`ConfigError` naming the setting, its value and
    what would be valid.
    """
    from ray_titan.data.corpus import check_source
    from ray_titan.data.tokenizer import build_tokenizer
    from ray_titan.models.registry import get_model_args

    par, tr = cfg.parallelism, cfg.training
    mesh = f"parallelism.pp × parallelism.dp_shard = {par.pp} × {par.dp_shard} = {cfg.world_size}"
    if cfg.ray.num_workers is not None and cfg.ray.num_workers != cfg.world_size:
        raise ConfigError(
            f"ray.num_workers = {cfg.ray.num_workers} but the mesh needs {mesh} workers; "
            f"set ray.num_workers = {cfg.world_size} (or leave it unset) or change the mesh"
        )
    if cfg.ray.max_failures:
        raise ConfigError(
            f"ray.max_failures = {cfg.ray.max_failures}: a restarted worker group would start again "
            "from step 1, since resuming from checkpoints is not implemented yet; use 0"
        )
    if cfg.data.source == "python_stdlib" and cfg.data.path:
        raise ConfigError(
            f"data.path = {cfg.data.path!r} is set but data.source = 'python_stdlib' ignores it; "
            "set data.source = 'parquet' or 'jsonl' to train on it"
        )
    try:
        margs = get_model_args(cfg.model.name, cfg.model.flavor)
    except KeyError as e:
        raise ConfigError(str(e.args[0])) from None

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
    check_source(cfg.data)
    try:
        build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    except Exception as e:  # a missing, unreadable or special-token-less tokenizer.json
        raise ConfigError(
            f"data.tokenizer = {cfg.data.tokenizer!r}, data.tokenizer_path = "
            f"{cfg.data.tokenizer_path!r}: {e}"
        ) from None
