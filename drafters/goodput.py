"""One goodput model for every draft decision: an acceptance belief and a pass cost.

Goodput is tokens per second. A step that sends k draft tokens whose tokens are accepted
with per-token probability ``alpha`` (the geometric model) emits
``1 + alpha + alpha**2 + ... + alpha**k`` tokens and takes the drafting time plus a target
pass over its rows. ``alpha`` is not known but believed: ``Acceptance`` is a
Beta(accepted, rejected) belief over it, and a step's expected tokens are the expectation
of that sum under it::

    E[tokens(k)] = 1 + sum_{j=1..k} E[alpha**j],   E[alpha**j] = prod_{i<j} (a + i) / (a + r + i)

(``Acceptance.tokens``), not the sum at the belief's mean: alpha**j is convex, so while the
belief is wide (a fresh server, a new match length) a long draft is worth more than the
mean says -- Beta(1, 1) expects 1/(j + 1) of the j-th token, not 0.5**j. As the counts grow
it tends to the geometric sum at the mean, capped at ``MAX_ALPHA``.

Two readers, one model:

- ``auto`` (drafters/auto.py) prices one sequence's candidate drafts with the pass-cost
  table measured on this machine (``drafters.costs.PassCost``) and keeps the length with
  the best goodput (``best_length``);
- the engine's batching scheduler (engine/scheduler.py) gives each sequence its share of a
  packed pass by the marginal form (``marginal_length``): the j-th draft token is worth its
  ``E[alpha**j]`` tokens for ``b`` seconds of pass (the pass's per-row cost), against the
  batch's goodput ``G``, and a draft as a whole repays its drafting time and the fixed
  cost of a drafted block in a packed pass; pass seconds are fitted over recent packed
  passes (``PassFit``: per pass, per row, per drafting sequence, per prompt row): packed
  passes are other graphs than a lone sequence's, so they are timed as they run.

Both count with the same belief: accepted tokens and rejections of recent steps, decayed
by ``DECAY`` per observation (an exponential moving average).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

PRIOR_ACCEPTED, PRIOR_REJECTED = 1.0, 1.0  # Beta(1, 1): uniform, mean 0.5
DECAY = 0.85  # per observation, for one sequence's counts
SERVER_DECAY = 0.98  # per observation, for what a server keeps across requests
# pseudo-counts of the server's belief a new request (``auto``) or sequence (the batching
# scheduler) starts from, its mean kept: informed, and soon moved by its own steps
PRIOR_STRENGTH = 4.0
MAX_ALPHA = 0.97  # the most any belief believes


@dataclass
class Acceptance:
    """A Beta(accepted, rejected) belief over the per-token acceptance alpha: pseudo-counts
    of accepted tokens and of rejections, decayed per observation."""

    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED
    step: int = 0  # for a caller that ages beliefs by steps (auto's drift)

    @property
    def alpha(self) -> float:
        """The belief's mean, capped at ``MAX_ALPHA``."""
        return min(MAX_ALPHA, self.accepted / (self.accepted + self.rejected))

    def observe(self, depth: int, accepted: int, decay: float = DECAY) -> None:
        """A step drafted ``depth`` deep (a chain's length, a tree's depth) and
        ``accepted`` of its tokens were kept: a rejection unless all were."""
        self.accepted = decay * self.accepted + accepted
        self.rejected = decay * self.rejected + (1.0 if accepted < depth else 0.0)

    def tokens(self, n: int) -> list[float]:
        """E[1 + alpha + ... + alpha**k] under this belief, for k = 0..n."""
        a = self.accepted
        r = max(self.rejected, a * (1 - MAX_ALPHA) / MAX_ALPHA)
        out, m = [1.0], 1.0
        for i in range(n):
            m *= (a + i) / (a + r + i)
            out.append(out[-1] + m)
        return out

    def mean_tokens(self, n: int) -> list[float]:
        """1 + alpha + ... + alpha**k at the belief's mean, for k = 0..n: ``tokens``
        without the credit a wide belief gives long drafts."""
        alpha, out, m = self.alpha, [1.0], 1.0
        for _ in range(n):
            m *= alpha
            out.append(out[-1] + m)
        return out

    def at_mean(self, k: int) -> float:
        """1 + alpha + ... + alpha**k at the belief's mean (no credit for its width): the
        value of a draft whose belief only drafting with it can inform."""
        alpha = self.alpha
        return (1 - alpha ** (k + 1)) / (1 - alpha)


def best_length(belief: Acceptance, n: int,
                pass_seconds: Callable[[int], float] | list[float],
                draft_seconds: float = 0.0) -> tuple[float, int]:
    """(goodput, k): the chain length k in 1..n with the best expected goodput,
    ``E[tokens(k)] / (draft_seconds + pass_seconds(1 + k))``; (0, 0) when n < 1.
    ``pass_seconds``: a function of the rows, or their prices listed from 0 rows up (at
    least ``n + 2`` of them: ``PassCost.prices``, which a function that has it is read
    through at once) -- ``auto`` runs this for every match at every step it asks, and lists
    the prices once for all of them."""
    if isinstance(pass_seconds, list):
        prices = pass_seconds
    else:
        listed = getattr(pass_seconds, "prices", None)
        prices = listed(n + 1) if listed else [pass_seconds(r) for r in range(n + 2)]
    # ``belief.tokens(n)`` term by term, each length priced as it comes
    a = belief.accepted
    r = max(belief.rejected, a * (1 - MAX_ALPHA) / MAX_ALPHA)
    best_g, best_k, tokens, m = 0.0, 0, 1.0, 1.0
    for k in range(1, n + 1):
        m *= (a + k - 1) / (a + r + k - 1)
        tokens += m
        g = tokens / (draft_seconds + prices[k + 1])
        if g > best_g:
            best_g, best_k = g, k
    return best_g, best_k


