"""Seeded sampling that no drafter can change: a Gumbel-max race over per-position noise.

With a seed, the token at sequence position t is drawn from p_t (the target's (temperature,
top-k, top-p) distribution after the prefix) by a race whose noise is a function of
(seed, t) only, so x_t is a function of (prefix, seed, t) alone. Verification checks each
draft token against x_t exactly as greedy verification checks it against the argmax, so
the text is, token for token, what plain sampling with that seed gives, whatever was
drafted, whatever shares the batch (Daliri, Musco and Suresh, "Coupling without
Communication and Drafter-Invariant Speculative Decoding", 2024).

The race is the Gumbel-max trick taken in two levels. The vocabulary is cut into ``groups``
consecutive blocks of ``width`` token ids (about sqrt(V) each: 64 x 64 for micro). Then

    g_t = argmax_g  log m_t(g) + H_t(g),      m_t(g) = sum of p_t over group g
    x_t = argmax_{v in g_t}  l_t(v) / T + G_t(g_t, v)

with H and G independent standard Gumbel noise (-log E, E ~ Exp(1)) and l_t the logits
(top-k and top-p remove tokens before either argmax). The first argmax picks group g with
probability m_t(g), the second token v of it with probability p_t(v) / m_t(g): x_t is
distributed exactly as p_t. A flat race over the whole vocabulary would draw V noise
values per token (4096 here; generating them cost more than the target's own pass per
token under load); this one draws ``groups`` plus ``width``, and the within-group noise only
for the groups a race lands in.

Each argmax is computed without a logarithm, as the exponential race it equals: with
w_t(v) = exp(l_t(v) / T - max_u l_t(u) / T) (zero where a filter removed v) and E the
exponentials behind H and G, argmax_g log m + H = argmax_g m(g) / E(g) and argmax_v l / T
+ G = argmax_v w(v) / E(v) (the logarithm is increasing; the row's factor no argmax sees
cancels). A removed token or an emptied group has weight 0 and never wins.

A drafter with a distribution of its own (early exit's q) draws its proposal by the same
race over q; it then agrees with the target where both races pick the same group and the
same token in it: a Gumbel coupling at each level.

Noise: a hash of its name, so it is computed when a race needs it (every row of a packed
pass at once) and nothing is kept between passes: the group exponentials at position t are
the SHAKE256 output of ``race:<seed>:<t>``, the within-group ones of group g that of
``race:<seed>:<t>:<g>``, 64 bits per entry -- a 53-bit uniform U, then E = -log(1 - U) (a
zero E, probability 2^-53, is raised to the smallest normal double).
Weights and group masses are float32 (relative to the row's largest logit), the ratios to
the exponentials float64.

Two implementations of the same race: ``nodraft::race`` (micro/csrc/race.cpp: SHAKE256,
the weights' exponentials, top-k and top-p, and both argmaxes in one pass of C++ a row),
wherever this process has loaded nodraft's kernels -- as the compiled passes do
(``micro.gemm``) -- and numpy array operations elsewhere (eager passes, no compiler, or
``NODRAFT_RACE=numpy``), over logits that ``engine.verify.kept`` masked first.
They read the same noise, bit for bit, and compute the weights' exponentials differently
in the last places of a float32, so they pick the same token but where two ratios tie to
that rounding (9,000 of 9,000 random rows agreed in ``benchmarks/race.py --kernel``;
tests/engine/test_race_kernel.py): a seeded text can differ between eager and compiled
serving at such a tie, as the passes' logits themselves can.
"""

from __future__ import annotations

import hashlib
import math
import os

import numpy as np
import torch
from torch import Tensor

from nodraft.micro import gemm

