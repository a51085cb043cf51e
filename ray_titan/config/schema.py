"""The job configuration schema: sections, TOML loading, dotted CLI overrides.

A job is described by one :class:`JobConfig`. It is loaded from a TOML file whose tables are the
sections below, then overridden by dotted flags (``--training.steps=50``). Unknown keys and wrong
types are errors (pydantic, ``extra="forbid"``, strict types). This module imports nothing of
the project but its units of memory (an import contract in the test suite keeps it so); cross-field checks that need the
model registry, the data files or a checkpoint live in :mod:`ray_titan.preflight.checks`, which
the driver calls before any worker starts.

Every error names the setting, its value and what would be valid, and is a :class:`ConfigError`.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ray_titan.config.units import parse_bytes

__all__ = ["ConfigError", "JobConfig", "apply_overrides", "load_config", "merge_overrides"]


MAX_STEPS = 10**9
"""More optimizer steps than any run makes; a larger ``training.steps`` is a typo."""


class ConfigError(ValueError):
    """A job setting is invalid. The message names the setting, its value and what is valid."""


class _Section(BaseModel):
    # Attribute docstrings become field descriptions (ray-titan config docs, docs/configuration.md).
    # allow_inf_nan=False: no setting means anything when infinite or NaN (optimizer.lr = inf made
    # every weight NaN at step 1).
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)


class Job(_Section):
    """The run's name and where run directories go."""

    name: str = "debug_llama"
    """Run name; the run directory is ``<dump_folder>/<name>-<timestamp>``."""
    dump_folder: str = "outputs"
    """Where run directories are created: a local path (relative ones are resolved by the driver)
    or a URI pyarrow's filesystems understand (``file:///shared/runs``, ``s3://bucket/runs``,
    ``gs://...``; see ``ray_titan.storage``). Shared or object storage on a multi-node cluster."""
    description: str = ""
    """Free text kept with the run (``config.json``); not used by training."""
    storage_timeout_s: float = Field(30.0, gt=0)
    """Seconds pre-flight waits for the storage of each location the job names to answer, before
    any worker starts: ``dump_folder`` takes a probe file (written and removed); a remote
    ``checkpoint.initial_load_hf``, ``checkpoint.load_path``, ``data.path``, ``data.sources``' paths,
    ``data.tokenizer_path`` and ``validation.path`` are asked for one file's information
    (``ray_titan.storage.probe_location``). An unreachable bucket or endpoint is refused after this,
    naming the setting."""


class Model(_Section):
    """Which model: family and flavor from ``ray_titan.models.registry``."""

    # The registered families (ray_titan.models.registry.FAMILIES, in its order): this module
    # imports nothing of the project, so tests/unit/test_registry.py checks that they agree.
    name: Literal["llama", "qwen3", "deepseek_v2", "deepseek_v3", "qwen3_moe", "gpt_oss", "glm4_moe",
                  "minimax_m2", "qwen3_5", "qwen3_5_moe"] = "llama"
    """Model family: any registered family (``ray_titan.models.registry``; the README's model table
    describes each). With ``checkpoint.initial_load_hf`` it comes from the checkpoint's
    ``config.json`` (set here, it must agree)."""
    flavor: str = "debug"
    """Size within the family: one of its flavors (``ray_titan/models/<family>/args.py``): ``debug``
    (tiny, every family has one) or a released model's dimensions (the README's flavor table). With
    ``checkpoint.initial_load_hf`` the checkpoint's ``config.json`` gives the sizes (a flavor set
    here must agree with it) and this reads ``hf``."""
    load_balance: Literal["aux_loss", "aux_free", "none"] | None = None
    """MoE only: expert load balancing. ``aux_loss``: a balance loss (DeepSeek-V2's per sequence;
    families whose reference pools it over the layers, as Qwen3-MoE's, pool it); ``aux_free``:
    DeepSeek-V3's auxiliary-loss-free router bias; ``none``. Unset: the flavor's own
    (``ray_titan/models/<family>/args.py``: what the family's release used, e.g. DeepSeek-V3's
    ``aux_free``)."""
    aux_loss_coeff: float = Field(0.001, ge=0)
    """MoE only: α of the balance loss (DeepSeek-V2-Lite used 0.001)."""
    bias_update_rate: float = Field(0.001, ge=0)
    """MoE only: γ, the step of the aux-loss-free bias update per optimizer step (DeepSeek-V3: 0.001)."""
    mtp_layers: int = Field(0, ge=0)
    """DeepSeek-V3, GLM-4.5 and Qwen3.5 (dense, MoE; at most 1) only: multi-token-prediction depths
    to build and train (DeepSeek-V3 §2.2, arXiv:2412.19437; ``num_nextn_predict_layers``, Qwen3.5's
    ``mtp_num_hidden_layers``, of their ``config.json``); 0: none. Depth ``k``
    predicts the token ``k + 1`` ahead from the previous depth's hidden state and the embedding of
    the token ``k`` ahead, through one more MoE block and the shared output head; its loss is
    added as ``training.mtp_loss_weight × mean of the depths' losses``. With
    ``checkpoint.initial_load_hf`` the checkpoint must hold at least this many (DeepSeek-V3, Kimi
    K2, GLM-4.5 and Qwen3.5 hold 1), which are imported and exported with the model. Under tensor parallelism
    DeepSeek-V3's and GLM-4.5's; not with context parallelism."""


class DataSource(_Section):
    """One source of a mixture (an entry of ``data.sources``)."""

    name: str
    """Its name in the metrics (``source_tokens`` follows the order of ``data.sources``)."""
    source: Literal["python_stdlib", "parquet", "jsonl"]
    """As ``data.source``."""
    path: str | None = None
    """As ``data.path``."""
    weight: float = Field(gt=0)
    """Its share of the documents drawn: weight over the sum of the weights."""