def marginal_length(tokens: list[float], b: float, draft_seconds: float, G: float) -> int:
    """Draft tokens for one sequence of a packed pass whose goodput is ``G`` and whose rows
    cost ``b`` seconds each, given its belief's ``tokens(kmax)``: the longest k whose last
    token still pays (``E[alpha**k] / b > G``), if the whole draft also repays its drafting
    time (``(E[tokens(k)] - 1) / (draft_seconds + k * b) > G``); else 0."""
    kmax = len(tokens) - 1
    k = 0
    while k < kmax and (tokens[k + 1] - tokens[k]) / b > G:  # E[alpha**j] falls with j
        k += 1
    if k == 0:
        return 0
    # every token up to k beats G at the margin, so the whole draft's ratio only grows
    # with k: if the longest draft does not repay the drafting time, no shorter one does
    return k if (tokens[k] - 1.0) / (draft_seconds + k * b) > G else 0


class PassCoefficients(NamedTuple):
    """A packed pass's seconds, ``a + b * rows + drafted * sequences drafting + prefill *
    prompt rows + draft * draft tokens``."""

    a: float  # the pass itself
    b: float  # per stepping sequence: its block's current token
    drafted: float  # per sequence whose block carries a draft (its KV read apart)
    prefill: float  # per prompt row of a prefill chunk
    draft: float  # per draft token (node) of a drafted block


FLOORS = (1e-5, 1e-6, 0.0, 0.0, 1e-6)  # the least each PassCoefficients may be, seconds


class PassFit:
    """Seconds of a packed pass (``PassCoefficients``) fitted by least squares over the
    recent passes. Each coefficient is also pulled towards its prior by a pseudo-pass of
    weight ``PRIOR_PASSES``, so one whose regressor never varied (no drafts yet, no
    prompts) keeps its prior instead of an arbitrary value; until 8 passes are seen, the
    prior (a compiled packed pass of micro on a CPU).

    Rows of a drafted block cost more than one-row blocks: a compiled packed pass reads
    a drafted block's keys and values apart from the one-row blocks' (``micro.compiled``),
    a fixed cost per drafting sequence that grows with its context, and its rows attend
    padded to the longest drafted block -- so a draft of k tokens is priced at
    ``drafted + k * draft``, each coefficient fitted on its own: with one coefficient for
    every decode row, a full batch's passes (~32 rows each) fitted a per-row cost near 0,
    and drafts looked free (docs/LOG.md, 2026-12-03)."""

    PRIOR = PassCoefficients(1.5e-3, 8e-5, 3e-4, 4e-5, 8e-5)
    SCALE = (1.0, 32.0, 4.0, 32.0, 16.0)  # a typical pass's regressors: the prior's pseudo-pass
    PRIOR_PASSES = 0.01
    REFIT_EVERY = 32  # passes between refits, at most (``coefficients``)

    def __init__(self, prior: PassCoefficients | None = None, window: int = 256):
        self.prior = prior or self.PRIOR
        self.samples: deque[tuple[int, int, int, int, float]] = deque(maxlen=window)
        self._fit: PassCoefficients | None = None
        self._fitted_at = -1
        self._seen = 0

    def observe(self, rows: int, seconds: float, drafted: int = 0, prefill: int = 0,
                draft: int = 0) -> None:
        """One pass: its stepping sequences (``rows``, one current token each), those among
        them ``drafted``, its ``prefill`` (prompt) rows, its ``draft`` tokens, and the
        seconds it took."""
        self.samples.append((rows, drafted, prefill, draft, seconds))
        self._seen += 1

    @property
    def coefficients(self) -> PassCoefficients:
        n = len(self.samples)
        if n < 8:
            return self.prior
        # refit after 8 passes, then after as many passes again as had been seen, at most
        # every ``REFIT_EVERY``: a fit is over ``window`` passes, and each costs a few
        # hundred microseconds on a step of a few
        if self._fit is None or self._seen - self._fitted_at >= min(self.REFIT_EVERY,
                                                                    max(8, self._fitted_at)):
            self._fit, self._fitted_at = self._solve(), self._seen
        return self._fit

    def _solve(self) -> PassCoefficients:
        data = np.array(self.samples, dtype=np.float64)
        x = np.column_stack([np.ones(len(data)), data[:, :4]])
        weight = np.sqrt(self.PRIOR_PASSES) * np.array(self.SCALE)
        x = np.vstack([x, np.diag(weight)])
        y = np.concatenate([data[:, 4], weight * np.array(self.prior)])
        # least squares with every coefficient at least its floor: one that falls below is
        # held there and the others refitted without it (clamping after an unconstrained
        # fit kept, with a negative per-row cost clamped to ~0, the pass's own cost that
        # offset it: a = 27 ms for passes of 5, and drafts looked free)
        coef = np.array(FLOORS)
        free = list(range(len(FLOORS)))
        while free:
            fixed = [i for i in range(len(FLOORS)) if i not in free]
            rest = y - x[:, fixed] @ coef[fixed]
            coef[free] = np.linalg.lstsq(x[:, free], rest, rcond=None)[0]
            low = [i for i in free if coef[i] < FLOORS[i]]
            if not low:
                break
            for i in low:
                coef[i] = FLOORS[i]
                free.remove(i)
        return PassCoefficients(*coef.tolist())


def regime(temperature: float) -> str:
    """The sampling regime a belief is kept for: acceptance under greedy decoding, under
    mild sampling and under full-temperature sampling differ several-fold for the same
    drafter and text."""
    if temperature < 0.05:
        return "greedy"
    return "t<=0.85" if temperature <= 0.85 else "t>0.85"

