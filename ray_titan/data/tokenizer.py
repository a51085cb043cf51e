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
    """A Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` package (offline).

    BOS/EOS are the first of the usual special-token names the file defines. Raises
    ``FileNotFoundError`` for a missing file and ``ValueError`` when no BOS/EOS token is found.
    """

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"data.tokenizer_path = {str(path)!r} does not exist")
        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.max_id = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)
        self.bos_id = self._find(_BOS_NAMES, "BOS", path)
        self.eos_id = self._find(_EOS_NAMES, "EOS", path)

    def _find(self, names: tuple[str, ...], what: str, path: Path) -> int:
        for name in names:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return tid
        raise ValueError(f"tokenizer {str(path)!r} defines no {what} token (looked for {names})")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def build_tokenizer(kind: str, path: str | None = None) -> Tokenizer:
    """``kind`` is ``"byte"`` or ``"huggingface"`` (then ``path`` is the ``tokenizer.json``)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "huggingface":
        if not path:
            raise ValueError("data.tokenizer = 'huggingface' needs data.tokenizer_path (a tokenizer.json)")
        return HFTokenizer(path)
    raise ValueError(f"data.tokenizer = {kind!r}; valid: 'byte', 'huggingface'")