class Data(_Section):
    """Corpus source and tokenizer."""

    source: Literal["python_stdlib", "parquet", "jsonl", "ray_data"] = "python_stdlib"
    """``python_stdlib``: the running interpreter's standard library (built in, nothing downloaded);
    ``parquet`` / ``jsonl``: user files given by ``path``; ``ray_data``: streamed with Ray Data
    from ``path`` (Parquet, or JSON Lines for ``.jsonl`` paths; local or object storage such as
    ``s3://``), or the ``ray.data.Dataset`` given to ``ray_titan.train(cfg, dataset=ds)``
    (``ray_titan.data.ray_data``: every rank streams it in order; text only)."""
    path: str | None = None
    """A file or a directory of ``*.parquet`` / ``*.jsonl`` files (required for those sources)."""
    text_column: str = "text"
    """Column (Parquet) or key (JSON Lines) holding each document's text."""
    tokenizer: Literal["byte", "huggingface"] = "byte"
    """``byte``: 256 byte ids plus BOS and EOS. ``huggingface``: a ``tokenizer.json`` at ``tokenizer_path``."""
    tokenizer_path: str | None = None
    """Path of a Hugging Face ``tokenizer.json`` (required for ``tokenizer = "huggingface"``)."""
    cache_dir: str | None = None
    """Where built-in corpora are materialised as Parquet; default ``~/.cache/ray_titan``."""
    sources: list[DataSource] = Field(default_factory=list)
    """A mixture: several sources (``[[data.sources]]`` tables, or ``--data.sources=[{name = "code",
    source = "parquet", path = "...", weight = 3.0}, ...]``), each document drawn from one of
    them with probability proportional to its weight, in an order fixed by ``training.seed``.
    Each entry: ``name``, ``source`` (as above), ``path``, ``weight`` (> 0);
    ``source`` and ``path`` above are then unused (the columns, format and tokenizer apply to
    every source). Each step's rows record the tokens taken from each (``source_tokens``)."""
    format: Literal["text", "prompt_response", "messages"] = "text"
    """``text``: documents in ``text_column``, every token a target of the loss.
    Supervised fine-tuning (the loss counts response tokens only, its mean taken over every
    counted token of the global batch): ``prompt_response``: ``prompt_column`` and
    ``response_column``, each example ``[BOS] prompt response [EOS]``; ``messages``: a
    ``messages_column`` of chat messages (``role``, ``content``) rendered with the tokenizer's
    chat template (``chat_template_path``), the assistant messages' tokens counted."""
    prompt_column: str = "prompt"
    """With ``format = "prompt_response"``: the prompt's column (not a target of the loss)."""
    response_column: str = "response"
    """With ``format = "prompt_response"``: the response's column (the loss's targets)."""
    messages_column: str = "messages"
    """With ``format = "messages"``: the column of message lists (``{"role", "content"}`` each)."""
    chat_template_path: str | None = None
    """With ``format = "messages"``: a Hugging Face ``tokenizer_config.json`` (its ``chat_template``)
    or a ``chat_template.jinja`` file. Default: one of those beside ``tokenizer_path``."""


class Training(_Section):
    """Steps, batch (sequences), sequence length (tokens), seed, clipping and GC."""

    steps: int = Field(300, gt=0, le=MAX_STEPS)
    """Optimizer steps to train (at most 10⁹)."""
    global_batch_size: int = Field(16, gt=0)
    """Sequences per optimizer step, summed over all data-parallel ranks."""
    seq_len: int = Field(128, gt=0)
    """Tokens per sequence fed to the model (labels are the same sequence shifted by one)."""
    seed: int = Field(0, ge=0, le=2**63 - 1)
    """Seed of model initialisation and data order (the same seed gives the same losses); below
    2⁶³, the range of ``torch.manual_seed``'s int64."""
    max_norm: float = Field(1.0, ge=0)
    """Gradient-norm clipping threshold over the whole model; 0 disables clipping."""
    gc_freq: int = Field(50, gt=0)
    """Every rank runs a synchronized ``gc.collect(1)`` every ``gc_freq`` steps; automatic GC is off."""
    mixed_precision: Literal["bf16", "fp32"] | None = None
    """Compute dtype. ``bf16``: FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)`` on every FSDP unit (routed experts' included): the parameters are
    all-gathered in bf16 (half the bytes) and the forward and backward compute in bf16, while the
    master weights, the gradients as reduced and the optimizer state stay fp32; the loss (and MoE
    router scores) are computed in fp32. Without FSDP (one data-parallel rank) the same compute
    dtype comes from ``torch.autocast`` around the forward passes (torchtitan's choice there),
    which keeps one bf16 copy of the stage's weights until the step's backward ends.
    ``fp32``: everything in fp32 (bit-identical to the reference implementations, on CPU).
    Unset: ``bf16`` when the workers use CUDA (``ray.use_gpu`` or a GPU launch), ``fp32`` on CPU
    (``ray_titan.parallel.fsdp.resolve_mixed_precision``). Replaces ``training.autocast``."""
    mtp_loss_weight: float = Field(0.3, ge=0)
    """λ of the multi-token-prediction loss (``model.mtp_layers``): the objective is ``main loss +
    λ × mean of the MTP depths' losses`` (DeepSeek-V3 §2.2.2, eq. 25; the paper used 0.3 for the
    first 10 T tokens and 0.1 for the last 4.8 T, §4.2; torchtitan's ``mtp_scale`` default is 0.3).
    The reported ``loss`` stays the main next-token loss; each depth's loss is its own column
    (``mtp_losses``)."""
    document_mask: bool = False
    """Attention stays within each document of a packed sequence (block-causal: a document
    starts at each BOS token and at the start of a row), and rotary positions restart at 0 in
    every document, so a packed sequence computes what its documents would alone. Computed with
    ``scaled_dot_product_attention`` and a boolean mask on every device. Off: causal attention
    over the whole sequence (documents see their predecessors)."""
    loss_chunk_tokens: int = Field(0, ge=0)
    """Tokens per chunk of the loss; 0: the plain loss. With ``n > 0`` the last pipeline stage
    gives its final-normed hidden states and the loss applies the output head and the
    cross-entropy ``n`` tokens at a time, each chunk recomputed in backward
    (``ray_titan.trainer.chunked_loss``): only one chunk's fp32 logits and their gradient are
    live, not the microbatch's (``tokens × vocab`` each: 7.8 GiB for 2 × 8192 tokens of a 128256
    vocabulary), for the head's forward matmul once more. Same values and gradients as the plain
    loss (up to fp32 summation order), under FSDP, tensor parallel's loss parallel, pipelining,
    tied embeddings, loss masks and document masks. The memory plan's transient and activations
    follow it: Llama 3.1 8B on FSDP 8 at 2 × 8192 tokens, chunks of 2048, transient 15.7 → 3.9 GiB
    (docs/memory.md). Off by default: on CPU the debug runs gain nothing and pay the head's
    recomputation (1.01× the plain loss's forward and backward with one chunk, 1.13× with a
    32000-token vocabulary); turn it on where the logits dominate the peak (large vocabularies,
    long microbatches)."""
    threads_per_worker: int | None = Field(None, gt=0)
    """``torch.set_num_threads`` per worker; default: the worker's CPU share rounded up."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite loss or gradient norm: ``stop`` ends the run with an error naming the step and
    the stage; ``skip`` drops that step's update (the LR schedule and the data still advance) and
    counts it in the metrics (``skipped_update``)."""
    compile: bool = False
    """``torch.compile`` (inductor) of each transformer block, after activation checkpointing and
    before FSDP2 (``ray_titan.parallel.compile``). The first step pays the compile time (about
    a minute per distinct block on 2 CPU cores); it pays off when the run is much longer than
    that and the blocks are large enough for fused kernels to matter (docs/benchmarks.md)."""


