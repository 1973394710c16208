"""How many draft tokens each sequence may carry in a packed pass: goodput, measured.

The model is ``drafters.goodput``'s, the one ``auto`` uses: a packed pass costs
``a + b * sequences + c * draft tokens + d * drafting sequences + p * prompt rows`` seconds
(``PassFit``: fitted over the last passes; a drafted block's keys and values are read apart
from the one-row blocks', so each drafting sequence costs ``d`` besides its ``c`` a
token), drafting one sequence costs its drafter's own time ``t`` (measured per method),
and each sequence's acceptance is a Beta belief (``Acceptance``) over its recent steps, a
draft valued at the belief's mean (``Acceptance.mean_tokens``). Unlike a lone request's
``auto``, the plan gives a wide belief no credit for its width: exploring is the probes'
job (below), and with that credit a sampled batch drafted long blocks that kept a few
tokens each (docs/LOG.md, 2026-12-03). With the whole batch's goodput ``G`` (tokens per
second of the iteration as planned: the pass, and what each sequence's step costs besides,
measured), a sequence takes k draft tokens where each token's expected gain per second of
extra pass time (``c``) beats ``G`` and the whole draft pays for ``t + d``
(``goodput.marginal_length``); else it does not draft this step. ``G`` itself depends on
the choices, so the plan iterates to a fixed point (a few rounds).

At batch 1, ``G`` is low (one token per ``a + b``) and drafts run long; at batch 32 the
pass already yields 32 tokens, so only drafts accepted most of the time still pay and the
others stop.

A sequence's belief starts from what this server's sequences of the same method and
sampling regime accepted lately (``state_for``; Beta(1, 1) on a fresh server), at the
strength of a few steps: a wide prior alone never pays for a drafted block under load, so
a request would not draft the loop every earlier request drafted. Where nobody of a kind
drafts, one of them probes with one token now and then, so a text that turns repetitive is
noticed and the pooled belief stays informed -- less often the more a probe costs in the
batch's tokens (``probe_after``): a probe is a drafted block like any other, and for a
sampled kind asking the drafter for it costs its measured drafting time too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nodraft.drafters.goodput import (PRIOR_STRENGTH, SERVER_DECAY, Acceptance,
                                      PassCoefficients, PassFit, marginal_length, regime)

PROBE_EVERY = 16  # steps without a draft before a one-token probe, at the least
PROBE_SHARE = 0.01  # what probing may cost a sequence, in the batch's tokens per step
# the most evidence a greedy sequence's belief holds (accepted tokens + rejections): greedy
# text enters and leaves loops, and a run of fully accepted long drafts is otherwise worth
# so many accepted tokens that, once the loop ends, it takes ~10 rejected steps to stop
# drafting long. Sampled text's acceptance is noisy rather than changing: bounded, a few
# lucky drafts moved its belief enough to draft more, at a loss (docs/LOG.md, 2026-12-03)
MAX_EVIDENCE = 8.0


@dataclass
class SeqDraftState(Acceptance):
    """One sequence's acceptance belief, and how long it has gone without a draft."""

    idle: int = 0  # consecutive steps without a draft
    key: tuple = ()  # (method, sampling regime): the pool it informs and starts from
    # (accepted, rejected, n, mean_tokens(n)): the last expectation made
    _expected: tuple = field(default=(), repr=False, compare=False)

    @property
    def greedy(self) -> bool:
        """Whether its kind is greedy decoding's (``goodput.regime``)."""
        return self.key[1:] == ("greedy",)

    def expected(self, n: int) -> list[float]:
        """``mean_tokens(n)``, kept until the belief changes: a sequence that does not
        draft keeps its belief, and the plan asks for it every pass."""
        memo = self._expected
        if memo[:3] != (self.accepted, self.rejected, n):
            memo = self._expected = (self.accepted, self.rejected, n, self.mean_tokens(n))
        return memo[3]

    def observe(self, drafted_depth: int, accepted: int) -> None:
        if drafted_depth <= 0:
            self.idle += 1
            return
        self.idle = 0
        super().observe(drafted_depth, accepted)
        total = self.accepted + self.rejected
        if total > MAX_EVIDENCE and self.greedy:  # its mean kept
            self.accepted *= MAX_EVIDENCE / total
            self.rejected *= MAX_EVIDENCE / total


def probe_after(G: float, co: PassCoefficients, propose_seconds: float = 0.0) -> int:
    """Steps without a draft before a one-token probe: at least ``PROBE_EVERY``, and
    enough that the probe's cost -- ``G`` tokens per second of the drafted block it adds
    (``co.drafted + co.draft``) and of asking the drafter (``propose_seconds``) -- is at
    most ``PROBE_SHARE`` tokens per step waited."""
    cost = co.drafted + co.draft + propose_seconds
    return max(PROBE_EVERY, math.ceil(G * cost / PROBE_SHARE))


