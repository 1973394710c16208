"""The Prometheus adapter: the engine's ``SpecStats`` and timings, exported as counters.

The engine fills a plain ``SpecStats`` per sequence; this observer turns what changed in
it at each step into counter increments, so a step that emits several tokens (accepted
draft tokens plus the bonus token) counts every one of them, and the counters add up to
exactly the figures the responses report. Ratios are left to PromQL (DESIGN.md):

    acceptance rate    = rate(nodraft_spec_accepted_tokens_total)
                         / rate(nodraft_spec_draft_tokens_total)
    tokens per pass    = (rate(accepted) + rate(target_passes)) / rate(target_passes)
    estimated speed-up = (rate(accepted) + rate(target_passes))
                         / (rate(target_passes) + rate(draft_cost_passes))

Labels: ``model`` is the checkpoint; ``method`` is the drafter that proposed (for ``auto``,
the one it chose at each step); ``position`` counts draft positions from 0 (the first draft
token after the current token). Drafter errors are labelled by the request's method and
read from the sequence's figures, so errors in a drafter's ``close`` count too.

Latencies, per sequence: time to first token from submission to the first step that
emitted a token; inter-token latency once per token emitted by each later step, as the
step's gap divided by its tokens (so its mean is seconds per token, and speculation shows
in it); end-to-end from submission to the end of the sequence.

Every hook runs on the engine thread except ``on_queue`` (also called from ``submit``) and
``count_request`` (the API); prometheus_client's metrics are thread-safe.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, ProcessCollector, generate_latest)

from server.engine import EngineObserver, Handle
from server.sequence import StepResult
from server.stats import SpecStats

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class _Progress:
    """What has been exported for one running sequence."""

    seen: dict[str, SpecStats] = field(default_factory=dict)  # method -> figures so far
    errors: int = 0
    last_token_at: float | None = None


class Metrics(EngineObserver):
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        ProcessCollector(registry=self.registry)
        r, mm = self.registry, ["model", "method"]
        self.draft_tokens = Counter(
            "nodraft_spec_draft_tokens", "Draft tokens proposed and verified.", mm, registry=r)
        self.accepted_tokens = Counter(
            "nodraft_spec_accepted_tokens", "Draft tokens that verification accepted.", mm,
            registry=r)
        self.accepted_per_position = Counter(
            "nodraft_spec_accepted_tokens_per_position",
            "Accepted draft tokens by draft position (0 = first draft token).",
            [*mm, "position"], registry=r)
        self.target_passes = Counter(
            "nodraft_spec_target_passes", "Target passes (verification passes; prefill not "
            "counted).", mm, registry=r)
        self.draft_cost = Counter(
            "nodraft_spec_draft_cost_passes", "Drafters' own compute, in target-pass units.",
            mm, registry=r)
        self.generation_tokens = Counter(
            "nodraft_generation_tokens", "Tokens generated (accepted draft tokens plus bonus "
            "tokens).", mm, registry=r)
        self.prompt_tokens = Counter(
            "nodraft_prompt_tokens", "Prompt tokens prefilled, per sequence.", ["model"],
            registry=r)
        self.requests = Counter(
            "nodraft_requests", "HTTP generation requests by endpoint, speculation method and "
            "status (499: the client went away).", ["endpoint", "method", "status"], registry=r)
        self.ttft = Histogram(
            "nodraft_time_to_first_token_seconds", "From submission to the first token.", mm,
            buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(
            "nodraft_inter_token_latency_seconds", "Seconds per token after the first step.",
            mm, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(
            "nodraft_e2e_request_latency_seconds", "From submission to the end of a sequence.",
            mm, buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge("nodraft_requests_running", "Sequences being decoded.", registry=r)
        self.waiting = Gauge("nodraft_requests_waiting", "Sequences queued for a slot.",
                             registry=r)
        self.drafter_errors = Counter(
            "nodraft_drafter_errors", "Drafter exceptions contained by the engine (the step "
            "fell back to plain decoding).", ["method"], registry=r)
        self._progress: dict[int, _Progress] = {}

    # -- the API's side ----------------------------------------------------------------------
    def count_request(self, endpoint: str, method: str, status: int) -> None:
        self.requests.labels(endpoint, method, str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # -- engine hooks -----------------------------------------------------------------------
    def on_queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def on_admit(self, handle: Handle) -> None:
        self.prompt_tokens.labels(handle.request.model).inc(len(handle.request.prompt))
        self._progress[handle.id] = _Progress()

    def on_step(self, handle: Handle, step: StepResult) -> None:
        progress = self._progress.setdefault(handle.id, _Progress())
        model = handle.request.model
        if step.tokens:
            now = time.monotonic()
            n = len(step.tokens)
            self.generation_tokens.labels(model, step.method).inc(n)
            if progress.last_token_at is None:
                self.ttft.labels(model, step.method).observe(now - handle.submitted)
            else:
                per_token = (now - progress.last_token_at) / n
                itl = self.itl.labels(model, step.method)
                for _ in range(n):
                    itl.observe(per_token)
            progress.last_token_at = now
        self._export(handle, progress)

    def on_finish(self, handle: Handle, reason: str) -> None:
        progress = self._progress.pop(handle.id, None)
        if progress is not None:
            self._export(handle, progress)
        self.e2e.labels(handle.request.model, handle.request.method).observe(
            time.monotonic() - handle.submitted)

    def _export(self, handle: Handle, progress: _Progress) -> None:
        """Add what the sequence's figures gained since the last export."""
        seq = handle.sequence
        if seq is None:
            return
        model = handle.request.model
        for method, now in seq.stats_by_method.items():
            before = progress.seen.get(method) or SpecStats(method)
            labels = (model, method)
            _inc(self.draft_tokens.labels(*labels), now.drafted - before.drafted)
            _inc(self.accepted_tokens.labels(*labels), now.accepted - before.accepted)
            _inc(self.target_passes.labels(*labels), now.target_passes - before.target_passes)
            _inc(self.draft_cost.labels(*labels), now.draft_cost - before.draft_cost)
            old = before.accepted_by_position
            for pos, count in enumerate(now.accepted_by_position):
                gained = count - (old[pos] if pos < len(old) else 0)
                _inc(self.accepted_per_position.labels(*labels, str(pos)), gained)
            progress.seen[method] = replace(now, accepted_by_position=list(
                now.accepted_by_position))
        _inc(self.drafter_errors.labels(handle.request.method),
             seq.stats.drafter_errors - progress.errors)
        progress.errors = seq.stats.drafter_errors


def _inc(counter, amount: float) -> None:
    if amount > 0:
        counter.inc(amount)
