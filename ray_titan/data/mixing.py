"""Weighted mixtures of sources (``data.sources``).

Each document of the packed stream is drawn from one source: the ``k``-th document's source is
entry ``k % 4096`` of block ``k // 4096`` of draws from a generator seeded by
``(training.seed, block)``, with probabilities proportional to the weights. Each source keeps
its own order (a permutation per epoch, as :class:`~ray_titan.data.loader.PackedLoader`'s). So
the mixture is a function of the seed alone, and its position is a handful of integers (the
documents drawn, each source's epoch and next document) plus the unused tokens and their
sources: a resumed run continues the same stream exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ray_titan.data.loader import BufferedPackedLoader, PackedLoader

__all__ = ["MixedLoader"]

_BLOCK = 4096
_MIX_STREAM = 0x6D6978  # keeps the mixture's draws apart from the sources' permutations


class MixedLoader(BufferedPackedLoader):
    """A :class:`PackedLoader` whose documents come from several sources.

    ``sources``: one loader per source (with the same shapes, used for its documents' order and
    tokenization only); ``weights``: positive, one per source. Batches, slicing and masks as
    :class:`PackedLoader`'s; after each batch :attr:`source_tokens` holds, per source, the label
    tokens of this rank's slice that came from it. Raises ``ValueError`` for weights that are
    not positive or do not match the sources.
    """

    def __init__(self, sources: list[PackedLoader], weights: list[float], seed: int = 0):
        if len(sources) != len(weights) or not sources:
            raise ValueError(f"{len(sources)} sources but {len(weights)} weights")
        if any(not w > 0 for w in weights):
            raise ValueError(f"mixture weights must be positive, got {weights}")
        first = sources[0]
        self.tok, self.texts = first.tok, first.texts
        self.seq_len, self.seed = first.seq_len, seed
        self.local_batch, self.first, self.global_batch = first.local_batch, first.first, first.global_batch
        self.masked = first.masked
        self.sources = sources
        self.probabilities = np.asarray(weights, dtype=float) / sum(weights)
        self.drawn = 0
        self._block: tuple[int, np.ndarray] | None = None
        self._buffer = np.empty(0, dtype=np.int64)
        self._buffer_sources = np.empty(0, dtype=np.int64)
        self.source_tokens: list[int] = [0] * len(sources)

    def _choice(self, k: int) -> int:
        block = k // _BLOCK
        if self._block is None or self._block[0] != block:
            rng = np.random.default_rng([self.seed, _MIX_STREAM, block])
            self._block = (block, rng.choice(len(self.sources), size=_BLOCK, p=self.probabilities))
        return int(self._block[1][k % _BLOCK])

    def _fill(self, n_tokens: int) -> None:
        parts, owners = [self._buffer], [self._buffer_sources]
        have = len(self._buffer)
        while have < n_tokens:
            s = self._choice(self.drawn)
            self.drawn += 1
            src = self.sources[s]
            if src.doc_pos == len(src._order):
                src.epoch, src.doc_pos = src.epoch + 1, 0
                src._order = src._permutation(src.epoch)
            parts.append(src._tokens(int(src._order[src.doc_pos])))
            src.doc_pos += 1
            owners.append(np.full(len(parts[-1]), s, dtype=np.int64))
            have += len(parts[-1])
        self._buffer, self._buffer_sources = np.concatenate(parts), np.concatenate(owners)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        need = self.global_batch * (self.seq_len + 1)
        self._fill(need)
        owners = self._buffer_sources[:need].reshape(self.global_batch, -1)
        mine = owners[self.first : self.first + self.local_batch, 1:]  # the labels' tokens
        self.source_tokens = np.bincount(mine.ravel(), minlength=len(self.sources)).tolist()
        self._buffer_sources = self._buffer_sources[need:]
        return super().__next__()

    def state_dict(self) -> dict[str, Any]:
        """The mixture's position: documents drawn, each source's epoch and next document, and
        the unused tokens with their sources."""
        return {"epoch": 0, "doc_pos": self.drawn, "buffer": self._buffer.copy(),
                "buffer_sources": self._buffer_sources.copy(),
                "source_epochs": np.array([s.epoch for s in self.sources], dtype=np.int64),
                "source_doc_pos": np.array([s.doc_pos for s in self.sources], dtype=np.int64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` of a mixture of the same sources, weights and seed."""
        self.drawn = int(state["doc_pos"])
        self._buffer = np.asarray(state["buffer"], dtype=np.int64)
        self._buffer_sources = np.asarray(state["buffer_sources"], dtype=np.int64)
        for src, epoch, pos in zip(self.sources, state["source_epochs"], state["source_doc_pos"]):
            src.epoch, src.doc_pos = int(epoch), int(pos)
            src._order = src._permutation(src.epoch)
