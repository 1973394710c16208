"""Per-request speculation figures: a plain dataclass the engine fills.

The Prometheus adapter (``server.metrics``) turns these into counters; the ratios are
computed here for the response and in PromQL for the dashboard, never stored twice.

    acceptance rate      = accepted / drafted            (None when drafted = 0)
    tokens per pass      = (accepted + passes) / passes  (plain decoding: exactly 1.0)
    estimated speed-up   = (accepted + passes) / (passes + draft cost)
    measured-cost speed-up = plain seconds / (verify seconds + draft seconds)

The estimated speed-up is the course's: every pass costs one target pass whatever its
rows, and the draft cost is each drafter's own model of its compute, in target-pass units.
It ignores what verifying k tokens costs on this machine (a pass of 17 rows is not the
price of a pass of 1) and so overstates long drafts. The measured-cost speed-up prices the
same passes with seconds measured here (``drafters.costs``): ``verify_seconds`` sums, per
pass, what ONE sequence's pass of that many rows costs on this machine; ``plain_seconds``
what plain decoding would have spent on the tokens those passes emitted (one 1-row pass
each); ``draft_seconds`` is the drafter's own wall time, timed (its proposals and its
bookkeeping after each pass; none for ``none``). It is the request's speed-up over plain
decoding were it alone on the engine -- under batching the engine shares each pass
between sequences, which neither figure models. Early exit's verification pass with
``reuse_kv`` (a lone sequence's) reuses the rows below its exit layer E of L: it is priced
as a 1-row pass for E/L of the layers and a pass of all its rows for the rest, an
approximation.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    method: str
    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0
    draft_cost: float = 0.0  # in target-pass units, summed over passes
    accepted_by_position: list[int] = field(default_factory=list)
    drafter_errors: int = 0
    plain_seconds: float = 0.0  # plain decoding's measured cost of the same tokens
    verify_seconds: float = 0.0  # the passes' measured cost, by their rows
    draft_seconds: float = 0.0  # the drafter's wall time

    def record(self, drafted: int, accepted: int, cost: float, plain_s: float = 0.0,
               verify_s: float = 0.0, draft_s: float = 0.0) -> None:
        """One verification pass that checked ``drafted`` tokens and kept ``accepted``
        (``cost``: the draft's modelled cost; the seconds: see the module's docstring)."""
        self.drafted += drafted
        self.accepted += accepted
        self.target_passes += 1
        self.draft_cost += cost
        self.plain_seconds += plain_s
        self.verify_seconds += verify_s
        self.draft_seconds += draft_s
        if accepted > len(self.accepted_by_position):
            self.accepted_by_position.extend([0] * (accepted - len(self.accepted_by_position)))
        for i in range(accepted):
            self.accepted_by_position[i] += 1

    def merge(self, other: "SpecStats") -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.target_passes += other.target_passes
        self.draft_cost += other.draft_cost
        self.plain_seconds += other.plain_seconds
        self.verify_seconds += other.verify_seconds
        self.draft_seconds += other.draft_seconds
        self.drafter_errors += other.drafter_errors
        for i, a in enumerate(other.accepted_by_position):
            if i < len(self.accepted_by_position):
                self.accepted_by_position[i] += a
            else:
                self.accepted_by_position.append(a)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_pass(self) -> float | None:
        if not self.target_passes:
            return None
        return (self.accepted + self.target_passes) / self.target_passes

    @property
    def estimated_speedup(self) -> float | None:
        if not self.target_passes:
            return None
        return (self.accepted + self.target_passes) / (self.target_passes + self.draft_cost)

    @property
    def measured_cost_speedup(self) -> float | None:
        spent = self.verify_seconds + self.draft_seconds
        return self.plain_seconds / spent if spent > 0 and self.plain_seconds > 0 else None

    def to_dict(self) -> dict:
        r = lambda x: None if x is None else round(x, 4)  # noqa: E731
        return {
            "method": self.method,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": r(self.acceptance_rate),
            "target_passes": self.target_passes,
            "tokens_per_pass": r(self.tokens_per_pass),
            "draft_cost": round(self.draft_cost, 4),
            "estimated_speedup": r(self.estimated_speedup),
            "measured_cost_speedup": r(self.measured_cost_speedup),
            "plain_seconds": round(self.plain_seconds, 6),
            "verify_seconds": round(self.verify_seconds, 6),
            "draft_seconds": round(self.draft_seconds, 6),
            "accepted_by_position": list(self.accepted_by_position),
            "drafter_errors": self.drafter_errors,
        }
