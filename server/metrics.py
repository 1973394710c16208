"""The Prometheus adapter: the engine's events and figures, exported as counters.

The engine reports every step with what it drafted, accepted and what the draft cost
(``StepResult``), and every request's end with its totals (``SpecStats``). This adapter
runs in the API process and turns each step into counter increments, so a step that emits
several tokens (accepted draft tokens plus the bonus token) counts every one of them; at a
request's end whatever its totals hold beyond the steps (a drafter error in ``close``) is
added, so the counters add up to exactly the figures the responses report. Ratios are left
to PromQL:

    acceptance rate    = rate(nodraft_spec_accepted_tokens_total)
                         / rate(nodraft_spec_draft_tokens_total)
    tokens per pass    = (rate(accepted) + rate(target_passes)) / rate(target_passes)
    estimated speed-up = (rate(accepted) + rate(target_passes))
                         / (rate(target_passes) + rate(draft_cost_passes))
    measured-cost speed-up = rate(plain_seconds)
                         / (rate(verify_seconds) + rate(draft_seconds))

Labels: ``model`` is the checkpoint; ``method`` is the drafter that proposed (for ``auto``,
the one it chose at each step); ``position`` counts draft positions from 0 (the first draft
token after the current token). Drafter errors, ``nodraft_requests_total`` and the
end-to-end latency are labelled by the method the request asked for (``auto`` included);
``nodraft_auto_choices_total{model,method}`` counts the steps of ``auto`` requests by the
drafter it chose (``none``: no draft that step), so ``auto`` has series of its own.

Latencies, per sequence, measured where the API receives the engine's events (so they
include the trip from the engine process): time to first token from submission to the
first step that emitted a token; inter-token latency once per token emitted by each later
step, as the step's gap divided by its tokens (so its mean is seconds per token, and
speculation shows in it); end-to-end from submission to the end of the sequence.

``observe`` is called by the engine client for every event, on one thread at a time per
request. A step's counter increments are added up here and reach the counters at
``flush`` -- after each batch of the engine's outputs (``MPClient``), and before every
scrape (``render``) -- so a batch of 32 streams' steps costs each counter one locked
increment, not 32; the latency histograms are observed at once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, ProcessCollector, generate_latest)

from nodraft.engine.core import Event, GenerationRequest
from nodraft.engine.stats import SpecStats

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
# the counters every step adds to, in the order of ``Metrics._step``'s row of sums
STEP_COUNTERS = ("generation_tokens", "auto_choices", "draft_tokens", "accepted_tokens",
                 "target_passes", "draft_cost", "plain_seconds", "verify_seconds",
                 "draft_seconds")
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class _Progress:
    """What has been exported for one running sequence."""

    request: GenerationRequest
    submitted: float
    seen: dict[str, SpecStats] = field(default_factory=dict)  # method -> figures so far
    errors: int = 0
    counted_errors: bool = False  # its drafter-error series made (at its first step)
    last_token_at: float | None = None


class Metrics:
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
        self.plain_seconds = Counter(
            "nodraft_spec_plain_seconds", "Seconds plain decoding would have spent on the "
            "tokens the passes emitted (one 1-row pass each, measured on this machine).", mm,
            registry=r)
        self.verify_seconds = Counter(
            "nodraft_spec_verify_seconds", "Seconds the target passes cost by their rows, "
            "as measured for one sequence's pass on this machine.", mm, registry=r)
        self.draft_seconds = Counter(
            "nodraft_spec_draft_seconds", "The drafters' own wall time.", mm, registry=r)
        self.generation_tokens = Counter(
            "nodraft_generation_tokens", "Tokens generated (accepted draft tokens plus bonus "
            "tokens).", mm, registry=r)
        self.prompt_tokens = Counter(
            "nodraft_prompt_tokens", "Prompt tokens prefilled, per sequence.", ["model"],
            registry=r)
        self.prefix_cache_queries = Counter(
            "nodraft_prefix_cache_queries", "Prompt tokens looked up in the prefix cache, per "
            "sequence.", ["model"], registry=r)
        self.prefix_cache_hits = Counter(
            "nodraft_prefix_cache_hits", "Prompt tokens read from the prefix cache instead of "
            "prefilled, per sequence.", ["model"], registry=r)
        self.requests = Counter(
            "nodraft_requests", "HTTP generation requests by endpoint, speculation method and "
            "status (499: the client went away, while sending its body included).",
            ["endpoint", "method", "status"], registry=r)
        self.ttft = Histogram(
            "nodraft_time_to_first_token_seconds", "From submission to the first token.", mm,
            buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(
            "nodraft_inter_token_latency_seconds", "Seconds per token after the first step.",
            mm, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(
            "nodraft_e2e_request_latency_seconds", "From submission to the end of a sequence.",
            mm, buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge(
            "nodraft_requests_running", "Sequences being decoded, all models together (each "
            "model decodes at most --max-running at once).", registry=r)
        self.waiting = Gauge(
            "nodraft_requests_waiting", "Sequences queued for a KV slot, all models together "
            "(running + waiting + those being prepared stay within --max-running + "
            "--max-waiting).", registry=r)
        self.auto_choices = Counter(
            "nodraft_auto_choices", "Steps of requests that asked for auto, by the drafter "
            "auto chose for the step (none: it drafted nothing).", mm, registry=r)
        self.drafter_errors = Counter(
            "nodraft_drafter_errors", "Drafter exceptions contained by the engine (the step "
            "fell back to plain decoding).", ["method"], registry=r)
        self._progress: dict[int, _Progress] = {}
        # each metric's child per label values, looked up once: ``labels()`` takes a lock
        # and builds its key, ~10 times a step otherwise (children are never removed)
        self._children: dict[tuple, Any] = {}
        self._pending: dict[Any, float] = {}  # counter child -> increment not yet made
        # the per-step counters' increments not yet made, one row of sums per (model,
        # method, whether the request asked for auto), in ``STEP_COUNTERS``' order: a step
        # adds to one list, the flush makes each counter's one increment
        self._step_sums: dict[tuple[str, str, bool], list[float]] = {}
        self._lock = threading.Lock()  # the pending increments: the engine's thread adds
        # them under ``--engine-process false``, the event loop flushes them

    def _child(self, metric, *labels: str):
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    # -- the API's side ----------------------------------------------------------------------
    def count_request(self, endpoint: str, method: str, status: int) -> None:
        self.requests.labels(endpoint, method, str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        self.flush()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def flush(self) -> None:
        """Make the counter increments the steps observed so far."""
        with self._lock:
            pending, self._pending = self._pending, {}
            sums, self._step_sums = self._step_sums, {}
        for (model, method, auto), row in sums.items():
            for name, amount in zip(STEP_COUNTERS, row):
                if name == "auto_choices" and not auto:
                    continue
                child = self._child(getattr(self, name), model, method)  # the series exists
                if amount > 0:
                    child.inc(amount)
        for child, amount in pending.items():
            if amount > 0:
                child.inc(amount)

    def _add(self, metric, labels: tuple, amount: float) -> None:
        """An increment of ``metric{labels}`` for the next ``flush`` (caller holds the lock);
        the series exists from its first step on, at 0 if nothing was added."""
        child = self._child(metric, *labels)
        if amount > 0:
            self._pending[child] = self._pending.get(child, 0.0) + amount

    # -- the engine's events ----------------------------------------------------------------
    def on_queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def begin(self, rid: int, request: GenerationRequest, submitted: float) -> None:
        """A request was submitted at ``submitted`` (``time.monotonic``)."""
        self._progress[rid] = _Progress(request, submitted)

    def observe(self, rid: int, event: Event) -> None:
        progress = self._progress.get(rid)
        if progress is None:
            return
        model = progress.request.model
        if event.kind == "admit":
            self.prompt_tokens.labels(model).inc(len(progress.request.prompt))
        elif event.kind == "step":
            self._step(progress, event.step, event.at)
        else:  # finish or error: the request's totals, then its latency
            del self._progress[rid]
            for method, now in (event.stats_by_method or {}).items():
                self._export(progress, method, now)
            if event.stats is not None:
                self._errors(progress, event.stats.drafter_errors)
            self.e2e.labels(model, progress.request.method).observe(
                time.monotonic() - progress.submitted)

    def _step(self, progress: _Progress, step, at: float | None) -> None:
        """``at``: when the engine had the step ready (``Event.at``); its arrival here
        may be later, several steps at once (``--stream-interval-ms``)."""
        model, method = progress.request.model, step.method
        if step.tokens:
            now = time.monotonic() if at is None else at
            n = len(step.tokens)
            if progress.last_token_at is None:
                self._child(self.ttft, model, method).observe(now - progress.submitted)
            else:
                per_token = (now - progress.last_token_at) / n
                itl = self._child(self.itl, model, method)
                for _ in range(n):
                    itl.observe(per_token)
            progress.last_token_at = now
        seen = progress.seen.get(method)
        if seen is None:
            seen = progress.seen[method] = SpecStats(method)
        drafted = len(step.draft)
        seen.record(drafted, step.accepted, step.cost, step.plain_seconds,
                    step.verify_seconds, step.draft_seconds)
        key = (model, method, progress.request.method == "auto")
        with self._lock:
            row = self._step_sums.get(key)
            if row is None:
                row = self._step_sums[key] = [0.0] * len(STEP_COUNTERS)
            row[0] += len(step.tokens)
            row[1] += 1  # auto_choices (made for auto's requests only)
            row[2] += drafted
            row[3] += step.accepted
            row[4] += 1
            row[5] += step.cost
            row[6] += step.plain_seconds
            row[7] += step.verify_seconds
            row[8] += step.draft_seconds
            if step.cached_tokens is not None:  # the first step: the prompt's prefill
                self._add(self.prefix_cache_queries, (model,), len(progress.request.prompt))
                self._add(self.prefix_cache_hits, (model,), step.cached_tokens)
            for pos in range(step.accepted):
                self._add(self.accepted_per_position, (model, method, str(pos)), 1)
        if not progress.counted_errors or step.drafter_errors > progress.errors:
            self._errors(progress, step.drafter_errors)

    def _export(self, progress: _Progress, method: str, now: SpecStats) -> None:
        """Add what one method's figures gained beyond what its steps exported (a request's
        totals at its end)."""
        before = progress.seen.get(method) or SpecStats(method)
        labels = (progress.request.model, method)
        with self._lock:
            self._add(self.draft_tokens, labels, now.drafted - before.drafted)
            self._add(self.accepted_tokens, labels, now.accepted - before.accepted)
            self._add(self.target_passes, labels, now.target_passes - before.target_passes)
            self._add(self.draft_cost, labels, now.draft_cost - before.draft_cost)
            self._add(self.plain_seconds, labels, now.plain_seconds - before.plain_seconds)
            self._add(self.verify_seconds, labels, now.verify_seconds - before.verify_seconds)
            self._add(self.draft_seconds, labels, now.draft_seconds - before.draft_seconds)
            old = before.accepted_by_position
            for pos, count in enumerate(now.accepted_by_position):
                self._add(self.accepted_per_position, (*labels, str(pos)),
                          count - (old[pos] if pos < len(old) else 0))
        progress.seen[method] = now

    def _errors(self, progress: _Progress, errors: int) -> None:
        progress.counted_errors = True
        with self._lock:
            self._add(self.drafter_errors, (progress.request.method,), errors - progress.errors)
        progress.errors = max(progress.errors, errors)
