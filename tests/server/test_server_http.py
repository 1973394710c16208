"""The HTTP surface with a raw client: SSE framing, errors, limits, auth, disconnects."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
from server_testing import MAX_RUNNING, MAX_WAITING, LiveServer, metric, sse_payloads, wait_for

from server.app import create_app
from server.settings import Settings

SLOW = {"method": "slow", "delay": 0.05}


def body(**kw) -> dict:
    return {"model": "micro", "prompt": "import os\n", "max_tokens": 4, "temperature": 0, **kw}


def test_sse_framing(http):
    with http.stream("POST", "/v1/completions",
                     json=body(stream=True, max_tokens=6, speculation="prompt_lookup",
                               stream_options={"include_usage": True})) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(r.iter_lines())
    assert payloads[-1] == "[DONE]"
    final, steps = payloads[-2], payloads[:-2]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] >= 1
    assert final["speculation"]["method"] == "prompt_lookup"
    assert all(p["object"] == "text_completion" and p["usage"] is None for p in steps)
    assert steps[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    # token origins: the tokens' texts add up to the streamed text
    origins = [t for p in steps for t in p.get("nodraft", {}).get("tokens", [])]
    assert {t["origin"] for t in origins} <= {"accepted", "bonus"}
    assert len(origins) == final["usage"]["completion_tokens"]
    text = "".join(p["choices"][0]["text"] for p in steps)
    assert "".join(t["text"] for t in origins) == text


def test_chat_stream_opens_with_role(http):
    with http.stream("POST", "/v1/chat/completions", json={
            "model": "micro", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True}) as r:
        payloads = sse_payloads(r.iter_lines())
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert payloads[0]["object"] == "chat.completion.chunk"
    assert "speculation" in payloads[-2] and payloads[-1] == "[DONE]"


BAD = [  # (request body or raw bytes, status, param)
    (b'{"model": "micro", "prompt": ', 400, None),
    (b'{"model": "micro", "prompt": "\xff\xfe"}', 400, None),
    (b'[1, 2]', 400, None),
    (body(model="gpt-5"), 404, "model"),
    (body(max_tokens=-1), 400, "max_tokens"),
    (body(max_tokens=0), 400, "max_tokens"),
    (body(max_tokens=10**30), 400, "max_tokens"),
    (body(max_tokens="many"), 400, "max_tokens"),
    (body(temperature=-0.5), 400, "temperature"),
    (body(n=0), 400, "n"),
    (body(prompt=7), 400, "prompt"),
    (body(prompt=[5000]), 400, "prompt"),
    (body(prompt="x" * 5000), 400, "prompt"),
    (body(stop=""), 400, "stop"),
    (body(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (body(speculation="warp_drive"), 400, "speculation.method"),
    (body(speculation={"method": "early_exit", "exit_layer": 9}), 400, "speculation"),
    (body(speculation={"method": "prompt_lookup", "bogus": 1}), 400, "speculation.bogus"),
    (body(speculation=[1]), 400, "speculation"),
    (body(logprobs=1), 400, "logprobs"),
    (body(echo=True), 400, "echo"),
    (body(best_of=3), 400, "best_of"),
    (body(presence_penalty=0.5), 400, "presence_penalty"),
    (body(logit_bias={"1": 5}), 400, "logit_bias"),
    (body(flavour="vanilla"), 400, "flavour"),
    (body(stream_options={"include_usage": True}), 400, "stream_options"),
    (b'', 400, None),
]


@pytest.mark.parametrize("payload,status,param", BAD)
def test_bad_completion_requests(http, payload, status, param):
    if isinstance(payload, bytes):
        r = http.post("/v1/completions", content=payload,
                      headers={"content-type": "application/json"})
    else:
        r = http.post("/v1/completions", json=payload)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize("payload,param", [
    ({"model": "micro", "messages": []}, "messages"),
    ({"model": "micro", "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"model": "micro", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools"),
    ({"model": "micro", "messages": [{"role": "user"}]}, "messages.0.content"),
    ({"model": "micro", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
      "max_completion_tokens": 5}, "max_completion_tokens"),
    ({"model": "micro", "messages": [{"role": "user", "content": "x " * 1100}]}, "messages"),
])
def test_bad_chat_requests(http, payload, param):
    r = http.post("/v1/chat/completions", json=payload)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_neutral_openai_defaults_accepted(http):
    r = http.post("/v1/completions", json=body(presence_penalty=0, frequency_penalty=0.0,
                                               logprobs=None, echo=False, best_of=1, user="u"))
    assert r.status_code == 200, r.text


def test_context_limit_message(http):
    r = http.post("/v1/completions", json=body(prompt=[1] * 1024))
    assert r.status_code == 400
    assert "1023" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = http.post("/v1/completions", json=body(prompt=[1] * 1000, max_tokens=30))
    assert r.status_code == 400 and "at most 24" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json=body(prompt=[1] * 1020, max_tokens=None))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4


def test_oversized_body(http):
    r = http.post("/v1/completions", json=body(prompt="x" * 2_000_000))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b"x" * 50_000
    r = http.post("/v1/completions", content=chunks(),
                  headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_unknown_route_and_method(http):
    assert http.get("/v2/nothing").json()["error"]["type"] == "not_found_error"
    assert http.get("/v1/completions").status_code == 405


def test_health_ready_models(http):
    assert http.get("/health").json() == {"status": "ok", "compiled": "off"}
    assert http.get("/ready").status_code == 200
    models = http.get("/v1/models").json()["data"]
    assert {m["id"] for m in models} == {"micro", "micro-layerskip"}
    assert "prompt_lookup" in models[0]["speculation_methods"]


def test_api_key_and_cors(serve_checkpoints):
    """Without a lifespan (nothing loaded): the middleware alone answers."""
    from starlette.testclient import TestClient

    app = create_app(Settings(checkpoints=serve_checkpoints, api_key="sekrit",
                              cors_origins="http://play.local"))
    c = TestClient(app)
    assert c.get("/health").status_code == 200
    r = c.post("/v1/completions", json=body())
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert c.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    r = c.get("/v1/models", headers={"Authorization": "Bearer sekrit",
                                     "Origin": "http://play.local"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://play.local"
    plain = TestClient(create_app(Settings(checkpoints=serve_checkpoints)))
    r = plain.get("/health", headers={"Origin": "http://play.local"})
    assert "access-control-allow-origin" not in r.headers  # CORS off by default


def test_health_answers_during_generation_and_disconnect_frees_slot(live, http):
    """A stream in flight: /health answers at once; the client goes away mid-stream; its
    sequence is cancelled and the running gauge returns to 0."""
    url = live.url
    gone = metric(url, "nodraft_requests_total", status="499")
    with http.stream("POST", "/v1/completions",
                     json=body(stream=True, max_tokens=500, speculation=SLOW)) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert metric(url, "nodraft_requests_running") == 1
        t = time.monotonic()
        assert http.get("/health").status_code == 200
        assert time.monotonic() - t < 0.5
    assert wait_for(lambda: metric(url, "nodraft_requests_running") == 0, timeout=3)
    assert wait_for(lambda: metric(url, "nodraft_requests_total", status="499") == gone + 1)


def test_non_streaming_disconnect_cancels(live):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json=body(max_tokens=500, speculation=SLOW),
                   timeout=0.5)
    assert wait_for(lambda: metric(live.url, "nodraft_requests_running") == 0, timeout=3)


def test_bounded_admission(live, http):
    """max_running + max_waiting sequences fill the server: the next request gets 429 with
    Retry-After; when they go, requests are served again."""
    n = MAX_RUNNING + MAX_WAITING
    # an earlier test's cancelled sequence may still hold a slot for a moment
    assert wait_for(lambda: metric(live.url, "nodraft_requests_running") == 0
                    and metric(live.url, "nodraft_requests_waiting") == 0, timeout=10)
    with http.stream("POST", "/v1/completions",
                     json=body(stream=True, n=n, max_tokens=500, speculation=SLOW)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)
        full = http.post("/v1/completions", json=body())
        assert full.status_code == 429
        assert full.headers["retry-after"] == "1"
        assert full.json()["error"]["type"] == "rate_limit_error"
        # the engine reports its queue with each iteration's outputs
        waiting = lambda: metric(live.url, "nodraft_requests_waiting")  # noqa: E731
        assert wait_for(lambda: waiting() == MAX_WAITING), (
            waiting(), metric(live.url, "nodraft_requests_running"), list(lines)[-4:])
    assert wait_for(lambda: metric(live.url, "nodraft_requests_running") == 0, timeout=10)
    assert http.post("/v1/completions", json=body()).status_code == 200


def test_concurrent_requests_all_served(live):
    def one(i: int) -> int:
        r = httpx.post(live.url + "/v1/completions", timeout=60, json=body(
            model=("micro", "micro-layerskip")[i % 2], max_tokens=8, seed=i, temperature=1.0,
            speculation=("none", "prompt_lookup", "early_exit", "suffix")[i % 4]))
        return r.status_code
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        assert list(pool.map(one, range(6))) == [200] * 6


def test_utf8_safe_stream_text(http):
    """Whatever bytes the tokens carry, each chunk's text is valid UTF-8 JSON text."""
    with http.stream("POST", "/v1/completions", json=body(
            prompt="naïve café — 日本語 ", max_tokens=40, temperature=1.5, seed=7,
            stream=True)) as r:
        raw = b"".join(r.iter_raw())
    raw.decode("utf-8")  # strict
    lines = [ln for ln in raw.decode().split("\n")]
    payloads = sse_payloads(lines)
    assert all(isinstance(p["choices"][0]["text"], str) for p in payloads[:-2])
    json.dumps(payloads)