class DraftScheduler:
    def __init__(self):
        self.timer = PassFit()
        self.propose_seconds: dict[str, float] = {}  # EMA per drafter method
        self.pooled: dict[tuple, Acceptance] = {}  # per (method, regime), decayed slowly
        self.pooled_idle: dict[tuple, int] = {}  # sequence-steps of a kind without a draft
        self.overhead: float | None = None  # seconds per sequence-step besides the pass

    def observe_propose(self, method: str, seconds: float) -> None:
        old = self.propose_seconds.get(method)
        self.propose_seconds[method] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def observe_overhead(self, seconds: float) -> None:
        """A packed iteration's seconds per stepping sequence outside its pass and its
        drafters (planning, verification, commits, events): a token accepted from a draft
        saves its sequence a step of these too, so the batch's goodput counts them."""
        self.overhead = seconds if self.overhead is None else 0.9 * self.overhead + 0.1 * seconds

    def state_for(self, method: str, temperature: float) -> SeqDraftState:
        """A new sequence's belief: its kind's pooled one, scaled to ``PRIOR_STRENGTH``
        pseudo-counts (its mean kept), or Beta(1, 1) if none of its kind has drafted."""
        key = (method, regime(temperature))
        pooled = self.pooled.get(key)
        if pooled is None:
            return SeqDraftState(key=key)
        w = PRIOR_STRENGTH / (pooled.accepted + pooled.rejected)
        return SeqDraftState(pooled.accepted * w, pooled.rejected * w, key=key)

    def observe(self, state: SeqDraftState, drafted_depth: int, accepted: int) -> None:
        """One step of a sequence: its belief, and its kind's pooled one if it drafted."""
        state.observe(drafted_depth, accepted)
        if drafted_depth > 0 and state.key:
            self.pooled.setdefault(state.key, Acceptance()).observe(
                drafted_depth, accepted, SERVER_DECAY)

    def limits(self, states: list[tuple[SeqDraftState, str, int]], rows: int,
               prefill_rows: int = 0) -> list[int]:
        """Draft budgets for sequences given (state, method, own max) each; ``rows`` are
        the pass's decode rows besides drafts (one per stepping sequence), ``prefill_rows``
        its prompt rows. Where no sequence may draft (plain decoding's, or drafters that
        declined this step in advance) nothing is planned, priced or probed."""
        ks = [0] * len(states)
        # only those that may draft are planned: at rest most of a batch may not (a
        # resting ``auto``, plain decoding), and the plan's rounds go over each planned one
        may = [j for j, (_, _, kmax) in enumerate(states) if kmax > 0]
        if not may:  # none may draft (plain decoding's)
            return ks
        co = self.timer.coefficients
        base_tokens = float(len(states))
        base_time = (co.a + co.b * rows + co.prefill * prefill_rows
                     + (self.overhead or 0.0) * len(states))
        G = base_tokens / base_time
        # each belief's tokens(k) at its mean, fixed during the plan, made only for one whose
        # first draft token pays at some round's G (E[alpha] / c > G; most do not, and
        # making the list costs more than the rest of a sequence's plan)
        expected: list[list[float] | None] = [None] * len(states)
        for _ in range(4):
            gain, cost = 0.0, 0.0
            for j in may:
                st, method, kmax = states[j]
                if st.alpha / co.draft <= G:  # marginal_length's first test
                    ks[j] = 0
                    continue
                if expected[j] is None:
                    expected[j] = st.expected(kmax)
                fixed = self.propose_seconds.get(method, 0.0) + co.drafted
                k = marginal_length(expected[j], co.draft, fixed, G)
                ks[j] = k
                if k:
                    gain += expected[j][k] - 1.0
                    cost += fixed + k * co.draft
            G_new = (base_tokens + gain) / (base_time + cost)
            if abs(G_new - G) < 1e-3 * G:
                break
            G = G_new
        self._probe(states, may, ks, G, co)
        return ks

    def _probe(self, states: list[tuple[SeqDraftState, str, int]], may: list[int],
               ks: list[int], G: float, co: PassCoefficients) -> None:
        """One-token probes: a sequence probes once its own idle steps, or those of every
        sequence of its kind since the kind last drafted, reach its kind's
        ``probe_after``. A sampled kind's probe is priced with the time it takes to ask
        its drafter, a greedy kind's without: greedy text on a small model enters loops
        that repay the asking many times over, sampled text rarely (docs/LOG.md,
        2026-12-03)."""
        drafting = {states[j][0].key for j in may if ks[j]}
        for key in drafting:
            self.pooled_idle[key] = 0
        waits: dict[tuple, int] = {}
        for j in may:  # (``may``: those whose own max is above 0)
            st, method, _ = states[j]
            if ks[j] or st.key in drafting:
                continue
            wait = waits.get(st.key)
            if wait is None:  # a greedy kind's probe is priced at its block alone
                asking = 0.0 if st.greedy else self.propose_seconds.get(method, 0.0)
                wait = waits[st.key] = probe_after(G, co, asking)
            idle = self.pooled_idle.get(st.key, 0) + 1
            if idle >= wait or st.idle >= wait:
                ks[j], idle = 1, 0
                drafting.add(st.key)
            self.pooled_idle[st.key] = idle
