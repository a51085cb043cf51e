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

from typing import Any

import numpy as np
import pyarrow as pa
import torch

from ray_titan.data.tokenizer import Tokenizer

__all__ = ["IGNORE_INDEX", "PackedLoader"]

IGNORE_INDEX = -100
"""The label of a token that is no target of the loss (``torch.nn.functional.cross_entropy``'s default)."""


class PackedLoader:
    """Iterator over ``(inputs, labels)`` for one DP rank.

    Each is an int64 tensor ``(global_batch_size // dp_degree, seq_len)``; ``labels`` is
    ``inputs`` shifted left by one token. The position is a small host-side state
    (:meth:`state_dict`), so a resumed run continues the same stream.

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
        self.epoch, self.doc_pos = 0, 0
        self._order = self._permutation(0)
        self._buffer = np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.texts))

    def _fill(self, n_tokens: int) -> None:
        parts = [self._buffer]
        have = len(self._buffer)
        while have < n_tokens:
            if self.doc_pos == len(self._order):
                self.epoch, self.doc_pos = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            parts.append(self._tokens(int(self._order[self.doc_pos])))
            self.doc_pos += 1
            have += len(parts[-1])
        self._buffer = np.concatenate(parts)

    def _tokens(self, index: int) -> np.ndarray:
        """Document ``index`` as stored in the stream: ``[BOS] + tokens + [EOS]``, int64."""
        ids = self.tok.encode(self.texts[index].as_py())
        return np.concatenate(([self.tok.bos_id], ids, [self.tok.eos_id])).astype(np.int64)

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.seq_len + 1
        need = self.global_batch * chunk
        self._fill(need)
        batch, self._buffer = self._buffer[:need], self._buffer[need:]
        rows = batch.reshape(self.global_batch, chunk)
        if self.masked:
            self.counted_tokens = int((rows[:, 1:] >= 0).sum())
            mine = rows[self.first : self.first + self.local_batch]
            inputs = np.where(mine[:, :-1] < 0, ~mine[:, :-1], mine[:, :-1])
            labels = np.where(mine[:, 1:] < 0, IGNORE_INDEX, mine[:, 1:])
            return torch.from_numpy(inputs), torch.from_numpy(labels)
        mine = rows[self.first : self.first + self.local_batch]
        t = torch.from_numpy(np.ascontiguousarray(mine))
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream: epoch, next document, and the tokens already read but unused."""
        return {"epoch": self.epoch, "doc_pos": self.doc_pos, "buffer": self._buffer.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` of a loader with the same corpus, seed and shapes."""
        self.epoch, self.doc_pos = int(state["epoch"]), int(state["doc_pos"])
        self._order = self._permutation(self.epoch)
        self._buffer = np.asarray(state["buffer"], dtype=np.int64)