_TINY = np.finfo(np.float64).tiny
_U64 = np.uint64


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 64-bit seed from ``seed`` and ``keys`` (a choice index, a purpose): distinct keys
    give independent streams."""
    text = ":".join(str(k) for k in (seed % 2**64, *keys))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def group_shape(vocab_size: int) -> tuple[int, int]:
    """(groups, width): the race's cut of the vocabulary, ``groups * width >= V``."""
    width = math.isqrt(vocab_size - 1) + 1 if vocab_size > 1 else 1
    return -(-vocab_size // width), width


def exponentials(streams: list[bytes], n: int) -> np.ndarray:
    """(len(streams), n) float64 standard exponential noise, E ~ Exp(1): row r from the
    SHAKE256 output of ``streams[r]``, 64 bits per entry -- its top 53 a uniform U,
    E = -log(1 - U), never below the smallest normal double."""
    raw = b"".join([hashlib.shake_256(s).digest(8 * n) for s in streams])
    u = (np.frombuffer(raw, dtype="<u8").reshape(len(streams), n) >> _U64(11)) * -(2.0 ** -53)
    e = np.log1p(u, out=u)  # log(1 - U) = -E
    np.negative(e, out=e)
    return np.maximum(e, _TINY, out=e)


class PositionNoise:
    """One request's race noise (``race``). Position t's noise never depends on how it was
    reached, or on which positions or groups were asked for before: it is a hash of
    (seed, t, group), computed whenever asked; nothing is kept."""

    def __init__(self, seed: int, vocab_size: int):
        self.seed = seed % 2**64
        self.bits = self.seed - 2**64 if self.seed >= 2**63 else self.seed  # as an int64
        self.vocab_size = vocab_size
        self.groups, self.width = group_shape(vocab_size)

    def group_stream(self, pos: int) -> bytes:
        """The name of H_t's stream, t = ``pos``."""
        return b"race:%d:%d" % (self.seed, pos)

    def group_noise(self, pos: int) -> np.ndarray:
        """(groups,) float64: the exponentials behind H_t (H = -log E), t = ``pos``."""
        return exponentials([self.group_stream(pos)], self.groups)[0]

    def member_noise(self, pos: int, group: int) -> np.ndarray:
        """(width,) float64: the exponentials behind G_t(g, .), t = ``pos``, g = ``group``."""
        return exponentials([member_stream(self.group_stream(pos), group)], self.width)[0]


def member_stream(group_stream: bytes, group: int) -> bytes:
    """The name of G_t(g, .)'s stream, from H_t's."""
    return b"%s:%d" % (group_stream, group)


def native() -> bool:
    """Whether ``race`` runs ``nodraft::race`` and top-k and top-p's kept set is
    ``nodraft::kept`` (micro/csrc/race.cpp): where this process has loaded nodraft's
    kernels (``micro.gemm.load``, as the compiled passes do) and ``NODRAFT_RACE`` is not
    ``numpy``."""
    return gemm.unit() is not None and os.environ.get("NODRAFT_RACE", "").lower() != "numpy"


def race(scaled: Tensor, noises: list[PositionNoise], positions: list[int],
         temperatures: list[float] | None = None) -> list[int]:
    """The race's token for each row of ``scaled`` (R, V): logits over the temperature
    (float32), -inf where top-k or top-p removed a token -- or, with ``temperatures``,
    logits that row r's temperature divides first; row r races with ``noises[r]`` at
    sequence position ``positions[r]``. All rows in one call: ``nodraft::race`` where
    ``native()``, else one set of numpy array operations. The two draw the same noise and
    agree on the token but where two of a row's ratios tie to float32 rounding (their
    weights' exponentials differ in the last places): each is exact sampling."""
    if native():
        return race_kernel(scaled, noises, positions, temperatures)
    return race_numpy(scaled, noises, positions, temperatures)


def race_kernel(scaled: Tensor, noises: list[PositionNoise], positions: list[int],
                temperatures: list[float] | None = None, top_ks: list[int] | None = None,
                top_ps: list[float] | None = None) -> list[int]:
    """``race`` as ``nodraft::race`` (nodraft's kernels loaded: ``micro.gemm.load``); with
    ``top_ks`` / ``top_ps``, row r's top-k and top-p remove tokens inside the call first,
    by ``engine.verify.kept``'s rule (``kept_kernel``)."""
    R = scaled.shape[0]
    if scaled.dtype != torch.float32:
        scaled = scaled.float()
    return torch.ops.nodraft.race.default(
        scaled.detach() if scaled.requires_grad else scaled, temperatures or [1.0] * R,
        [n.bits for n in noises], positions, noises[0].groups, noises[0].width,
        top_ks or [0] * R, top_ps or [1.0] * R)


def kept_kernel(scaled: Tensor, top_k: int, top_p: float) -> Tensor:
    """``engine.verify.kept`` as ``nodraft::kept``: bool (..., V), the tokens top-k, then
    top-p, keep of the rows ``scaled`` (float32 logits over the temperature), found by a
    radix select rather than a sort. Its sums are float64 and in another order than a
    cumulative sum's, so a token whose mass above lies within rounding of ``top_p`` can be
    kept by one and not the other."""
    rows = scaled.detach().float().reshape(-1, scaled.shape[-1])
    R = rows.shape[0]
    return torch.ops.nodraft.kept.default(rows, [1.0] * R, [top_k] * R,
                                          [top_p] * R).reshape(scaled.shape)


def race_numpy(scaled: Tensor, noises: list[PositionNoise], positions: list[int],
               temperatures: list[float] | None = None) -> list[int]:
    """``race`` as numpy array operations."""
    if temperatures is not None:
        scaled = scaled.float() / torch.tensor(temperatures)[:, None]
    x = scaled.detach().contiguous().numpy()
    R, V = x.shape
    groups, width = noises[0].groups, noises[0].width
    w = np.exp(x - x.max(-1, keepdims=True))  # the weights, up to a factor per row
    if groups * width > V:
        w = np.pad(w, ((0, 0), (0, groups * width - V)))
    w = w.reshape(R, groups, width)
    streams = [n.group_stream(t) for n, t in zip(noises, positions)]
    chosen = (w.sum(-1) / exponentials(streams, groups)).argmax(-1).tolist()
    members = w[np.arange(R), chosen]
    noise = exponentials([member_stream(s, c) for s, c in zip(streams, chosen)], width)
    within = (members / noise).argmax(-1).tolist()
    return [c * width + i for c, i in zip(chosen, within)]
