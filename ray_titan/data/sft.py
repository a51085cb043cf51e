"""Supervised fine-tuning data: prompt/response pairs or chat messages, loss on responses only.

An example becomes one document of the packed stream (``ray_titan.data.loader``), its tokens
that are no target of the loss (BOS, the prompt, the chat template's headers and the other
roles' messages) stored complemented so that their labels come out as ``IGNORE_INDEX``:

- ``data.format = "prompt_response"``: ``[BOS] prompt response [EOS]``; the response and EOS
  are targets.
- ``data.format = "messages"``: the conversation rendered with the tokenizer's chat template (a
  Jinja template, as Hugging Face's ``apply_chat_template`` renders it: ``messages``,
  ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``raise_exception``), preceded by BOS
  unless the template starts with it. Each assistant message's tokens, up to the template's
  end-of-turn text, are targets; the generation prompt before it (``<|assistant|>``-like
  headers) is not. The template is rendered on growing prefixes of the conversation, so it
  must render a conversation as the concatenation of its prefixes' renderings (chat templates
  do); one that does not is refused with the example's index.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ray_titan.config.schema import ConfigError, Data
from ray_titan.data.loader import PackedLoader
from ray_titan.data.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "SFTLoader", "example_columns", "find_chat_template", "tokenize_example"]


def example_columns(data: Data) -> list[str]:
    """The columns a source of ``data.format`` is read with."""
    if data.format == "prompt_response":
        return [data.prompt_column, data.response_column]
    if data.format == "messages":
        return [data.messages_column]
    return [data.text_column]


def find_chat_template(data: Data) -> Path:
    """The chat template file: ``data.chat_template_path``, else ``tokenizer_config.json`` or
    ``chat_template.jinja`` beside ``data.tokenizer_path``. Raises :class:`ConfigError`."""
    if data.chat_template_path:
        path = Path(data.chat_template_path)
        if not path.is_file():
            raise ConfigError(f"data.chat_template_path = {data.chat_template_path!r} does not exist")
        return path
    if data.tokenizer_path:
        for name in ("chat_template.jinja", "tokenizer_config.json"):
            path = Path(data.tokenizer_path).parent / name
            if path.is_file():
                return path
    raise ConfigError(
        "data.format = 'messages' needs a chat template: set data.chat_template_path to a tokenizer_config.json "
        "(with a chat_template) or a chat_template.jinja file, or put one beside data.tokenizer_path"
    )


def _token_text(value: Any) -> str:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class ChatTemplate:
    """A Hugging Face chat template, rendered with Jinja2's sandbox as ``transformers`` does
    (``trim_blocks``, ``lstrip_blocks``, loop controls, ``raise_exception``).

    ``path``: a ``tokenizer_config.json`` whose ``chat_template`` is a string (or a list of
    ``{"name", "template"}``, the ``default`` one taken) or a ``.jinja`` file. Raises
    :class:`ConfigError` for a file without a template or a template Jinja cannot parse.
    """

    def __init__(self, path: str | Path):
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        path = Path(path)
        self.bos_token = self.eos_token = ""
        if path.suffix == ".json":
            config = json.loads(path.read_text())
            source = config.get("chat_template")
            if isinstance(source, list):
                source = next((t["template"] for t in source if t.get("name") == "default"), None)
            self.bos_token, self.eos_token = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        else:
            source = path.read_text()
        if not source:
            raise ConfigError(f"{str(path)!r} has no chat_template")

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise ConfigError(f"chat template of {str(path)!r} does not parse: {e}") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The conversation as text (special tokens as their text)."""
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token)


def _pieces(example: dict[str, Any], data: Data, template: ChatTemplate | None) -> list[tuple[str, bool]]:
    """The example's text as ``(piece, is_target)`` in order."""
    if data.format == "prompt_response":
        return [(example[data.prompt_column] or "", False), (example[data.response_column] or "", True)]
    assert template is not None  # format = "messages"
    messages = example[data.messages_column] or []
    out: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        full = template.render(messages[: i + 1])
        if message.get("role") == "assistant":
            head = template.render(messages[:i], add_generation_prompt=True)
            pieces = [(head, False), (full, True)]
        else:
            pieces = [(full, False)]
        for text, target in pieces:
            if not text.startswith(done):
                raise ValueError(
                    "the chat template does not render a conversation as the concatenation of its prefixes' "
                    f"renderings (at message {i}); it cannot mark the assistant's tokens"
                )
            out.append((text[len(done):], target))
            done = text
    return out


def tokenize_example(example: dict[str, Any], data: Data, tokenizer: Tokenizer,
                     template: ChatTemplate | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, is_target)``: an example's tokens (int64) with BOS first, EOS last for
    ``prompt_response``, and whether each is a target of the loss (bool), per the module
    docstring. ``template`` is needed for ``format = "messages"``."""
    ids, targets = [np.array([tokenizer.bos_id], np.int64)], [np.zeros(1, bool)]
    for text, target in _pieces(example, data, template):
        piece = tokenizer.encode(text) if text else np.empty(0, np.int64)
        if len(ids) == 1 and len(piece) and piece[0] == tokenizer.bos_id:
            piece = piece[1:]  # the template starts with BOS: keep one
        ids.append(piece)
        targets.append(np.full(len(piece), target))
    if data.format == "prompt_response":
        ids.append(np.array([tokenizer.eos_id], np.int64))
        targets.append(np.ones(1, bool))
    return np.concatenate(ids).astype(np.int64), np.concatenate(targets)


class SFTLoader(PackedLoader):
    """:class:`PackedLoader` over supervised examples (a table with :func:`example_columns`):
    labels that are no target are ``IGNORE_INDEX``; :attr:`counted_tokens` counts the targets
    of each global batch. Shapes, slicing and state as :class:`PackedLoader`'s."""

    masked = True

    def __init__(self, examples: pa.Table, tokenizer: Tokenizer, data: Data, *args: Any, **kwargs: Any):
        super().__init__(examples, tokenizer, *args, **kwargs)
        self.data = data

    @cached_property
    def _template(self) -> ChatTemplate | None:
        return ChatTemplate(find_chat_template(self.data)) if self.data.format == "messages" else None

    def _tokens(self, index: int) -> np.ndarray:
        example = self.texts.slice(index, 1).to_pylist()[0]
        ids, targets = tokenize_example(example, self.data, self.tok, self._template)
        return np.where(targets, ids, ~ids)
