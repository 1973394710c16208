"""/metrics: the metric names of docs/ARCHITECTURE.md, counters that add up to the responses' figures, and a clean
``promtool check metrics``."""

from __future__ import annotations

import shutil
import subprocess

import httpx
import pytest
from server_testing import metric, metrics, sse_payloads, wait_for

from nodraft.drafters.registry import Registry

SPEC_COUNTERS = {  # metric -> the speculation figure it sums
    "nodraft_spec_draft_tokens_total": "drafted",
    "nodraft_spec_accepted_tokens_total": "accepted",
    "nodraft_spec_target_passes_total": "target_passes",
    "nodraft_spec_draft_cost_passes_total": "draft_cost",
    "nodraft_spec_plain_seconds_total": "plain_seconds",
    "nodraft_spec_verify_seconds_total": "verify_seconds",
    "nodraft_spec_draft_seconds_total": "draft_seconds",
}
PROMPT = "for i in range(10):\n    print(i)\nfor i in range(10):\n    print("


def run_requests(url: str, method: str) -> list[tuple[dict, int]]:
    """Two requests with ``method``, one streamed: their (speculation, completion_tokens)."""
    out = []
    req = {"model": "micro", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
           "speculation": method}
    r = httpx.post(url + "/v1/completions", json=req, timeout=60).json()
    out.append((r["speculation"], r["usage"]["completion_tokens"]))
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "model": "micro", "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 9, "temperature": 0.7, "seed": 5, "speculation": method,
            "stream": True, "stream_options": {"include_usage": True}}) as s:
        final = sse_payloads(s.iter_lines())[-2]
    out.append((final["speculation"], final["usage"]["completion_tokens"]))
    return out


def totals(url: str) -> dict:
    snap = metrics(url)

    def total(name: str, **labels) -> float:
        want = set(labels.items())
        return sum(v for (n, ls), v in snap.items() if n == name and want <= ls)
    out = {name: total(name, model="micro") for name in SPEC_COUNTERS}
    out["generation"] = total("nodraft_generation_tokens_total", model="micro")
    out["errors"] = total("nodraft_drafter_errors_total")
    out["positions"] = {}
    for (n, ls), v in snap.items():
        if n == "nodraft_spec_accepted_tokens_per_position_total" and ("model", "micro") in ls:
            pos = dict(ls)["position"]
            out["positions"][pos] = out["positions"].get(pos, 0) + v
    return out


@pytest.mark.parametrize("method", Registry().names())
def test_counters_equal_the_responses(live, method):
    url = live.url
    ok_before = metric(url, "nodraft_requests_total", status="200")
    before = totals(url)
    results = run_requests(url, method)
    after = totals(url)
    for name, figure in SPEC_COUNTERS.items():
        want = sum(spec[figure] for spec, _ in results)
        # responses round the seconds to 1 us and the rest to 1e-4
        tolerance = 1e-5 if name.endswith("_seconds_total") else 1e-3
        assert after[name] - before[name] == pytest.approx(want, abs=tolerance), name
    assert after["generation"] - before["generation"] == sum(n for _, n in results)
    assert after["errors"] - before["errors"] == sum(s["drafter_errors"] for s, _ in results)
    for pos in range(max(len(s["accepted_by_position"]) for s, _ in results)):
        want = sum(s["accepted_by_position"][pos] for s, _ in results
                   if pos < len(s["accepted_by_position"]))
        got = after["positions"].get(str(pos), 0) - before["positions"].get(str(pos), 0)
        assert got == want, f"position {pos}"
    # requests are counted once the response is complete
    assert wait_for(lambda: metric(url, "nodraft_requests_total", status="200") == ok_before + 2)


def test_auto_has_series_of_its_own(live):
    """auto's steps, by the drafter it chose, add up to its requests' target passes, and
    its requests count under auto."""
    url = live.url
    before = metric(url, "nodraft_auto_choices_total", model="micro")
    asked = metric(url, "nodraft_requests_total", method="auto", status="200")
    results = run_requests(url, "auto")
    assert metric(url, "nodraft_auto_choices_total", model="micro") - before == sum(
        spec["target_passes"] for spec, _ in results)
    assert wait_for(lambda: metric(url, "nodraft_requests_total", method="auto",
                                   status="200") == asked + 2)
    snap = metrics(url)
    chosen = {dict(ls)["method"] for (n, ls), _ in snap.items()
              if n == "nodraft_auto_choices_total"}
    assert chosen and "auto" not in chosen and chosen <= set(Registry().names())
    before_none = metric(url, "nodraft_auto_choices_total", model="micro")
    run_requests(url, "none")  # other methods' steps are not auto's
    assert metric(url, "nodraft_auto_choices_total", model="micro") == before_none


