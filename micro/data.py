"""Token streams for training and evaluation, and the rows that teach micro to copy.

Each split's documents are encoded and joined by ``<|endoftext|>`` into one id stream,
cached on disk keyed by the tokenizer's and the text's hashes (encoding takes seconds,
not minutes, but every eval and every test would pay it).

Copy rows (the induction recipe): a passage P appears, a little unrelated text follows,
then P again (sometimes a third time), then ordinary text fills the row. P is

- usually a passage of the train split, a share of them edited first (every occurrence of
  one token replaced by another), so the only way to predict the repeat is to read the
  first copy, not to remember the corpus;
- sometimes (``random_frac``) a string of uniformly random tokens: nothing but copying
  predicts its repeat, which is what makes induction heads form early (Olsson et al.,
  2022) instead of late in a short CPU run.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from nodraft.micro.corpus import split_documents
from nodraft.micro.tokenizer import Tokenizer


def cache_dir() -> Path:
    d = Path(os.environ.get("NODRAFT_CACHE", Path.home() / ".cache" / "nodraft"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def token_stream(tok: Tokenizer, split: str) -> np.ndarray:
    """The split's documents as one int32 id stream, each document followed by EOT."""
    texts = [d.text for d in split_documents(split)]
    h = hashlib.sha256(tok.hf.to_str().encode())
    for t in texts:
        h.update(t.encode())
    path = cache_dir() / f"{split}-{h.hexdigest()[:16]}.npy"
    if path.exists():
        return np.load(path)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc)
        ids.append(tok.eot_id)
    arr = np.asarray(ids, dtype=np.int32)
    np.save(path, arr)
    return arr


class RowSampler:
    """Random training rows of length T+1 from a stream, a fraction of them copy rows."""

    def __init__(self, stream: np.ndarray, T: int, copy_frac: float, edit_frac: float = 0.3,
                 random_frac: float = 0.25, vocab: tuple[int, int] = (5, 4096), seed: int = 0):
        self.stream, self.T = torch.from_numpy(stream.astype(np.int64)), T
        self.copy_frac, self.edit_frac, self.random_frac = copy_frac, edit_frac, random_frac
        self.vocab = vocab  # the ordinary (non-special) token ids
        self.gen = torch.Generator().manual_seed(seed)

    def _randint(self, lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=self.gen))

    def _span(self, n: int) -> torch.Tensor:
        a = self._randint(0, len(self.stream) - n)
        return self.stream[a:a + n]

    def copy_row(self) -> torch.Tensor:
        n = self.T + 1
        L = self._randint(16, min(161, n // 3))
        r = float(torch.rand(1, generator=self.gen))
        if r < self.random_frac:
            passage = torch.randint(*self.vocab, (L,), generator=self.gen)
        else:
            passage = self._span(L).clone()
            if r < self.random_frac + self.edit_frac * (1 - self.random_frac):
                old = passage[self._randint(0, L)]
                passage[passage == old] = self.stream[self._randint(0, len(self.stream))]
        parts = [passage, self._span(self._randint(0, 97)), passage]
        if float(torch.rand(1, generator=self.gen)) < 0.3:  # a third copy
            parts += [self._span(self._randint(0, 33)), passage]
        row = torch.cat(parts)
        return torch.cat([row, self._span(max(0, n - len(row)))])[:n]

    def batch(self, B: int) -> torch.Tensor:
        rows = [self.copy_row() if float(torch.rand(1, generator=self.gen)) < self.copy_frac
                else self._span(self.T + 1) for _ in range(B)]
        return torch.stack(rows)  # (B, T+1)
