"""The monitoring stack, live: two `nodraft serve` processes behind Debian's nginx serve a
mix of speculation methods, a real Prometheus (the bundled config, retargeted to them)
scrapes both and evaluates the bundled recording rules, and then every recording rule and
every dashboard panel's query, sent to Prometheus's HTTP API, returns data.

Everything listens on loopback ports. About 10 s with the committed checkpoints; without
them a throwaway pair is trained first (``serving_checkpoints``), a minute or two more.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from dataclasses import dataclass, field

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.stack import (DASHBOARD, RULES_YML, free_port, nginx_argv, nginx_config,
                                prometheus_config)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("nodraft.server.app") is None,
                                reason="server/app.py (the nodraft server) does not exist yet")

MODELS = ("micro", "micro-layerskip")
METHODS = {
    "none": "none",
    "prompt_lookup": "prompt_lookup",
    "early_exit": {"method": "early_exit", "exit_layer": 2},
    "suffix": "suffix",
}
LOADTEST_METHODS = "none,prompt_lookup,early_exit:exit_layer=2,suffix"
# Repetitive code: prompt lookup finds its n-grams, and suffix decoding, having seen the
# first round's greedy output, drafts the second round's.
PROMPT = ("def area(width, height):\n    return width * height\n\n\n"
          "def area(width, height):\n    return")
RULES = [r["record"] for g in yaml.safe_load(RULES_YML.read_text())["groups"] for r in g["rules"]]
TARGETS = [(p["title"], t["refId"], t["expr"]) for p in json.loads(DASHBOARD.read_text())["panels"]
           if p["type"] != "row" for t in p["targets"]]


def wait_for(check, timeout: float, what: str):
    """Poll ``check()`` until it returns something truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


