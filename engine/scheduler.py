"""How many draft tokens each sequence may carry in a packed pass: goodput, measured.

A packed pass over R rows costs about ``a + b * R`` seconds on a CPU (``a``: reading the
weights and per-op overhead, paid once; ``b``: each extra row). Both are fitted by least
squares over the last passes, so the model follows the machine it runs on. Drafting one
sequence costs its drafter's own time ``t`` (measured per method) before the pass.

A sequence whose drafter's tokens are accepted with per-token probability ``alpha`` (the
geometric model: accepted / (accepted + rejections), an exponential moving average over
its recent steps) gains ``alpha ** i`` expected tokens from its i-th draft token. With the
whole batch's goodput ``G`` (tokens per second of the pass as planned), a sequence takes
k draft tokens where each token's gain per second of extra pass time beats ``G``
(``alpha ** k / b > G``) and the whole draft pays for its drafting time
(``sum(alpha ** i) / (t + k * b) > G``); else it does not draft this step. ``G`` itself
depends on the choices, so the plan iterates to a fixed point (a few rounds).

At batch 1, ``G`` is low (one token per ``a + b``) and drafts run long; at batch 32 the
pass already yields 32 tokens, so only drafts accepted most of the time still pay and the
others stop. A sequence that stopped drafting probes with one token now and then, so a
text that turns repetitive is noticed.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

PRIOR_ACCEPTED, PRIOR_REJECTED = 1.0, 1.0  # alpha = 0.5 until measured
DECAY = 0.8  # per step, for the acceptance counts
PROBE_EVERY = 16  # steps without a draft before a one-token probe


@dataclass
class SeqDraftState:
    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED
    idle: int = 0  # consecutive steps without a draft

    @property
    def alpha(self) -> float:
        return min(0.98, self.accepted / (self.accepted + self.rejected))

    def observe(self, drafted_depth: int, accepted: int) -> None:
        if drafted_depth <= 0:
            self.idle += 1
            return
        self.idle = 0
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (1.0 if accepted < drafted_depth else 0.0)


class PassTimer:
    """Least-squares fit of pass seconds = a + b * rows over the recent passes."""

    def __init__(self, a: float = 1.5e-3, b: float = 6e-5, window: int = 256):
        self.prior = (a, b)
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, rows: int, seconds: float) -> None:
        self.samples.append((rows, seconds))

    @property
    def coefficients(self) -> tuple[float, float]:
        n = len(self.samples)
        if n < 8:
            return self.prior
        mx = sum(r for r, _ in self.samples) / n
        my = sum(s for _, s in self.samples) / n
        sxx = sum((r - mx) ** 2 for r, _ in self.samples)
        if sxx < 1e-9 * n:  # all passes the same size: keep the prior slope
            b = self.prior[1]
            return max(1e-5, my - b * mx), b
        b = sum((r - mx) * (s - my) for r, s in self.samples) / sxx
        b = max(b, 1e-6)
        return max(1e-5, my - b * mx), b


class DraftScheduler:
    def __init__(self):
        self.timer = PassTimer()
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
        for _ in range(4):
            gain, cost = 0.0, 0.0
            for j, (st, method, kmax) in enumerate(states):
                k = _best_k(st.alpha, b, self.propose_seconds.get(method, 0.0), G, kmax)
                if k == 0 and kmax > 0 and st.idle >= PROBE_EVERY:
                    k = 1
                ks[j] = k
                if k:
                    al = st.alpha
                    gain += al * (1 - al ** k) / (1 - al)
                    cost += self.propose_seconds.get(method, 0.0) + k * b
            G_new = (base_tokens + gain) / (base_time + cost)
            if abs(G_new - G) < 1e-3 * G:
                break
            G = G_new
        return ks


def _best_k(alpha: float, b: float, t: float, G: float, kmax: int) -> int:
    if kmax <= 0 or alpha <= 0.0 or alpha / b <= G:
        return 0
    # the last token still pays: alpha ** k / b > G
    k = max(1, min(kmax, int(math.log(G * b) / math.log(alpha))))
    # every token up to k beats G at the margin, so the whole draft's ratio only grows with
    # k: if the longest draft does not repay the drafting time, no shorter one does
    g = alpha * (1 - alpha ** k) / (1 - alpha)
    return k if g / (t + k * b) > G else 0