def test_labels_by_model_and_method(live):
    url = live.url
    before = metric(url, "nodraft_spec_target_passes_total", model="micro-layerskip",
                    method="early_exit")
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "micro-layerskip", "prompt": "x = 1\n", "max_tokens": 5, "temperature": 0,
        "speculation": {"method": "early_exit", "exit_layer": 1}}).json()
    after = metric(url, "nodraft_spec_target_passes_total", model="micro-layerskip",
                   method="early_exit")
    assert after - before == r["speculation"]["target_passes"]
    assert metric(url, "nodraft_time_to_first_token_seconds_count", model="micro-layerskip") >= 1
    assert metric(url, "nodraft_e2e_request_latency_seconds_count") >= 1
    assert metric(url, "nodraft_prompt_tokens_total", model="micro-layerskip") >= 1
    assert wait_for(lambda: metric(url, "nodraft_requests_total",
                                   endpoint="/v1/completions", method="early_exit") >= 1)


def test_prefix_cache_counters_add_up_to_the_usage(live):
    import uuid

    url = live.url
    req = {"model": "micro", "prompt": f"# {uuid.uuid4().hex}\n" + PROMPT * 3,
           "max_tokens": 3, "temperature": 0, "speculation": "none"}
    before = [metric(url, f"nodraft_prefix_cache_{k}_total", model="micro")
              for k in ("queries", "hits")]
    usages = [httpx.post(url + "/v1/completions", json=req, timeout=60).json()["usage"]
              for _ in range(2)]
    after = [metric(url, f"nodraft_prefix_cache_{k}_total", model="micro")
             for k in ("queries", "hits")]
    assert after[0] - before[0] == sum(u["prompt_tokens"] for u in usages)
    assert after[1] - before[1] == sum(u["prompt_tokens_details"]["cached_tokens"]
                                       for u in usages) > 0


def test_design_metric_names_present(live):
    httpx.post(live.url + "/v1/completions", timeout=60, json={
        "model": "micro", "prompt": "a a a a", "max_tokens": 6, "temperature": 0,
        "speculation": "prompt_lookup"})
    names = {n for n, _ in metrics(live.url)}
    for name in ["nodraft_spec_draft_tokens_total", "nodraft_spec_accepted_tokens_total",
                 "nodraft_spec_target_passes_total", "nodraft_spec_draft_cost_passes_total",
                 "nodraft_spec_plain_seconds_total", "nodraft_spec_verify_seconds_total",
                 "nodraft_spec_draft_seconds_total", "nodraft_generation_tokens_total", "nodraft_prompt_tokens_total",
                 "nodraft_requests_total", "nodraft_time_to_first_token_seconds_bucket",
                 "nodraft_inter_token_latency_seconds_bucket",
                 "nodraft_e2e_request_latency_seconds_bucket", "nodraft_requests_running",
                 "nodraft_requests_waiting", "nodraft_drafter_errors_total",
                 "nodraft_prefix_cache_queries_total", "nodraft_prefix_cache_hits_total"]:
        assert name in names, name


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (apt-get install prometheus; CI installs it)")
def test_promtool_check_metrics(live):
    httpx.post(live.url + "/v1/completions", timeout=60, json={
        "model": "micro", "prompt": "x", "max_tokens": 3, "speculation": "suffix"})
    text = httpx.get(live.url + "/metrics").text
    p = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 0 and p.stdout.strip() == "" and p.stderr.strip() == "", (
        p.stdout + p.stderr)


def test_latencies_are_taken_from_when_the_engine_had_each_step():
    """Steps reach the API process several at a time (``--stream-interval-ms``): time to
    first token and inter-token latency come from each step's own time (``Event.at``),
    not from when the message arrived."""
    from prometheus_client import CollectorRegistry

    from nodraft.engine.core import Event, GenerationRequest
    from nodraft.engine.sequence import StepResult
    from nodraft.server.metrics import Metrics

    registry = CollectorRegistry()
    m = Metrics(registry)
    m.begin(1, GenerationRequest("micro", [1, 2], 8), submitted=100.0)
    m.observe(1, Event("admit"))
    for tokens, at in (([5], 100.25), ([6, 7], 100.75), ([8], 101.0)):  # arriving together
        m.observe(1, Event("step", step=StepResult(tokens, 0, [], [], "none", 0.0, None, 0, 0),
                           at=at))
    labels = {"model": "micro", "method": "none"}
    assert registry.get_sample_value("nodraft_time_to_first_token_seconds_sum", labels) == 0.25
    assert registry.get_sample_value("nodraft_inter_token_latency_seconds_count", labels) == 3
    assert registry.get_sample_value("nodraft_inter_token_latency_seconds_sum", labels) == 0.75