class Validation(_Section):
    """Held-out loss (section ``[validation]``): every ``freq`` steps and at the last step, the
    model is evaluated without gradients on ``steps`` batches of ``batch_size`` sequences of
    ``training.seq_len`` tokens (the same batches at every evaluation), and the loss (token-weighted
    mean over the last stage's data-parallel ranks, nats per token) is recorded beside the
    training loss. Training is unchanged by it: its losses are bit-identical with validation on
    or off (a held-out share excepted, which removes those documents from training)."""

    enable: bool = False
    """Evaluate the validation loss during training."""
    freq: int = Field(100, gt=0)
    """Steps between evaluations (also after the last step)."""
    steps: int = Field(10, gt=0)
    """Batches per evaluation."""
    source: Literal["holdout", "python_stdlib", "parquet", "jsonl"] = "holdout"
    """``holdout``: a share (``holdout_fraction``) of the training source's documents, chosen by a
    hash of each document's content (the same on every rank and in every run, whatever the
    seed) and removed from training. ``python_stdlib`` / ``parquet`` / ``jsonl``: a source of its
    own (``path``), read with the training source's columns, format and tokenizer."""
    path: str | None = None
    """File or directory of the validation source (``source = "parquet"`` or ``"jsonl"``)."""
    holdout_fraction: float = Field(0.01, gt=0, lt=1)
    """With ``source = "holdout"``: the share of the training source's documents held out."""
    batch_size: int | None = Field(None, gt=0)
    """Sequences per validation batch over all data-parallel ranks; default
    ``training.global_batch_size``. A multiple of it: each batch runs through the training
    step's microbatch shape (the pipeline schedule's buffers are sized by it)."""