def test_stream_n_choices_and_batched_prompts(http):
    with http.stream("POST", "/v1/completions", json=body(
            prompt=["a = 1\n", "b = 2\n"], n=2, stream=True, seed=2**64 - 1,
            temperature=1.0)) as r:
        payloads = sse_payloads(r.iter_lines())
    finishes = {p["choices"][0]["index"]: p["choices"][0]["finish_reason"]
                for p in payloads[:-2] if p["choices"][0]["finish_reason"]}
    assert sorted(finishes) == [0, 1, 2, 3]  # 2 prompts x n=2, each finished once
    r = http.post("/v1/completions", json=body(prompt=[[1, 2, 3], [4, 5]], seed=-1))
    assert r.status_code == 200
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert r.json()["usage"]["prompt_tokens"] == 5
    r = http.post("/v1/completions", json=body(prompt="", max_tokens=2))
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1  # <|endoftext|>


def test_server_default_speculation(serve_checkpoints):
    """``--speculation`` is what a request without ``speculation`` gets; a bad default stops
    the server at start-up, not at the first request."""
    from starlette.testclient import TestClient

    from drafters.registry import SpeculationError

    settings = Settings(checkpoints=serve_checkpoints, speculation='{"method": "ngram"}')
    with TestClient(create_app(settings)) as c:
        r = c.post("/v1/completions", json=body(max_tokens=3))
        assert r.json()["speculation"]["method"] == "prompt_lookup"
        r = c.post("/v1/completions", json=body(max_tokens=3, speculation=None))
        assert r.json()["speculation"]["method"] == "prompt_lookup"
        r = c.post("/v1/completions", json=body(max_tokens=3, speculation="none"))
        assert r.json()["speculation"]["method"] == "none"
    with pytest.raises(SpeculationError):
        with TestClient(create_app(Settings(checkpoints=serve_checkpoints,
                                            speculation="warp_drive"))):
            pass


def test_engine_thread_mode_serves_what_the_engine_process_serves(serve_checkpoints, live):
    """``--engine-process false``: the engine on a thread of the API process, through the
    same client seam: the same tokens, figures and counters as the engine process."""
    requests = [body(max_tokens=24, speculation=m) for m in ("none", "prompt_lookup", "suffix")]
    requests.append(body(max_tokens=24, speculation="none", temperature=0.9, seed=5))
    settings = Settings(checkpoints=serve_checkpoints, threads=1, engine_process=False)
    with LiveServer(settings) as thread_server, \
            httpx.Client(base_url=thread_server.url, timeout=60) as c:
        for req in requests:
            here, there = c.post("/v1/completions", json=req), httpx.post(
                live.url + "/v1/completions", json=req, timeout=60)
            assert here.status_code == there.status_code == 200
            assert here.json()["choices"] == there.json()["choices"]
            if req["speculation"] != "suffix":  # suffix's store holds each server's past
                assert here.json()["speculation"] == there.json()["speculation"]
        assert metric(thread_server.url, "nodraft_generation_tokens_total") == 4 * 24
        assert c.get("/health").json() == {"status": "ok", "compiled": "off"}
