"""A Hugging Face model directory's ``config.json``: the model it describes, and a job resolved from it.

:func:`read_hf_config` reads the file; :func:`hf_model` takes the model family from its
``model_type`` (``ray_titan.models.registry``) and the model arguments from the rest (the family's
state-dict adapter, which checks every number first); :func:`resolve_hf_job` makes a job with
``checkpoint.initial_load_hf`` the checkpoint's model and tokenizer, and :func:`job_model_args`
gives any job's model arguments. The tensors such a model needs, by Hugging Face name, are
:func:`_expected_shapes`' (what :mod:`.hf_import` checks the safetensors headers against and
:mod:`.hf_export` writes).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ray_titan import storage
from ray_titan.config.schema import ConfigError, JobConfig
from ray_titan.models.registry import ModelSpec, build_model, get_model_args, spec_for_hf
from ray_titan.models.state_dict_adapter import HFConfigError, Source

__all__ = [
    "CONFIG",
    "INDEX",
    "HFCheckpointError",
    "hf_model",
    "job_model_args",
    "read_hf_config",
    "resolve_hf_job",
]

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint directory cannot be used; the message names the file and the
    problem."""


def read_hf_config(path: str) -> dict[str, Any]:
    """``<path>/config.json`` as a dict (``path``: a local directory or a URI pyarrow reads).
    Raises :class:`HFCheckpointError` when it is missing, unreadable, larger than
    :data:`~ray_titan.storage.MAX_CONFIG_BYTES` (checked before it is read) or not a JSON
    object."""
    file = storage.join(path, CONFIG)
    try:
        text = storage.read_text(file, storage.MAX_CONFIG_BYTES, "MAX_CONFIG_BYTES; a config.json is kilobytes")
    except storage.FileTooLargeError as e:
        raise HFCheckpointError(str(e)) from None
    except FileNotFoundError:
        raise HFCheckpointError(f"{file} does not exist (a Hugging Face model directory has a config.json)") from None
    except Exception as e:
        raise HFCheckpointError(f"{file} is unreadable: {type(e).__name__}: {e}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise HFCheckpointError(f"{file} holds a {type(config).__name__}, not a JSON object")
    return config


def hf_model(path: str) -> tuple[ModelSpec, Any]:
    """The family (its :class:`ModelSpec`) and model arguments ``path``'s ``config.json``
    describes. Raises :class:`HFCheckpointError` naming the file: no or an unsupported
    ``model_type`` (listing the supported ones), a ``quantization_config`` the family does not
    dequantise, any number outside its field's range, whether or not the family reads it
    (``StateDictAdapter.check_config``: ``SIZE_FIELDS``, ``FLOAT_FIELDS``; checked before
    anything is sized by it), or a field the family cannot build."""
    return _hf_model(path)[:2]


def _hf_model(path: str) -> tuple[ModelSpec, Any, dict[str, Any]]:
    config = read_hf_config(path)
    file = storage.join(path, CONFIG)
    try:
        spec = spec_for_hf(config.get("model_type", ""))
    except KeyError as e:
        raise HFCheckpointError(f"{file}: {e.args[0]}") from None
    try:
        spec.hf.check_config(config)  # every family: its quantisation, every number in range
        return spec, spec.hf.args_from_hf(config), config
    except HFConfigError as e:
        raise HFCheckpointError(f"{file}: {e}") from None


def _absolute(path: str) -> str:
    local = storage.local_path(path)
    return str(local) if local is not None else path


def resolve_hf_job(cfg: JobConfig) -> JobConfig:
    """With ``checkpoint.initial_load_hf``: a copy of ``cfg`` whose ``model.name`` is the family of
    the checkpoint's ``config.json``, whose ``model.flavor`` is ``hf`` (or the flavor set in the
    config, once checked to agree), and whose tokenizer is the checkpoint's ``tokenizer.json``
    unless ``data.tokenizer`` or ``data.tokenizer_path`` is set. Without it, ``cfg`` unchanged.

    Call it where the job is loaded (the driver, the launcher, the memory plan): it tells settings
    given by the user from defaults; a config it returned comes back unchanged. Raises
    :class:`ConfigError` naming ``checkpoint.initial_load_hf`` and the file, or the disagreeing
    setting, the field and both values.
    """
    src = cfg.checkpoint.initial_load_hf
    if not src:
        return cfg
    src = _absolute(src)
    storage.probe_location("checkpoint.initial_load_hf", src, cfg.job.storage_timeout_s)
    try:
        spec, args = hf_model(src)
    except HFCheckpointError as e:
        raise ConfigError(f"checkpoint.initial_load_hf = {src!r}: {e}") from None
    given = cfg.model.model_fields_set
    config_file = storage.join(src, CONFIG)
    if "name" in given and cfg.model.name != spec.name:
        raise ConfigError(
            f"model.name = {cfg.model.name!r} but {config_file} has model_type "
            f"{spec.hf.model_type!r} (family {spec.name!r}); set model.name = {spec.name!r} or leave it unset"
        )
    flavor = "hf"
    if "flavor" in given and cfg.model.flavor != "hf":  # "hf": resolved already (resolving twice is a no-op)
        try:
            flavor_args = get_model_args(spec.name, cfg.model.flavor)
        except KeyError as e:
            raise ConfigError(str(e.args[0])) from None
        diffs = spec.hf.differences(flavor_args, args)
        if diffs:
            field, mine, theirs = diffs[0]
            raise ConfigError(
                f"model.flavor = {cfg.model.flavor!r} disagrees with {config_file}: {field} is {mine!r} in the "
                f"flavor, {theirs!r} in config.json; leave model.flavor unset to take the checkpoint's sizes"
            )
        flavor = cfg.model.flavor
    model = cfg.model.model_copy(update={"name": spec.name, "flavor": flavor})
    data = cfg.data
    if not {"tokenizer", "tokenizer_path"} & cfg.data.model_fields_set:
        tokenizer = storage.join(src, "tokenizer.json")
        data = data.model_copy(update={"tokenizer": "huggingface", "tokenizer_path": tokenizer})
    ckpt = cfg.checkpoint.model_copy(update={"initial_load_hf": src})
    return cfg.model_copy(update={"model": model, "data": data, "checkpoint": ckpt})


def job_model_args(cfg: JobConfig) -> Any:
    """The model arguments of the job: the checkpoint's ``config.json`` with
    ``checkpoint.initial_load_hf`` (after :func:`resolve_hf_job`), else ``model.flavor``'s.
    Raises ``KeyError`` for an unknown family or flavor, :class:`HFCheckpointError` for a bad
    ``config.json``."""
    if cfg.checkpoint.initial_load_hf:
        return hf_model(cfg.checkpoint.initial_load_hf)[1]
    return get_model_args(cfg.model.name, cfg.model.flavor)


def _hf_shape(src: Source, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face tensor's shape for a ray_titan tensor of ``shape`` (the inverse of
    ``hf_import._from_hf_layout``)."""
    if src.transpose:
        shape = (*shape[:-2], shape[-1], shape[-2])
    if src.cols is not None:
        shape = (*shape[:-1], shape[-1] * src.cols[1])
    return shape


def _expected_shapes(spec: ModelSpec, args: Any) -> tuple[dict[str, tuple[int, ...]], dict[str, Source]]:
    """Hugging Face tensor name -> shape the model needs, and the sources by ray_titan name."""
    with torch.device("meta"):
        model = build_model(spec.name, "", args=args)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    sources = spec.hf.sources(args)
    want: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        src = sources[name]
        for key in src.keys:
            want[key] = shape[1:] if src.stacked else _hf_shape(src, shape)
    return want, sources

