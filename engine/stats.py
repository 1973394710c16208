"""Per-request speculation figures: a plain dataclass the engine fills.

The Prometheus adapter (``server.metrics``) turns these into counters; the ratios are
computed here for the response and in PromQL for the dashboard, never stored twice.

    acceptance rate      = accepted / drafted            (None when drafted = 0)
    tokens per pass      = (accepted + passes) / passes  (plain decoding: exactly 1.0)
    estimated speed-up   = (accepted + passes) / (passes + draft cost)
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

    def record(self, drafted: int, accepted: int, cost: float) -> None:
        """One verification pass that checked ``drafted`` tokens and kept ``accepted``."""
        self.drafted += drafted
        self.accepted += accepted
        self.target_passes += 1
        self.draft_cost += cost
        if accepted > len(self.accepted_by_position):
            self.accepted_by_position.extend([0] * (accepted - len(self.accepted_by_position)))
        for i in range(accepted):
            self.accepted_by_position[i] += 1

    def merge(self, other: "SpecStats") -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.target_passes += other.target_passes
        self.draft_cost += other.draft_cost
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
            "accepted_by_position": list(self.accepted_by_position),
            "drafter_errors": self.drafter_errors,
        }
