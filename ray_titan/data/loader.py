"""Packing documents into fixed-length sequences and handing each DP rank its part of a batch.

Documents are visited in an order drawn from the seed (a new permutation each epoch), each
tokenized as ``[BOS] + tokens + [EOS]`` and appended to one stream, which is cut into chunks of
``seq_len + 1`` tokens (no padding, no token used twice). A step's global batch is the next
``global_batch_size`` chunks; DP rank ``r`` of ``D`` takes chunks ``[r·B/D, (r+1)·B/D)``. So the
ranks read disjoint parts, and the union over ranks is exactly what a one-worker run reads.

Subclasses choose how a document becomes tokens (:meth:`PackedLoader._tokens`): supervised
examples (``ray_titan.data.sft``) mark the tokens that are no target of the loss (a prompt's) by
storing them complemented (``~id``, negative) in the stream, so the position stays one token
array; their labels come out as ``IGNORE_INDEX``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from ray_titan.data.tokenizer import Tokenizer

__all__ = ["IGNORE_INDEX", "BufferedPackedLoader", "PackedLoader"]

IGNORE_INDEX = -100
"""The label of a token that is no target of the loss (``torch.nn.functional.cross_entropy``'s default)."""


class PackedLoader:
    """Iterator over ``(inputs, labels)`` for one DP rank.

    Each is an int64 tensor ``(global_batch_size // dp_degree, seq_len)``; ``labels`` is
    ``inputs`` shifted left by one token. The position (:meth:`state_dict`) is three integers:
    the epoch, the index in that epoch's order of the document holding the next unread token,
    and that token's offset in the document's ``[BOS] + tokens + [EOS]``; a resumed loader
    re-tokenizes that document and continues the same stream, token for token. So a checkpoint's
    data position is the same size whatever the documents' length.

    Tokens read but not yet used stay as the documents' own arrays (int32), never concatenated
    into one buffer, so a long document costs its tokens once and no step copies it.

    Raises ``ValueError`` if ``global_batch_size`` is not divisible by ``dp_degree`` or the
    corpus is empty.
    """

    masked = False
    """Whether some labels are :data:`IGNORE_INDEX` (then :attr:`counted_tokens` is set)."""
    counted_tokens: int | None = None
    """Labels that count in the loss in the last global batch (all data-parallel ranks' slices);
    None when every label counts."""
    source_tokens: list[int] | None = None
    """With a mixture (``ray_titan.data.mixing``): the label tokens of the last batch's slice
    taken from each source; None otherwise."""

    def __init__(
        self,
        texts: pa.ChunkedArray,
        tokenizer: Tokenizer,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        seed: int = 0,
    ):
        if global_batch_size % dp_degree:
            raise ValueError(f"global_batch_size {global_batch_size} not divisible by DP degree {dp_degree}")
        if len(texts) == 0:
            raise ValueError("the corpus has no documents")
        self.texts, self.tok = texts, tokenizer
        self.seq_len, self.seed = seq_len, seed
        self.local_batch = global_batch_size // dp_degree
        self.first = dp_rank * self.local_batch
        self.global_batch = global_batch_size
        self.epoch, self.doc_pos = 0, 0  # the next document to tokenize
        self._order = self._permutation(0)
        # Documents tokenized and not used up, oldest first: (epoch, index in order, tokens).
        self._docs: deque[tuple[int, int, np.ndarray]] = deque()
        self._offset = 0  # tokens of the oldest of them already used
        self._have = 0  # unused tokens in self._docs

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.texts))

    def _tokenize_next(self) -> None:
        if self.doc_pos == len(self._order):
            self.epoch, self.doc_pos = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        ids = self._tokens(int(self._order[self.doc_pos])).astype(np.int32)
        self._docs.append((self.epoch, self.doc_pos, ids))
        self._have += len(ids)
        self.doc_pos += 1

    def _take(self, n: int) -> np.ndarray:
        """The next ``n`` tokens of the stream (int64)."""
        while self._have - self._offset < n:
            self._tokenize_next()
        parts = []
        while n:
            ids = self._docs[0][2]
            part = ids[self._offset : self._offset + n]
            parts.append(part)
            n -= len(part)
            self._offset += len(part)
            if self._offset == len(ids):
                self._docs.popleft()
                self._have -= len(ids)
                self._offset = 0
        return np.concatenate(parts).astype(np.int64)

    def _tokens(self, index: int) -> np.ndarray:
        """Document ``index`` as stored in the stream: ``[BOS] + tokens + [EOS]``, int64."""
        ids = self.tok.encode(self.texts[index].as_py())
        return np.concatenate(([self.tok.bos_id], ids, [self.tok.eos_id])).astype(np.int64)

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.seq_len + 1
        rows = self._take(self.global_batch * chunk).reshape(self.global_batch, chunk)
        mine = rows[self.first : self.first + self.local_batch]
        if self.masked:
            self.counted_tokens = int((rows[:, 1:] >= 0).sum())
            inputs = np.where(mine[:, :-1] < 0, ~mine[:, :-1], mine[:, :-1])
            labels = np.where(mine[:, 1:] < 0, IGNORE_INDEX, mine[:, 1:])
            return torch.from_numpy(inputs), torch.from_numpy(labels)
        t = torch.from_numpy(np.ascontiguousarray(mine))
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def state_dict(self) -> dict[str, int]:
        """Position of the next unread token: ``epoch``, ``doc_pos`` (the index in that epoch's
        order of its document) and ``offset`` (tokens of that document already used)."""
        if self._docs:
            epoch, pos, _ = self._docs[0]
            return {"epoch": epoch, "doc_pos": pos, "offset": self._offset}
        return {"epoch": self.epoch, "doc_pos": self.doc_pos, "offset": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` of a loader with the same corpus, tokenizer, seed
        and shapes. Raises ``ValueError`` for a position outside the corpus."""
        epoch, pos, offset = int(state["epoch"]), int(state["doc_pos"]), int(state["offset"])
        if not (epoch >= 0 and 0 <= pos <= len(self.texts) and offset >= 0):
            raise ValueError(f"data position {state} is outside this corpus of {len(self.texts)} documents")
        self.epoch, self.doc_pos = epoch, pos
        self._order = self._permutation(epoch)
        self._docs.clear()
        self._have = self._offset = 0
        if offset:
            self._tokenize_next()
            if offset >= self._have:
                raise ValueError(f"data position {state}: that document has only {self._have} tokens")
            self._offset = offset


class BufferedPackedLoader(PackedLoader):
    """A :class:`PackedLoader` whose unread tokens are one buffer, saved in its position:
    for streams that cannot be re-read from a document index (a weighted mixture, a Ray Data
    stream). Subclasses fill :attr:`_buffer` in :meth:`_fill` and restore it in
    ``load_state_dict``."""

    _buffer: np.ndarray = np.empty(0, dtype=np.int64)

    def _fill(self, n_tokens: int) -> None:
        raise NotImplementedError

    def _take(self, n: int) -> np.ndarray:
        self._fill(n)
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        return out

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream: epoch, documents consumed, and the tokens read but unused."""
        return {"epoch": self.epoch, "doc_pos": self.doc_pos, "buffer": self._buffer.copy()}
