"""Automatic prefix caching: a prompt's first rows, computed once, copied into the next
sequence whose prompt starts with the same tokens.

A prompt is cut into blocks of ``BLOCK`` tokens. After a prefill, each whole block of the
prompt is kept -- its keys and values in every layer and its rows' final hidden states --
under a key made of its tokens and its parent block's id, so a block is found only after
every block before it (vLLM's hashed blocks; here the key holds the tokens themselves, so
two prefixes never share a block by a hash collision). A new prompt takes the longest run
of kept blocks that starts it, at most ``len(prompt) - 1`` tokens: the last prompt token is
always computed, its row gives the first token. Its rows are copied into the sequence's
slot, and the prefill starts after them.

What is kept is exactly what a prefill computes, so every later use is the same: the
drafters get every prompt row's features (EAGLE's cache is built from them), the prompt's
logprobs are scored from the kept hidden states. The rows are the ones the prefill that
stored them computed: where that prefill ran other passes (eager before the compiled ones
were ready, or a chunk of another length), they can differ from this prompt's own in the
last bits, as two chunkings of one prompt do.

Bounded by bytes: past ``capacity_bytes`` the least recently used blocks go, the deepest
of a chain first (a used chain is touched from its end back to its first block), so a
block's parent outlives it. Not thread-safe: the engine's thread owns it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK = 16  # tokens a block holds (vLLM's default block size)


@dataclass
class _Block:
    id: int
    k: Tensor  # (layers, heads, BLOCK, head_dim)
    v: Tensor
    hidden: Tensor  # (BLOCK, dim): the rows' final residual stream

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.hidden))


class PrefixCache:
    """Whole prompt blocks of one model's KV cache, kept between sequences (see the
    module's docstring)."""

    def __init__(self, capacity_bytes: int, block: int = BLOCK):
        if block < 1:
            raise ValueError(f"block must be at least 1, got {block}")
        self.capacity_bytes = capacity_bytes
        self.block = block
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], _Block] = OrderedDict()
        self._ids = itertools.count(1)
        self.nbytes = 0
        # prompt tokens looked up, and how many of them were found (vLLM's
        # prefix_cache_queries / prefix_cache_hits)
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def _chain(self, tokens: list[int], n_blocks: int) -> list[tuple[tuple, _Block]]:
        """The kept blocks that start ``tokens``, at most ``n_blocks`` of them, with their
        keys."""
        out: list[tuple[tuple, _Block]] = []
        parent = 0
        for b in range(n_blocks):
            key = (parent, tuple(tokens[b * self.block:(b + 1) * self.block]))
            blk = self._blocks.get(key)
            if blk is None:
                break
            out.append((key, blk))
            parent = blk.id
        return out

    def _touch(self, keys: list[tuple]) -> None:
        for key in reversed(keys):  # the first block ends most recent: evicted last
            self._blocks.move_to_end(key)

    def load(self, prompt: list[int], cache, slot: int) -> Tensor | None:
        """Copy the longest kept prefix of ``prompt`` (whole blocks, at most
        ``len(prompt) - 1`` tokens) into rows [0, n) of ``slot`` in every layer; set the
        slot's length to n and return the rows' final hidden states (n, dim), or None
        (n = 0: nothing kept starts the prompt; the slot is untouched)."""
        self.queries += len(prompt)
        if self.capacity_bytes <= 0:
            return None
        chain = self._chain(prompt, (len(prompt) - 1) // self.block)
        if not chain:
            return None
        n = len(chain) * self.block
        self._touch([key for key, _ in chain])
        with torch.inference_mode():
            for b, (_, blk) in enumerate(chain):
                rows = slice(b * self.block, (b + 1) * self.block)
                cache.k[:, slot, :, rows] = blk.k
                cache.v[:, slot, :, rows] = blk.v
        cache.set_length(slot, n)
        self.hits += n
        return torch.cat([blk.hidden for _, blk in chain])

    def store(self, prompt: list[int], n_rows: int, cache, slot: int, hidden: Tensor) -> None:
        """Keep the whole blocks of ``prompt`` among its first ``n_rows`` rows, computed in
        ``slot`` of ``cache`` (committed there), with ``hidden`` (at least n_rows, dim) their
        final hidden states. Blocks already kept are only marked used."""
        if self.capacity_bytes <= 0:
            return
        n_blocks = min(n_rows, len(prompt)) // self.block
        parent, keys = 0, []
        with torch.inference_mode():
            for b in range(n_blocks):
                rows = slice(b * self.block, (b + 1) * self.block)
                key = (parent, tuple(prompt[rows]))
                blk = self._blocks.get(key)
                if blk is None:
                    blk = _Block(next(self._ids), cache.k[:, slot, :, rows].clone(),
                                 cache.v[:, slot, :, rows].clone(), hidden[rows].clone())
                    self._blocks[key] = blk
                    self.nbytes += blk.nbytes
                keys.append(key)
                parent = blk.id
        self._touch(keys)
        self._evict()

    def _evict(self) -> None:
        """Least recently used blocks out until the rest fit. The chain just used is the
        most recent, its first block last of all: a chain over the capacity alone loses
        its deepest blocks first."""
        while self.nbytes > self.capacity_bytes and self._blocks:
            _, blk = self._blocks.popitem(last=False)
            self.nbytes -= blk.nbytes
