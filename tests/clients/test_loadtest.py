"""``nodraft loadtest`` against a live server, and its arithmetic."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from nodraft.clients import loadtest
from nodraft.clients.loadtest import LoadConfig, percentiles, run_loadtest, speculation


def ordered(p: dict) -> None:
    assert p["p50"] <= p["p90"] <= p["p99"]


def test_streaming_mix_of_methods(live):
    progress = io.StringIO()
    config = LoadConfig(url=live.url, concurrency=4, requests=12, max_tokens=16,
                        methods=["none", "prompt_lookup"])
    r = asyncio.run(run_loadtest(config, progress, interval=0.2))
    assert r["errors"] == {}
    assert r["requests"] == {"sent": 12, "ok": 12, "failed": 0}
    lat = r["latency_s"]
    for key in ("ttft", "inter_token", "e2e"):
        ordered(lat[key])
    assert lat["ttft"]["n"] == lat["e2e"]["n"] == 12
    assert lat["ttft"]["p50"] <= lat["e2e"]["p50"]
    assert r["throughput"]["requests_per_s"] > 0 and r["throughput"]["generated_tokens"] > 0
    none, lookup = r["methods"]["none"], r["methods"]["prompt_lookup"]
    assert none["requests"] == lookup["requests"] == 6
    assert none["drafted"] == 0 and none["acceptance_rate"] is None
    assert none["tokens_per_pass"] == 1.0
    assert lookup["target_passes"] > 0
    assert lookup["tokens_per_pass"] == pytest.approx(
        (lookup["accepted"] + lookup["target_passes"]) / lookup["target_passes"])
    assert "12/12 done" in progress.getvalue()
    assert "prompt_lookup" in loadtest.render(r)
    # 12 requests for 4 users: until the first user found none left, every user was busy
    sustained = r["throughput"]["sustained_tokens_per_s"]
    assert sustained is not None and sustained > 0
    assert "while every user was busy" in loadtest.render(r)


def test_each_stream_keeps_its_connection(live, monkeypatch):
    """A worker sends its requests on one kept-alive connection: it reads each stream to
    its end (a response left unread past ``[DONE]`` closes its connection), so the server
    sees as many connections as streams, not one per request."""
    opened = []
    for protocol in (HttpToolsProtocol, H11Protocol):  # whichever the server runs
        def counted(self, transport, made=protocol.connection_made):
            opened.append(transport.get_extra_info("peername"))
            made(self, transport)

        monkeypatch.setattr(protocol, "connection_made", counted)
    config = LoadConfig(url=live.url, concurrency=2, requests=8, max_tokens=4,
                        methods=["none"])
    r = asyncio.run(run_loadtest(config))
    assert r["requests"] == {"sent": 8, "ok": 8, "failed": 0}
    assert len(opened) == 2, opened


def test_cli_not_streaming_json(live, capsys):
    loadtest.main(["--url", live.url + "/v1", "--concurrency", "2", "--requests", "4",
                   "--no-stream", "--max-tokens", "8", "--json", "--quiet",
                   "--methods", "early_exit:exit_layer=1", "--endpoint", "chat"])
    r = json.loads(capsys.readouterr().out)
    assert r["throughput"]["sustained_tokens_per_s"] is None  # nothing streamed
    assert r["requests"]["ok"] == 4
    assert r["latency_s"]["ttft"] is None and r["latency_s"]["inter_token"] is None
    ordered(r["latency_s"]["e2e"])
    assert r["methods"]["early_exit:exit_layer=1"]["target_passes"] > 0


def test_a_seeded_load_gives_every_method_the_same_seeds(live, monkeypatch):
    """--seed: request i carries seed + i div #methods, so each prompt meets every method
    with one seed (seeded sampling being drafter-invariant: the same text for each), and
    the server takes the seeded requests."""
    assert loadtest._body(LoadConfig(url="x", stream=False), "none", "p", 5)[1]["seed"] == 5
    assert "seed" not in loadtest._body(LoadConfig(url="x", stream=False), "none", "p")[1]
    config = LoadConfig(url=live.url, concurrency=3, requests=12, max_tokens=24,
                        methods=["none", "prompt_lookup"], temperature=0.9, seed=11)
    assert asyncio.run(run_loadtest(config))["errors"] == {}
    sent = []
    real = loadtest.one_request

    async def recording(client, config, method, prompt, seed=None):
        sent.append((method, prompt, seed))
        return await real(client, config, method, prompt, seed)

    monkeypatch.setattr(loadtest, "one_request", recording)
    asyncio.run(run_loadtest(dataclasses.replace(config, concurrency=1)))
    assert [s for _, _, s in sent] == [11 + i // 2 for i in range(12)]
    by_prompt = {}
    for method, prompt, seed in sent:
        by_prompt.setdefault((prompt, seed), set()).add(method)
    assert all(ms == {"none", "prompt_lookup"} for ms in by_prompt.values())


def test_errors_by_status_and_the_duration_bound(live):
    config = LoadConfig(url=live.url, concurrency=2, requests=10**6, duration=1.0,
                        max_tokens=4, methods=["none", "no_such_drafter"], stream=False)
    r = asyncio.run(run_loadtest(config))
    assert 0 < r["requests"]["sent"] < 10**6 and r["duration_s"] < 30  # stopped by itself
    assert set(r["errors"]) == {"400"}
    assert r["methods"]["no_such_drafter"]["errors"] == r["methods"]["no_such_drafter"]["requests"]
    assert r["methods"]["none"]["errors"] == 0


def test_speculation_items():
    assert speculation("prompt_lookup") == {"method": "prompt_lookup"}
    assert speculation("early_exit:exit_layer=2:num_speculative_tokens=4") == {
        "method": "early_exit", "exit_layer": 2, "num_speculative_tokens": 4}
    assert speculation("prompt_lookup:match=first") == {"method": "prompt_lookup",
                                                        "match": "first"}
    with pytest.raises(ValueError):
        speculation("early_exit:exit_layer")


@given(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=200))
def test_percentiles_are_ordered(xs):
    p = percentiles(xs)
    assert min(xs) <= p["p50"] <= p["p90"] <= p["p99"] <= max(xs)
    assert p["n"] == len(xs)


def test_sustained_rate_counts_the_chunks_until_the_first_user_fell_idle():
    def outcome(status, arrivals):
        return loadtest.Outcome("none", status, 1.0, arrivals=arrivals)

    outcomes = [outcome(200, [(1.0, 1), (2.0, 3), (3.5, 2)]),
                outcome(200, [(1.5, 2), (2.5, 4)]),
                outcome(500, [(1.2, 7)])]  # a failed request's tokens are not counted
    assert loadtest.sustained_rate(outcomes, 0.5, 3.0) == (1 + 3 + 2 + 4) / 2.5
    assert loadtest.sustained_rate(outcomes, 0.0, 0.8) is None  # nothing arrived yet