def requests_served(base: str) -> float:
    """The replica's own count of finished requests, from its /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == "nodraft_requests_total")


# auto among the drafters of METHODS only, so its steps add no method to the picker's list
AUTO = {"method": "auto", "candidates": "prompt_lookup,suffix"}


def send_mix(base: str) -> None:
    """Every model with every method (and auto): a completion, and a streamed chat
    completion."""
    with httpx.Client(base_url=base, timeout=120) as client:
        for model in MODELS:
            for speculation in [*METHODS.values(), AUTO]:
                body = {"model": model, "max_tokens": 24, "temperature": 0,
                        "speculation": speculation}
                r = client.post("/v1/completions", json={**body, "prompt": PROMPT})
                assert r.status_code == 200, r.text
                chat = {**body, "stream": True,
                        "messages": [{"role": "user", "content": PROMPT}]}
                with client.stream("POST", "/v1/chat/completions", json=chat) as r:
                    text = "".join(r.iter_text())
                    assert r.status_code == 200, text
                    assert "data: [DONE]" in text, text[-500:]


@dataclass
class Stack:
    prometheus: str
    nginx: str
    replicas: list[str]
    served_before: list[float] = field(default_factory=list)  # by each replica, before
    served_after: list[float] = field(default_factory=list)   # and after the nginx load

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(f"{self.prometheus}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]


@pytest.fixture(scope="module")
def stack(tool, processes, serving_checkpoints, tmp_path_factory) -> Stack:
    prometheus = tool("prometheus", "the Debian package prometheus")
    nginx = tool("nginx", "the Debian package nginx-light")

    ports = [free_port(), free_port()]
    replicas = [f"http://127.0.0.1:{p}" for p in ports]
    for i, port in enumerate(ports):
        processes.start(f"nodraft-{i}",
                        [sys.executable, "-m", "nodraft.server.cli", "serve", "--host", "127.0.0.1",
                         "--port", str(port), "--checkpoints", str(serving_checkpoints),
                         "--threads", "1", "--log-level", "warning"])

    prom_dir, prom_port = tmp_path_factory.mktemp("prometheus"), free_port()
    config = prometheus_config([f"127.0.0.1:{p}" for p in ports], prom_port)
    (prom_dir / "prometheus.yml").write_text(yaml.safe_dump(config))
    processes.start("prometheus", [prometheus, f"--config.file={prom_dir / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={prom_dir / 'data'}",
                                   f"--web.listen-address=127.0.0.1:{prom_port}",
                                   "--log.level=warn"])

    nginx_dir, nginx_port = tmp_path_factory.mktemp("nginx"), free_port()
    nginx_dir.chmod(0o755)  # nginx workers drop root to `nobody` when started as root
    (nginx_dir / "nginx.conf").write_text(nginx_config(ports, nginx_port, nginx_dir))
    processes.start("nginx", nginx_argv(nginx, nginx_dir / "nginx.conf", nginx_dir))

    for i, base in enumerate(replicas):
        processes.wait_http(f"nodraft-{i}", f"{base}/ready", timeout=180)
    processes.wait_http("prometheus", f"http://127.0.0.1:{prom_port}/-/ready", timeout=30)
    processes.wait_http("nginx", f"http://127.0.0.1:{nginx_port}/health", timeout=30)
    stack = Stack(f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{nginx_port}", replicas)

    # Round one, sent to each replica directly, creates every series on both; once
    # Prometheus holds them, round two, through nginx, raises them on whichever replica
    # serves each request, so every rate window the queries use sees an increase (a series
    # that first appears with its value shows no increase to rate()).
    for base in replicas:
        send_mix(base)
    everything = {(b.removeprefix("http://"), m, k) for b in replicas for m in MODELS
                  for k in METHODS}
    wait_for(lambda: {(s["metric"]["instance"], s["metric"]["model"], s["metric"]["method"])
                      for s in stack.query("count by (instance, model, method) "
                                           "(nodraft_spec_target_passes_total)")}
             >= everything, 30, "Prometheus to scrape every (model, method) series")
    stack.served_before = [requests_served(b) for b in replicas]
    send_mix(stack.nginx)
    if importlib.util.find_spec("nodraft.clients.loadtest") is not None:
        # the load-test client, as the compose `loadgen` service runs it
        status = processes.run_to_end(
            "loadtest", [sys.executable, "-m", "nodraft.server.cli", "loadtest", "--url", stack.nginx,
                         "--model", "micro-layerskip", "--concurrency", "2", "--requests", "8",
                         "--max-tokens", "16", "--methods", LOADTEST_METHODS, "--quiet",
                         "--json"], timeout=120)
        report = json.loads(processes.log("loadtest", tail=None))
        assert status == 0 and report["requests"]["failed"] == 0, report
    stack.served_after = [requests_served(b) for b in replicas]

    total = sum(stack.served_after)
    wait_for(lambda: (r := stack.query("sum(nodraft_requests_total)"))
             and float(r[0]["value"][1]) >= total, 30, "Prometheus to scrape the last requests")
    # a rate needs two scrapes of a series inside its window: wait for every model's
    wait_for(lambda: all({s["metric"]["model"] for s in stack.query(rule)} == set(MODELS)
                         for rule in RULES), 60, "every recording rule to be evaluated for every model")
    return stack


def test_both_replicas_answered_through_nginx(stack):
    for base, before, after in zip(stack.replicas, stack.served_before, stack.served_after):
        assert after > before, f"{base} served nothing of the load sent through nginx"


def test_both_replicas_are_scraped(stack):
    up = stack.query('up{job="nodraft"}')
    assert sorted(s["metric"]["instance"] for s in up) == sorted(
        b.removeprefix("http://") for b in stack.replicas)
    assert all(s["value"][1] == "1" for s in up)


@pytest.mark.parametrize("rule", RULES)
def test_every_recording_rule_returns_data(stack, rule):
    result = stack.query(rule)
    assert result, f"{rule} returned no data"
    assert {s["metric"]["model"] for s in result} == set(MODELS)


def test_recorded_ratios_keep_the_design_invariants(stack):
    def by_key(rule):
        return {(s["metric"]["model"], s["metric"]["method"]): float(s["value"][1])
                for s in stack.query(rule)}

    rate = by_key("model_method:nodraft_spec_acceptance_rate:ratio_rate1m")
    per_pass = by_key("model_method:nodraft_spec_tokens_per_pass:ratio_rate1m")
    speedup = by_key("model_method:nodraft_spec_estimated_speedup:ratio_rate1m")
    measured = by_key("model_method:nodraft_spec_measured_cost_speedup:ratio_rate1m")
    for model in MODELS:
        # plain decoding: nothing drafted, so no acceptance rate (not 0%); exactly 1 token
        # per pass and no draft cost
        assert (model, "none") not in rate
        assert per_pass[(model, "none")] == 1.0 and speedup[(model, "none")] == 1.0
        # plain decoding's passes are priced at the 1-row pass they are; `auto`'s steps
        # without a draft count under `none` too, with the time auto spent deciding
        assert 0.9 <= measured[(model, "none")] <= 1.0
        for method in ("prompt_lookup", "suffix", "early_exit"):
            assert 0.0 <= rate[(model, method)] <= 1.0
            assert per_pass[(model, method)] >= 1.0


SUBSTITUTIONS = [(model, method) for model in MODELS for method in (".*", "suffix")]


@pytest.mark.parametrize("model,method", SUBSTITUTIONS)
@pytest.mark.parametrize("title,ref,expr", TARGETS, ids=[f"{t}-{r}" for t, r, _ in TARGETS])
def test_every_panel_query_returns_data(stack, title, ref, expr, model, method):
    query = (expr.replace("$__rate_interval", "30s")
             .replace("$model", model).replace("$method", method).replace("$asked", method))
    result = stack.query(query)
    assert result, f"{title} ({ref}) returned no data for model={model} method={method}"
    values = [float(s["value"][1]) for s in result]
    assert any(math.isfinite(v) for v in values), (title, ref, values)


def test_dashboard_variables_list_the_models_and_methods(stack):
    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}

    def label_values(query: str, model: str = ".*") -> set[str]:
        # label_values(SELECTOR, LABEL), as Grafana runs it: the label's values on SELECTOR
        selector, label = query.removeprefix("label_values(").removesuffix(")").rsplit(", ", 1)
        r = httpx.get(f"{stack.prometheus}/api/v1/label/{label}/values",
                      params={"match[]": selector.replace("$model", model)}, timeout=10)
        return set(r.json()["data"])

    assert label_values(variables["model"]["query"]["query"]) == set(MODELS)
    for model in MODELS:
        assert label_values(variables["method"]["query"]["query"], model) == set(METHODS)
    assert set(METHODS) <= label_values(variables["asked"]["query"]["query"])
