"""Tokenizers: byte-level (the default) and Hugging Face ``tokenizer.json`` files.

Both expose ``vocab_size``, ``bos_id``, ``eos_id`` and ``encode(text) -> list[int]`` (no special
tokens added; the packer adds BOS/EOS).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "build_tokenizer"]


class Tokenizer:
    """Interface: ``vocab_size`` ids in ``[0, vocab_size)``, including ``bos_id`` and ``eos_id``;
    ``max_id`` is the largest id it can produce (the model's embedding has ``vocab_size`` rows,
    so a tokenizer with ``max_id >= vocab_size`` cannot be trained on: pre-flight refuses it)."""

    vocab_size: int
    bos_id: int
    eos_id: int
    max_id: int

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as a 1-D int64 array, without BOS/EOS."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, BOS = 256, EOS = 257 (vocabulary 258)."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    max_id = 257

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


# Names under which tokenizer.json files commonly declare their document delimiters.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|endoftext|>", "[CLS]", "<bos>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "[SEP]", "<eos>")


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` package (offline), from a
    local path or a URI pyarrow's filesystems read.

    BOS/EOS are the ``bos_token`` / ``eos_token`` of a ``tokenizer_config.json`` beside it (a
    Hugging Face model directory's), else the first of the usual special-token names the file
    defines. Raises ``FileNotFoundError`` for a missing file and ``ValueError`` when no BOS/EOS
    token is found or a file is larger than its bound (``storage.FileTooLargeError``, naming it:
    ``MAX_TOKENIZER_BYTES``, ``MAX_CONFIG_BYTES``; checked before it is read).
    """

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tok

        from ray_titan import storage

        path = str(path)
        if not storage.exists(path):
            raise FileNotFoundError(f"data.tokenizer_path = {path!r} does not exist")
        self._tok = _Tok.from_str(storage.read_text(path, storage.MAX_TOKENIZER_BYTES, "MAX_TOKENIZER_BYTES"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.max_id = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)
        declared = _declared_special_tokens(storage.sibling(path, "tokenizer_config.json"))
        self.bos_id = self._find((*declared[:1], *_BOS_NAMES), "BOS", path)
        self.eos_id = self._find((*declared[1:], *_EOS_NAMES), "EOS", path)

    def _find(self, names: tuple[str, ...], what: str, path: str) -> int:
        for name in names:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return tid
        raise ValueError(f"tokenizer {path!r} defines no {what} token (looked for {names})")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def _declared_special_tokens(config_path: str) -> tuple[str, ...]:
    """``(bos_token, eos_token)`` a ``tokenizer_config.json`` declares (strings, or dicts with
    ``content``), or ``()`` when there is no such file or it declares neither."""
    import json

    from ray_titan import storage

    try:
        config = json.loads(storage.read_text(config_path, storage.MAX_CONFIG_BYTES, "MAX_CONFIG_BYTES"))
    except storage.FileTooLargeError:
        raise  # a huge file where a small one belongs: say so rather than ignore it
    except Exception:  # no file (a bare tokenizer.json) or not one we can read: use the usual names
        return ()
    names: list[str] = []
    for token in (config.get("bos_token"), config.get("eos_token")):
        name = token.get("content") if isinstance(token, dict) else token
        if not isinstance(name, str):
            return ()
        names.append(name)
    return tuple(names)


def build_tokenizer(kind: str, path: str | None = None) -> Tokenizer:
    """``kind`` is ``"byte"`` or ``"huggingface"`` (then ``path`` is the ``tokenizer.json``)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "huggingface":
        if not path:
            raise ValueError("data.tokenizer = 'huggingface' needs data.tokenizer_path (a tokenizer.json)")
        return HFTokenizer(path)
    raise ValueError(f"data.tokenizer = {kind!r}; valid: 'byte', 'huggingface'")
