"""How many draft tokens each sequence may carry in a packed pass: goodput, measured.

The model is ``drafters.goodput``'s, the one ``auto`` uses: a packed pass over R rows
costs ``a + b * R`` seconds (``PassFit``: fitted over the last passes), drafting one sequence costs its drafter's own
time ``t`` (measured per method), and each sequence's acceptance is a Beta belief
(``Acceptance``) over its recent steps. With the whole batch's goodput ``G`` (tokens per
second of the pass as planned), a sequence takes k draft tokens where each token's
expected gain per second of extra pass time beats ``G`` and the whole draft pays for its
drafting time (``goodput.marginal_length``); else it does not draft this step. ``G``
itself depends on the choices, so the plan iterates to a fixed point (a few rounds).

At batch 1, ``G`` is low (one token per ``a + b``) and drafts run long; at batch 32 the
pass already yields 32 tokens, so only drafts accepted most of the time still pay and the
others stop. A sequence that stopped drafting probes with one token now and then, so a
text that turns repetitive is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodraft.drafters.goodput import Acceptance, PassFit, marginal_length

PROBE_EVERY = 16  # steps without a draft before a one-token probe


@dataclass
class SeqDraftState(Acceptance):
    """One sequence's acceptance belief, and how long it has gone without a draft."""

    idle: int = 0  # consecutive steps without a draft

    def observe(self, drafted_depth: int, accepted: int) -> None:
        if drafted_depth <= 0:
            self.idle += 1
            return
        self.idle = 0
        super().observe(drafted_depth, accepted)


class DraftScheduler:
    def __init__(self):
        self.timer = PassFit()
        self.propose_seconds: dict[str, float] = {}  # EMA per drafter method

    def observe_propose(self, method: str, seconds: float) -> None:
        old = self.propose_seconds.get(method)
        self.propose_seconds[method] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def limits(self, states: list[tuple[SeqDraftState, str, int]], fixed_rows: int) -> list[int]:
        """Draft budgets for sequences given (state, method, own max) each; ``fixed_rows``
        are the pass's rows besides drafts (one per stepping sequence, prefill chunks)."""
        a, b = self.timer.coefficients
        base_tokens = float(len(states))
        base_time = a + b * fixed_rows
        G = base_tokens / base_time
        ks = [0] * len(states)
        expected = [st.tokens(max(0, kmax)) for st, _, kmax in states]  # fixed during the plan
        for _ in range(4):
            gain, cost = 0.0, 0.0
            for j, (st, method, kmax) in enumerate(states):
                t_draft = self.propose_seconds.get(method, 0.0)
                k = marginal_length(expected[j], b, t_draft, G)
                if k == 0 and kmax > 0 and st.idle >= PROBE_EVERY:
                    k = 1
                ks[j] = k
                if k:
                    gain += expected[j][k] - 1.0
                    cost += t_draft + k * b
            G_new = (base_tokens + gain) / (base_time + cost)
            if abs(G_new - G) < 1e-3 * G:
                break
            G = G_new
        return ks