class Parallelism(_Section):
    """Mesh sizes and the pipeline schedule. Workers = ``pp × dp_replicate × dp_shard × cp × tp``."""

    pp: int = Field(2, gt=0)
    """Pipeline-parallel degree (mesh axis ``pp``)."""
    dp_shard: int = Field(2, gt=0)
    """FSDP2 sharding degree (mesh axis ``dp_shard``)."""
    dp_replicate: int = Field(1, gt=0)
    """HSDP replica degree (mesh axis ``dp_replicate``): > 1 makes FSDP2 shard over ``dp_shard``
    and replicate over ``dp_replicate`` (gradients all-reduced across replicas), so the
    parameter all-gathers stay within a ``dp_shard`` group (one node) and only the gradient
    reduction crosses nodes. The data-parallel degree is ``dp_replicate × dp_shard``."""
    tp: int = Field(1, gt=0)
    """Tensor-parallel degree (mesh axis ``tp``, DTensor ``parallelize_module``): attention heads,
    feed-forward hidden units, routed experts' hidden units and the vocabulary are split over
    ``tp`` ranks, which also splits the activations inside them, even at batch size 1. The
    attention heads, kv heads and feed-forward hidden sizes must be divisible by it, the vocabulary
    too with ``loss_parallel``, and the sequence length with ``sequence_parallel``."""
    sequence_parallel: bool = True
    """With ``tp > 1``: the norms and the residual stream between blocks hold ``1/tp`` of the
    sequence on each tp rank (DTensor ``SequenceParallel``; all-gather before and
    reduce-scatter after each attention and feed-forward instead of an all-reduce), splitting
    those activations too. ``false``: they are replicated on every tp rank."""
    loss_parallel: bool = True
    """With ``tp > 1``: the output head keeps its logits vocabulary-sharded and the cross-entropy
    is computed on the shards (``torch.distributed.tensor.parallel.loss_parallel``), so no rank
    holds the full ``(batch, seq, vocab)`` logits. ``false``: the logits are all-gathered first."""
    cp: int = Field(1, gt=0)
    """Context-parallel degree (mesh axis ``cp``, as torchtitan's ``context_parallel_degree``):
    every sequence is split over ``cp`` ranks, which read the same batch; each keeps ``seq_len /
    cp`` tokens, chunks ``i`` and ``2·cp − 1 − i`` of ``2·cp`` (the causal load balancer: every cp
    rank does the same attention work), and attends to the keys and values all-gathered from the
    whole cp group in each attention layer; rotary positions and document masks are those of the
    whole sequence, and the loss is reduced over the cp ranks. Activations per rank shrink by
    ``cp``; parameters are FSDP-sharded over ``dp_shard × cp``. ``training.seq_len`` must be a
    multiple of ``2·cp``; not with gpt-oss (sinks and sliding windows) (ray_titan.parallel.context).
    With ``ep > 1`` the routed experts are FSDP-sharded over ``dp_shard / ep × cp``."""
    ep: int = Field(1, gt=0)
    """Expert-parallel degree (mesh axis ``ep``, MoE models only): borrows ranks from ``dp_shard``
    (must divide it); routed experts are split over ``ep`` and FSDP-sharded over ``dp_shard / ep``
    (× ``cp`` under context parallel)."""
    pipeline_schedule: Literal[
        "GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
    ] = "1F1B"
    """Pipeline schedule from ``torch.distributed.pipelining``. One stage per rank: ``GPipe``,
    ``1F1B``. Several, loop placement (stage ``s`` on pp rank ``s % pp``): ``Interleaved1F1B``,
    ``InterleavedZeroBubble`` (``stages_per_rank >= 2``). Two, V placement (pp rank ``r`` holds
    stages ``r`` and ``2·pp − 1 − r``, the last stage on pp rank 0): ``ZBVZeroBubble``,
    ``DualPipeV`` (``stages_per_rank = 2``). The zero-bubble schedules split each backward into
    its input and weight parts to fill the pipeline's idle time."""
    microbatches: int = Field(4, gt=0)
    """Microbatches per step per DP rank (pipeline microbatches; gradient accumulation when pp = 1)."""
    stages_per_rank: int = Field(1, gt=0)
    """Pipeline stages held by each pp rank (>= 2 for the interleaved schedules, 2 for the V-shaped ones)."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """FSDP2 ``reshard_after_forward``: ``default`` reshards except under PP (where each microbatch
    would re-gather), ``always`` / ``never`` force it."""


class Optimizer(_Section):
    """Optimizer and its hyper-parameters (``lr`` is the peak learning rate)."""

    name: Literal["AdamW", "Adam", "SGD"] = "AdamW"
    """Optimizer class from ``torch.optim``."""
    lr: float = Field(3e-3, gt=0)
    """Peak learning rate, reached at the end of warm-up."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """Adam(W) first-moment decay; SGD momentum."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """Adam(W) second-moment decay (unused by SGD)."""
    eps: float = Field(1e-8, gt=0)
    """Adam(W) denominator epsilon (unused by SGD)."""
    weight_decay: float = Field(0.1, ge=0)
    """Weight decay (decoupled for AdamW)."""
    implementation: Literal["fused", "foreach", "for-loop"] = "fused"
    """PyTorch's optimizer kernel: ``fused`` updates all parameters in one kernel (CPU and CUDA);
    ``foreach`` in batched ops; ``for-loop`` one parameter at a time (PyTorch's CPU default,
    about 3.5× slower than ``fused`` for the debug model on one thread)."""


class LRScheduler(_Section):
    """Linear warm-up, then decay to ``min_lr_ratio × lr`` at the last step."""

    warmup_steps: int = Field(20, ge=0)
    """Steps of linear warm-up from near 0 to ``optimizer.lr``."""
    decay: Literal["cosine", "linear", "none"] = "cosine"
    """Shape of the decay after warm-up (``none`` keeps ``optimizer.lr``)."""
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
    """Write TensorBoard event files to ``<run_dir>/tb``."""
    flush_every_steps: int = Field(20, gt=0)
    """The collector writes a Parquet part and flushes TensorBoard every this many assembled steps."""
    save_rank_reports: bool = False
    """Each rank also writes its own reports to ``<run_dir>/metrics/ranks/rank{r}.jsonl``."""
    report_interval_s: float = Field(1.0, ge=0)
    """Seconds between a worker's report calls to the collector; the reports of the steps in
    between travel in one call (a Ray call costs ~0.6 ms of the worker's CPU and ~0.75 ms of the
    collector's, one report or many). Every step is still recorded; console lines and the memory
    verdict's stop lag by at most this. 0: a call every step."""
    heap_stats_interval_s: float = Field(0.0, ge=0)
    """Seconds between reads of malloc's statistics and the node's available memory
    (``host_heap_in_use_bytes``, ``host_heap_free_bytes``, ``host_available_bytes``); steps in
    between carry the last read. RSS and device memory are read every step. 0 (the default):
    every step, so the host leak series (RSS less malloc's free bytes) pairs two reads of the same
    moment. Above 0 it pairs each step's RSS with free bytes up to that many seconds old: while
    the heap fragments early in a run (RSS and free bytes rising together) that series saws up
    and down, and a healthy rank's verdict rate read 0.25 MiB/step against 0.10 paired
    (debug model, 2 ranks, steps 28-32), above ``memory.host_leak_threshold_mib_per_step``. glibc's
    ``mallinfo2`` costs ~0.55 ms in a Ray worker (``ray_titan.metrics.worker.memory.MemorySampler``)."""
    series_max_ranks: int = Field(64, ge=0)
    """TensorBoard and W&B get every rank's memory series (``memory/rank<r>/...``) up to this many
    ranks; beyond, per pipeline stage and overall min / median / max of host and device memory,
    the count of ranks per memory verdict, and the series of each rank whose verdict is
    ``growing`` (16,384 ranks would make ~100k tags a step, more than W&B accepts for a run);
    for MoE models each layer's max / mean expert load, without every expert's share. The
    Parquet table keeps every rank's row whatever this is."""
    ranks_per_aggregator: int = Field(256, ge=0)
    """Above this many ranks, each group of this many ranks reports to a metrics aggregator actor
    (``ray_titan.metrics.collector.aggregator.MetricsAggregator``) that forwards the group's reports to the
    collector as one columnar batch per step: a Ray call costs the collector ~0.25 ms of CPU
    however much it carries, so 16,384 ranks calling it directly would need four collector-seconds
    per step. The workers still hold every report until the collector has it on disk, so a
    killed aggregator loses nothing. 0: every rank calls the collector. 256 (64 aggregators at
    16,384 ranks): 14.5–16.3 µs of collector CPU per rank report there against 26.2 with groups of
    64, side by side (``python -m benchmarks.collector_scale --group``, 2026-11-26)."""
    max_inflight_reports: int = Field(16, gt=0)
    """Report batches a worker may have in flight to the collector before it buffers locally."""
    max_buffered_reports: int = Field(10_000, gt=0)
    """Reports a worker holds until the collector has them on disk (it resends them after a
    collector restart); beyond this the oldest are dropped and counted (bounded so a stuck
    collector cannot grow a worker)."""
    wandb: bool = False
    """Also log to Weights & Biases, from the collector only (never from the workers): the
    TensorBoard scalars of every step (losses, validation, throughput, lr, every rank's memory)
    and the job's config. Needs the ``wandb`` package (``pip install 'ray-titan[wandb]'``);
    ``WANDB_MODE=offline`` writes the run under ``<run_dir>/wandb`` for ``wandb sync`` later;
    the API key comes from ``WANDB_API_KEY`` or ``wandb login``, as wandb reads them."""
    wandb_project: str = "ray_titan"
    """The W&B project."""
    wandb_run_name: str | None = None
    """The W&B run's display name; default the run directory's name (``<name>-<timestamp>``)."""
    wandb_tags: list[str] = Field(default_factory=list)
    """Tags of the W&B run."""
    collector_max_restarts: int = Field(10, ge=0)
    """Times Ray restarts a killed collector actor; it resumes from the metrics it had flushed."""
    collector_nice: int = Field(10, ge=0, le=19)
    """CPU priority the collector actor lowers itself by (``os.nice``; 0: unchanged). It has no
    CPU reserved and shares cores with the workers. Ray starts its workers, this actor included,
    at niceness 15 (``RAY_worker_niceness``) and the kernel caps it at 19: at 10 the actor runs
    at 19, weighted 15 against a worker's 36 (Linux CFS weights) while they compete, and gets
    all it wants while they wait on communication."""


class Checkpoint(_Section):
    """Sharded checkpoints (``torch.distributed.checkpoint``) of the whole training state: model,
    optimizer, LR scheduler, data-loader position, step and RNG state."""

    enable: bool = True
    """Save every ``interval`` steps and at the last step. Under Ray they go to
    ``<run_dir>/checkpoints/step-NNNNNNNN`` through ``ray.train.report`` (so a restarted worker
    group resumes from the latest); without Ray, straight to that directory."""
    interval: int = Field(100, gt=0)
    """Steps between checkpoints."""
    keep_latest_k: int = Field(3, ge=0)
    """Complete checkpoints kept (older ones are deleted); 0 keeps all."""
    load_path: str | None = None
    """Start this run from a checkpoint: a ``step-NNNNNNNN`` directory, or a directory holding
    them (a run directory or its ``checkpoints/``), whose latest complete checkpoint is taken.
    The mesh may differ from the one that saved it (DCP reshards). A restarted worker group
    resumes from its own run's latest checkpoint instead."""
    load_model_only: bool = False
    """With ``load_path``: take the model weights only and start at step 1 with a fresh optimizer,
    LR schedule and data order (fine-tuning); otherwise continue the saved run's state."""
    initial_load_hf: str | None = None
    """Start from a Hugging Face model directory (a local path or a URI pyarrow's filesystems
    read): ``config.json`` gives the model family and sizes (``model.name`` / ``model.flavor``, if
    set, must agree), ``tokenizer.json`` the tokenizer (unless ``data.tokenizer`` or
    ``data.tokenizer_path`` is set), and the safetensors files (``model.safetensors`` or shards
    with ``model.safetensors.index.json``, any float dtype) the weights, each rank reading only
    its own stages' shards. Supported ``model_type``: any registered family's (the README's model
    table). A restarted worker group, or ``load_path``, loads its DCP checkpoint instead."""
    last_save_hf: bool = False
    """After the run, also write the final checkpoint as a Hugging Face model directory
    ``<run_dir>/hf`` (``config.json``, safetensors shards with ``model.safetensors.index.json``,
    the tokenizer files), as ``ray-titan export`` does. Needs ``enable``."""
    last_save_hf_dtype: Literal["bf16", "fp32"] = "bf16"
    """Weights dtype of the ``last_save_hf`` export."""


class Debug(_Section):
    """Fault injection, for testing fault tolerance. Leave unset in real jobs."""

    kill_rank: int = Field(0, ge=0)
    """The rank ``kill_at_step`` kills."""
    kill_at_step: int | None = Field(None, gt=0)
    """SIGKILL rank ``kill_rank``'s process at the end of this step, in a worker group that did not
    resume from a checkpoint (so the restarted group runs on)."""
    kill_collector_at_step: int | None = Field(None, gt=0)
    """SIGKILL the metrics collector actor when it assembles this step (its first life only)."""
    nonfinite_loss_at_steps: list[int] = Field(default_factory=list)
    """Make the loss NaN at these steps (exercises ``training.on_nonfinite``)."""


class Memory(_Section):
    """The memory verdict, synchronized GC details, memory snapshots and host-side levers
    (section ``[memory]``). ``training.gc_freq`` sets how often every rank collects."""

    on_leak: Literal["warn", "stop"] = "warn"
    """What a ``growing`` verdict does: ``warn`` prints it (console, TensorBoard, Parquet,
    ``RunResult``); ``stop`` also ends the run with an error naming the rank, its mesh
    coordinates and the rate. Stopping needs the collector to see the steps as they happen: on
    Ray and in a one-process run; under ``torchrun`` the verdict is computed after the run."""
    leak_window_steps: int = Field(28, ge=8)
    """Steps in the sliding window of the slope. 28: the Theil–Sen median of 378 pairwise slopes
    shrugs off up to 8 outlying samples (breakdown point 29%: an allocator returning a block, a GC
    round); its quarters have 7 samples, an odd count, so each quarter's median is a sample and
    never the mean of two on either side of a jump; with them 0.5 MiB of jitter per sample and an
    8 MiB one-time jump are not read as growth (tests/unit/test_leak.py), and a new leak of 1 MiB/step
    is seen ~17 steps after it starts."""
    leak_threshold_mib_per_step: float = Field(0.1, gt=0)
    """Rate of device allocated memory at which a rank counts as ``growing``. The caching
    allocator's count is exact and flat after warm-up in a healthy run, so 0.1 MiB/step (1 GiB per
    10,000 steps, a day's run on a large job) is well above its noise. A rank falls back to
    ``stable`` below half of the threshold (hysteresis, so a rate near it does not flap)."""
    host_leak_threshold_mib_per_step: float = Field(0.2, gt=0)
    """Rate of host memory at which a rank counts as ``growing``: RSS less the free bytes malloc
    holds (RSS alone without malloc statistics). RSS alone rises while malloc's heap fragments
    (0–2 MiB per 100 steps on healthy CPU runs, +0.68 MiB/step on a healthy rank of a loaded
    machine over steps 13–40); with the free bytes taken out that growth goes, while anything kept
    by the trainer (tensors, buffers, Python objects) still counts. On recorded healthy ranks of
    the main job (glibc and jemalloc, 600 steps) the verdict's rate stays below 0.05 MiB/step, so
    0.2 catches a leak of 0.25 MiB/step (2.5 GiB per 10,000 steps) with room to spare
    (tests/unit/test_leak.py: leaks of 0.25-4 MiB/step on those recordings)."""
    warmup_max_steps: int = Field(40, ge=1)
    """Warm-up (``warming_up``) lasts until the window is full (a verdict needs
    ``leak_window_steps`` samples) and the newest quarter of it rises over the one before by less
    than the threshold rate (memory flattened), and ends at this step at the latest, so a leak from
    step 1 (which never flattens) is reported ``growing`` at this step. Must be >=
    ``leak_window_steps``."""
    snapshot_steps: list[int] = Field(default_factory=list)
    """Steps after which every rank writes a memory snapshot to ``<run_dir>/memory/``: on CUDA a
    pickled ``torch.cuda.memory`` snapshot (view at pytorch.org/memory_viz), on CPU the torch
    profiler's memory timeline of that step. On CUDA the allocator's event history is recorded
    from the start of each of these steps to its snapshot, then dropped."""
    breakdown_step: int = Field(2, ge=0)
    """The step whose memory every rank measures by category (parameters, gradients, optimizer
    state, activations, temporaries) at its peak, with the torch profiler's memory timeline
    (``ray_titan.metrics.worker.profiling``): into ``metrics/memory_breakdown.jsonl``,
    ``RunResult.memory_breakdown`` and ``ray-titan report``, beside the memory plan's prediction.
    2: the first step with optimizer state. That step runs slower (profiled) and its analysis
    takes ~0.5-3 s on the debug model, left out of ``step_time_s``; 0: none."""
    snapshot_on_oom: bool = True
    """On CUDA, record from step 1 where each live allocation was made (its Python stack) so that
    an out-of-memory error leaves a snapshot of what held the memory; the host memory this takes
    follows the live allocations and stays flat with them (docs/memory.md). On CPU an OOM writes
    the live tensors instead."""
    history_max_entries: int = Field(100_000, gt=0)
    """Allocation events the CUDA event history of a ``snapshot_steps`` step keeps (a ring, with
    each event's Python stack: roughly 1 KB of host memory per event, docs/memory.md)."""
    gc_full_every: int = Field(10, ge=0)
    """Every this many synchronized collections is a full one (generation 2); 0: never, except at
    checkpoint boundaries. Generation 1 every ``gc_freq`` steps frees a step's young cycles
    cheaply; with automatic GC off nothing else would ever free cycles that reached generation 2,
    so a full collection runs now and then, at the same steps: 4-8 ms in a main-job Ray worker,
    since what exists before the first step is frozen (``gc.freeze``; 0.6-0.7 s without)."""
    allocator: Literal["auto", "jemalloc", "system"] = "system"
    """The C allocator of the Ray Train workers, which holds every CPU tensor. ``system``: the
    process's default malloc (glibc on Linux), the default: on the dense main job (600 steps,
    steps 101-600) every rank's RSS rose +0.03 to +0.21 MiB per 100 steps on it against +0.48 to
    +0.87 on jemalloc, malloc in-use +0.11 to +0.12 on both (``python -m benchmarks.run memory``).
    ``jemalloc``: the one Ray ships (``ray/core/libjemalloc.so``, Linux wheels), preloaded into
    the workers; host RSS stays flat where glibc's malloc fragments (1-6 MiB per 100 steps on the
    debug MoE, which sets it: ``configs/debug_deepseek.toml``). The leak verdict is right under
    both (tests/unit/test_leak.py, on recorded series of each). ``auto``: jemalloc where Ray ships
    it, else the system's. Applies to workers the driver starts; under ``torchrun`` the launching
    shell's ``LD_PRELOAD`` decides (``ray_titan.allocator``)."""
    malloc_trim: bool = False
    """After every synchronized GC, malloc returns its free pages to the kernel (glibc
    ``malloc_trim(0)``, jemalloc ``arena.<all>.purge``; part of the GC pause). Under glibc on the
    main job it hands back ~25 MiB per rank, the step's freed working set, which the next step
    faults back in, so it is off by default; useful before a phase that needs host memory
    elsewhere. The host leak series (RSS less malloc's free bytes) dips at each trim and climbs
    back as those pages are reused: a level shift, which the verdict does not read as growth."""
    gc_debug: bool = False
    """Collect every step and print (on the worker's stderr) the reference cycles that held
    tensors: a debugging mode, slower."""
    cpu_offload: bool = False
    """FSDP2 ``CPUOffloadPolicy``: sharded parameters, gradients and optimizer state live in host
    memory (pinned on CUDA) and the optimizer steps on the CPU. Needs ``parallelism.dp_shard`` > 1."""
    activation_offload: Literal["none", "all"] | int = "none"
    """Which transformer blocks' saved activations live in host memory between their forward and
    their backward (``ray_titan.parallel.offload``; torchtune's ``enable_activation_offloading``,
    torchtitan 0.3.0 has none): ``none``; ``all``; or a count ``N``: the first ``N`` blocks of the
    whole model (by layer index; the first blocks' activations wait longest for their backward).
    Each tensor a block saves for backward (autograd's saved-tensor hooks) is copied to pinned host
    memory on a side CUDA stream while compute goes on, and copied back, one block ahead, before
    its backward; parameters, buffers and tensors under 1 KiB stay on the device. With
    ``activation_checkpoint.mode = "full"`` (or a ``layer``-checkpointed block) only the block's
    input is saved, so only that moves; under selective ``op`` the block input moves and the
    outputs op checkpointing saves stay on the device. Costs a host-device copy of the bytes each
    way per step (the memory plan's lever). On the CPU the hooks run but move nothing. Not with
    ``training.compile`` (the hooks would be traced inside the compiled block), nor with the
    zero-bubble pipeline schedules (their split backward unpacks the saved tensors twice)."""
    fit: Literal["off", "auto"] = "off"
    """``auto``: where the memory plan's peak does not fit the device (``device_memory``, less the
    plan's margin), the job is rewritten before any worker starts with the cheapest levers that
    keep its devices and its model states on them (more microbatches, activation offloading and
    checkpointing, ranked by their cost: offloading before the recomputation where its copies hide
    behind the forward's compute, after it where they do not; never ``dp_shard``, ``tp``, ``pp`` or
    CPU offload), one line printed saying what was chosen;
    where none fits, a ``ConfigError`` says what would (more devices). Off by default: the driver of
    a Ray run often cannot see the workers' GPUs, so the capacity must be known
    (``device_memory``, else the CUDA device of the planning process); without one, nothing changes."""
    device_memory: str | None = None
    """Memory of each rank's device (``"80GiB"``, ``"80GB"``, ``"141GB"``: GiB = 2³⁰ bytes, GB = 10⁹),
    the capacity ``fit`` and the run's memory plan compare the peak with; None: the CUDA device the
    planning process sees, if any."""

    @field_validator("device_memory")
    @classmethod
    def _device_memory_is_a_size(cls, v: str | None) -> str | None:
        if v is not None:
            parse_bytes(v)  # ValueError naming the text: a ConfigError naming memory.device_memory
        return v


class Profiling(_Section):
    """Profiler traces of chosen steps (section ``[profiling]``)."""

    trace_steps: list[int] = Field(default_factory=list)
    """Steps of which every rank writes a torch profiler trace (Chrome trace format, open it in
    Perfetto: https://ui.perfetto.dev) to ``<run_dir>/profile/rank{r}-step{s}.json``: operators
    of forward and backward, the pipeline schedule's microbatches, collectives and, on GPUs,
    kernels. Listed in ``RunResult.profiler_traces``."""


class ActivationCheckpoint(_Section):
    """Activation checkpointing of transformer blocks (section ``[activation_checkpoint]``):
    trade recomputation in backward for the activations kept from forward."""

    mode: Literal["none", "full", "selective"] = "none"
    """``full``: every block keeps only its input and recomputes the rest in backward.
    ``selective``: see ``selective_option``."""
    selective_option: Literal["op", "layer"] = "op"
    """``op``: torchtitan's op-level selective checkpointing (torchtitan 0.3.0,
    ``torchtitan/distributed/activation_checkpoint.py``, ``SelectiveAC``): every block saves the
    outputs of attention and of every other matrix multiplication (the 1st, 3rd, … of the block;
    the router's is recomputed) and recomputes the rest (norms, rotary embeddings, activations,
    products, the other matmuls; ``ray_titan.parallel.ac``); not with the zero-bubble pipeline
    schedules (torch's selective checkpoint allows one backward per region; they run two).
    ``layer``: full checkpointing of every ``layer_freq``-th block."""
    layer_freq: int = Field(2, gt=0)
    """With ``selective_option = "layer"``: blocks whose index in the whole model is a multiple
    of this are checkpointed (1 = every block = ``full``)."""


class Callback(_Section):
    """One worker-side callback (a ``[[callbacks]]`` table)."""

    target: str
    """``"package.module:name"``: a class defining at least one callback event (e.g. a
    :class:`ray_titan.callbacks.Callback` subclass), importable on every worker. The driver imports
    it (running the module's code) without calling it; every worker imports and instantiates it:
    a config is code, treat it like a script."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments it is called with."""


class RayConfig(_Section):
    """How the job is placed on Ray (section ``[ray]``)."""

    num_workers: int | list[int] | None = None
    """Training workers: the mesh product (default), or ``[min, max]`` for an elastic run: Ray
    Train grants what the cluster holds in that range, rounded down to a count the mesh fits
    (``ray_titan.parallel.elastic``: ``dp_replicate`` and ``dp_shard`` shrink, ``pp`` and ``tp``
    stay); ``max`` must be the mesh product. A lost node makes the run continue on fewer workers
    from the latest checkpoint; returning capacity grows it back at the next resize check."""
    elastic_resize_interval_s: float = Field(60.0, ge=0)
    """Elastic runs: seconds between Ray Train's checks for more capacity than the running worker
    group has (a larger group restarts from the latest checkpoint)."""
    cpus_per_worker: float | None = Field(None, gt=0)
    """CPUs Ray reserves per worker. Default: 1, or a fraction so the job fits the cluster's CPUs."""
    num_cpus: int | None = Field(None, gt=0)
    """CPUs of a local cluster started by the driver (ignored when joining one). Default: this machine's."""
    max_failures: int = Field(0, ge=0)
    """Worker-group restarts Ray Train may make after a worker fails; each restart resumes from
    the latest checkpoint (needs ``checkpoint.enable``)."""
    use_gpu: bool = False
    """One GPU per worker; the process group then uses NCCL (gloo otherwise)."""
    worker_nice: int = Field(0, ge=-20, le=19)
    """Niceness each training worker sets for all its threads when it starts. Ray starts its
    workers at 15 (``RAY_worker_niceness``) while the raylet, GCS and driver stay at 0, so on a
    busy machine the workers lose CPU to them that workers launched by torchrun would not lose;
    0 puts them level with torchrun's. Lowering niceness needs ``CAP_SYS_NICE`` (root in most
    containers); without it the workers keep Ray's and warn. 15: Ray's own."""


class JobConfig(_Section):
    """The whole job. Defaults are ``configs/debug_llama.toml``: the README's main job."""

    job: Job = Field(default_factory=Job)
    model: Model = Field(default_factory=Model)
    data: Data = Field(default_factory=Data)
    training: Training = Field(default_factory=Training)
    validation: Validation = Field(default_factory=Validation)
    parallelism: Parallelism = Field(default_factory=Parallelism)
    optimizer: Optimizer = Field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = Field(default_factory=LRScheduler)
    metrics: Metrics = Field(default_factory=Metrics)
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    ray: RayConfig = Field(default_factory=RayConfig)
    memory: Memory = Field(default_factory=Memory)
    activation_checkpoint: ActivationCheckpoint = Field(default_factory=ActivationCheckpoint)
    profiling: Profiling = Field(default_factory=Profiling)
    callbacks: list[Callback] = Field(default_factory=list)
    """Worker-side callbacks, run on every worker (``[[callbacks]]`` tables)."""
    debug: Debug = Field(default_factory=Debug)

    @property
    def world_size(self) -> int:
        """Number of workers the mesh needs: ``pp × dp_replicate × dp_shard × cp × tp``."""
        p = self.parallelism
        return p.pp * p.dp_replicate * p.dp_shard * p.cp * p.tp

    @property
    def num_stages(self) -> int:
        """Pipeline stages in the whole model: ``pp × stages_per_rank``."""
        return self.parallelism.pp * self.parallelism.stages_per_rank

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        """Build from nested dicts (a parsed TOML file). Raises :class:`ConfigError`."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(_format_validation_error(e)) from None

    def with_overrides(self, overrides: list[str]) -> JobConfig:
        """This config with dotted overrides (``["--training.steps=50"]``) applied and validated
        again, as :func:`load_config` applies them to a file. Raises :class:`ConfigError` for a
        malformed or repeated flag or a value the schema refuses."""
        return JobConfig.from_dict(apply_overrides(self.model_dump(), overrides))


_REMOVED = {
    "training.autocast": "it was replaced by training.mixed_precision = \"bf16\" | \"fp32\" (FSDP2 mixed "
                         "precision; unset: bf16 on CUDA, fp32 on CPU); autocast = \"bfloat16\" is "
                         "mixed_precision = \"bf16\", \"none\" is \"fp32\"",
}
"""Settings that no longer exist, by dotted name: what replaced them (said in the error)."""


def _format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden" and loc in _REMOVED:
            lines.append(f"{loc} = {err.get('input')!r}: {_REMOVED[loc]}")
        elif err["type"] == "extra_forbidden":
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


def _flag_key(flag: str) -> str:
    return (flag[2:] if flag.startswith("--") else flag).split("=", 1)[0]


def merge_overrides(*groups: list[str] | tuple[str, ...]) -> list[str]:
    """The override flags of ``groups`` in order, a later flag replacing an earlier one of the same
    setting: for layering a program's defaults under its caller's flags
    (:func:`apply_overrides` refuses a setting given twice in one list, a user's typo)."""
    merged: dict[str, str] = {}
    for flag in (f for group in groups for f in group):
        merged.pop(_flag_key(flag), None)
        merged[_flag_key(flag)] = flag
    return list(merged.values())


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--section.key=value`` (or ``section.key=value``) overrides to nested dicts.

    Raises :class:`ConfigError` for a flag that is not of that form, or a setting given twice.
    """
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    given: dict[str, str] = {}
    for flag in overrides:
        body = flag[2:] if flag.startswith("--") else flag
        if "=" not in body or "." not in body.split("=", 1)[0]:
            raise ConfigError(
                f"override {flag!r} is not of the form --section.key=value "
                "(for example --training.steps=50)"
            )
        key, value = body.split("=", 1)
        if key in given:
            raise ConfigError(
                f"override {key} is given twice ({given[key]!r} and {flag!r}); give each setting once"
            )
        given[key] = flag
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

    Raises :class:`ConfigError` for a missing file, a directory, a file that is not UTF-8 text
    (binary, or with a byte-order mark), invalid TOML, unknown keys or wrong types.
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_toml(Path(path))
    return JobConfig.from_dict(apply_overrides(data, overrides or []))


def _read_toml(p: Path) -> dict[str, Any]:
    """The parsed TOML file ``p``; every way it can fail is a :class:`ConfigError` saying what it is."""
    where = f"config file {str(p)!r}"
    if p.is_dir():
        raise ConfigError(f"{where} is a directory, not a TOML file")
    if not p.exists():
        raise ConfigError(f"{where} does not exist")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{where} cannot be read: {e.strerror or e}") from None
    if raw.startswith(b"\xef\xbb\xbf"):
        raise ConfigError(f"{where} starts with a UTF-8 byte-order mark, which TOML does not allow; save it "
                          "as UTF-8 without BOM")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 text (byte {e.start} is {raw[e.start:e.start + 1]!r}): "
                          "a binary file? give a TOML job config") from None
    if "\x00" in text:
        raise ConfigError(f"{where} holds a NUL character (byte {text.index(chr(0))}): a binary file? "
                          "give a TOML job config")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where} is not valid TOML: {e}") from None
