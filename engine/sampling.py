"""Seeded sampling that no drafter can change: the Gumbel-max race over per-position noise.

With a seed, the token at sequence position t is

    x_t = argmax_v  p_t(v) / E_t(v),    E_t(v) ~ Exp(1) i.i.d., a function of (seed, t, v) only

where p_t is the target's (temperature, top-k, top-p) distribution after the prefix. This is
the exponential race, the Gumbel-max trick written without logarithms: x_t is distributed
exactly as p_t, and it is a function of (prefix, seed, t) alone. Verification checks each
draft token against x_t exactly as greedy verification checks it against the argmax, so the
text is, token for token, what plain sampling with that seed gives, whatever was drafted,
whatever shares the batch (Daliri, Musco and Suresh, "Coupling without Communication and
Drafter-Invariant Speculative Decoding", 2024).

A drafter with a distribution of its own (early exit's q) draws its proposal from the same
noise, argmax_v q(v) / E_t(v); it then agrees with the target with probability at least
(1 - TV(p, q)) / (1 + TV(p, q)).

Noise: E_t(v) = -log(1 - U), U uniform in [0, 1) at float64 (53 bits) from a generator
seeded by a 64-bit hash of (seed, t); a zero E (probability 2^-53 per entry) is raised to the
smallest normal double.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

_TINY = torch.finfo(torch.float64).tiny


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 64-bit seed from ``seed`` and ``keys`` (a choice index, a purpose): distinct keys
    give independent streams."""
    text = ":".join(str(k) for k in (seed % 2**64, *keys))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class PositionNoise:
    """Exp(1) noise per (seed, position) over the vocabulary; positions are indices in the
    sequence (prompt included), so position t's noise never depends on how it was reached."""

    def __init__(self, seed: int, vocab_size: int):
        self.seed = seed % 2**64
        self.vocab_size = vocab_size
        self._gen = torch.Generator()
        self._cache: dict[int, Tensor] = {}

    def exponentials(self, pos: int) -> Tensor:
        """(V,) float64 Exp(1) draws for position ``pos``."""
        e = self._cache.get(pos)
        if e is None:
            self._gen.manual_seed(derive_seed(self.seed, pos))
            u = torch.rand(self.vocab_size, dtype=torch.float64, generator=self._gen)
            e = self._cache[pos] = torch.log1p(-u).neg_().clamp_min_(_TINY)
        return e

    def draw(self, probs: Tensor, pos: int) -> int:
        """The token at ``pos`` under ``probs`` (V,): argmax p / E, exactly distributed as p."""
        return int((probs.double() / self.exponentials(pos)).argmax())

    def forget_before(self, pos: int) -> None:
        """Drop the noise of positions below ``pos`` (they are committed)."""
        for p in [p for p in self._cache if p < pos]:
            del self._cache[p]
