"""The HTTP surface with a raw client: SSE framing, errors, limits, auth, disconnects."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
from server_testing import MAX_RUNNING, MAX_WAITING, LiveServer, metric, sse_payloads, wait_for

from nodraft.server.app import create_app
from nodraft.server.settings import Settings

SLOW = {"method": "slow", "delay": 0.05}


def body(**kw) -> dict:
    return {"model": "micro", "prompt": "import os\n", "max_tokens": 4, "temperature": 0, **kw}


def post_json(http: httpx.Client, path: str, payload, **headers: str) -> httpx.Response:
    """POST ``payload`` (bytes as they are, else JSON with ASCII escapes, so that a lone
    surrogate travels as ``\\ud800``, as a client in any language can send it)."""
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return http.post(path, content=content,
                     headers={"content-type": "application/json", **headers})


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
    (body(stop=[str(i) for i in range(17)]), 400, "stop"),
    (body(speculation="warp_drive"), 400, "speculation.method"),
    (body(speculation={"method": "early_exit", "exit_layer": 9}), 400, "speculation"),
    (body(speculation={"method": "early_exit", "draft_vocab": 99999}), 400,
     "speculation.draft_vocab"),  # more ids than the model's vocabulary
    (body(speculation={"method": "early_exit", "draft_vocab": -1}), 400, "speculation"),
    (body(speculation={"method": "prompt_lookup", "bogus": 1}), 400, "speculation.bogus"),
    (body(speculation=[1]), 400, "speculation"),
    (body(logprobs=21), 400, "logprobs"),  # at most 20 alternatives
    (body(logprobs=True), 400, "logprobs"),  # completions take an integer (chat: a boolean)
    (body(echo="yes"), 400, "echo"),
    (body(best_of=3), 400, "best_of"),
    (body(presence_penalty=0.5), 400, "presence_penalty"),
    (body(logit_bias={"1": 5}), 400, "logit_bias"),
    (body(flavour="vanilla"), 400, "flavour"),
    (body(stream_options={"include_usage": True}), 400, "stream_options"),
    (b'', 400, None),
    # strict JSON types, as OpenAI's
    (body(max_tokens=True), 400, "max_tokens"),
    (body(max_tokens="16"), 400, "max_tokens"),
    (body(max_tokens=16.0), 400, "max_tokens"),
    (body(temperature=True), 400, "temperature"),
    (body(temperature="0.5"), 400, "temperature"),
    (body(stream="yes"), 400, "stream"),
    (body(stream="true"), 400, "stream"),
    (body(stream=1), 400, "stream"),
    (body(n="2"), 400, "n"),
    (body(seed="1"), 400, "seed"),
    (body(prompt=[True, False]), 400, "prompt"),
    (body(stream_options={"include_usage": 1}, stream=True), 400, "stream_options.include_usage"),
    # lone surrogates anywhere, keys included
    (body(speculation={"method": "none", "\ud800": 1}), 400, "speculation"),
    (body(speculation={"method": "none", "x": "\ud800"}), 400, "speculation.x"),
    (body(speculation="\udfff"), 400, "speculation"),
    (body(prompt="a\ud800b"), 400, "prompt"),
    (body(prompt=["ok", "\ud800"]), 400, "prompt.1"),
    (body(stop=["\ud800"]), 400, "stop.0"),
    (body(user="\ud800"), 400, "user"),
    (body(model="\ud800"), 400, "model"),
    ({**body(), "\ud800": 1}, 400, None),
    # odd keys, limits
    ({**body(), "foo-bar": 1}, 400, "foo-bar"),
    ({**body(), "": 1}, 400, None),
    (body(stop="x" * 257), 400, "stop"),
    (body(prompt="x" * 50_000), 400, "prompt"),  # over the text limit: never tokenised
    (b"[" * 5000 + b"]" * 5000, 400, None),
]


@pytest.mark.parametrize("payload,status,param", BAD)
def test_bad_completion_requests(http, payload, status, param):
    r = post_json(http, "/v1/completions", payload)
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
    ({"model": "micro", "messages": [{"role": "user", "content": []}]}, "messages.0.content"),
    ({"model": "micro", "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages.0.content.0.type"),
    ({"model": "micro", "messages": [{"role": "user", "content": "x", "name": 7}]},
     "messages.0.name"),
    ({"model": "micro", "messages": [{"role": "user", "content": "x", "foo-bar": 1}]},
     "messages.0.foo-bar"),
    ({"model": "micro", "messages": [{"role": "user", "content": "\udc00"}]},
     "messages.0.content"),
    ({"model": "micro", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a", "\ud83d": 1}]}]}, "messages.0.content.0"),
    ({"model": "micro", "messages": [{"role": "user", "content": "x" * 990_000}]},
     "messages"),  # ~1 MB: over the text limit, never tokenised
    ({"model": "micro", "messages": [{"role": "user", "content": "hi"}], "max_tokens": True},
     "max_tokens"),
    ({"model": "micro", "messages": [{"role": "user", "content": "hi"}], "logprobs": 3},
     "logprobs"),  # chat takes a boolean
    ({"model": "micro", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
      "top_logprobs": 21}, "top_logprobs"),
    ({"model": "micro", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs"),  # without logprobs: true
    ({"model": "micro", "messages": [{"role": "user", "content": "hi"}], "echo": True},
     "echo"),  # completions only, as OpenAI
])
def test_bad_chat_requests(http, payload, param):
    r = post_json(http, "/v1/chat/completions", payload)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_error_messages_name_what_is_wrong(live, http):
    r = post_json(http, "/v1/completions", {**body(), "foo-bar": 1})
    assert r.json()["error"]["message"] == "unrecognized request argument: foo-bar"
    r = post_json(http, "/v1/completions", body(speculation={"method": "none", "\ud800": 1}))
    assert "lone surrogate" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "invalid_unicode"
    r = post_json(http, "/v1/completions", body(max_tokens="16"))
    assert r.json()["error"]["message"] == ("max_tokens: Input should be a valid integer "
                                            "(got a string)")
    limit = live.service.max_prompt_bytes
    assert limit == 1023 * live.service.longest_token_bytes
    r = post_json(http, "/v1/completions", body(prompt="é" * (limit // 2 + 1)))
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert f"at most {limit} bytes" in r.json()["error"]["message"]
    # a text within the limit is tokenised, then held to the context rule
    r = post_json(http, "/v1/completions", body(prompt="x = 1\n" * (limit // 7)))
    assert "tokens" in r.json()["error"]["message"] and "bytes" not in r.json()["error"]["message"]
    for headers in ({}, {"content-type": "text/plain"}):
        r = http.post("/v1/completions", content=json.dumps(body()).encode(), headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_type"
        assert "Content-Type: application/json" in r.json()["error"]["message"]
    r = post_json(http, "/v1/completions", b"[" * 5000 + b"]" * 5000)
    assert "nested too deeply" in r.json()["error"]["message"]


def test_valid_generation_requests_skip_fastapis_routing_and_the_rest_go_to_it(live, http,
                                                                              monkeypatch):
    """``DirectGeneration`` serves a generation request whose body validates -- FastAPI's
    route for it never runs -- and hands any other (bad JSON, a body the model rejects, no
    JSON ``Content-Type``) to FastAPI, whose error it is; an error the route itself raises
    on the direct path is rendered as FastAPI's handlers render it."""
    import fastapi.routing

    reached: list[str] = []
    solve = fastapi.routing.solve_dependencies

    async def counted(*, request, **kw):  # every FastAPI route's handler solves its parameters
        reached.append(request.url.path)
        return await solve(request=request, **kw)
    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counted)
    chat = {"model": "micro", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert http.post("/v1/completions", json=body()).status_code == 200
    assert http.post("/v1/completions", json=body(stream=True)).status_code == 200
    r = http.post("/v1/chat/completions", json=chat,
                  headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    r = http.post("/v1/completions", json=body(model="nope"))  # the route's own 404
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert reached == []
    assert post_json(http, "/v1/completions", body(max_tokens="4")).status_code == 400
    r = http.post("/v1/completions", content=json.dumps(body()).encode(),
                  headers={"content-type": "text/plain"})
    assert r.json()["error"]["code"] == "invalid_content_type"
    assert reached == ["/v1/completions", "/v1/completions"]
    r = post_json(http, "/v1/chat/completions", b"{not json")  # FastAPI's, before its handler
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


def test_a_body_not_read_whole_goes_to_fastapi_as_it_came():
    """``DirectGeneration`` acts only on a body read whole (``BodyLimit`` reads it so): the
    first part of one sent in parts is handed on with the rest, even where that part alone
    would be a valid request."""
    import asyncio

    from nodraft.server.app import DirectGeneration

    parts = [{"type": "http.request", "body": json.dumps(body()).encode(), "more_body": True},
             {"type": "http.request", "body": b" ", "more_body": False}]
    sent, got = list(parts), []

    async def receive():
        return sent.pop(0)

    async def app(scope, receive, send):
        got.extend([await receive(), await receive()])

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "",
             "headers": [(b"content-type", b"application/json")]}
    asyncio.run(DirectGeneration(app)(scope, receive, None))
    assert got == parts


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
    for path in ("/health", "/ready"):  # probes that send HEAD
        r = http.head(path)
        assert r.status_code == 200 and r.content == b""
    models = http.get("/v1/models").json()["data"]
    assert {m["id"] for m in models} == {"micro", "micro-layerskip"}
    assert "prompt_lookup" in models[0]["speculation_methods"]
    one = http.get("/v1/models/micro-layerskip")
    assert one.status_code == 200 and one.json() == next(
        m for m in models if m["id"] == "micro-layerskip")
    for missing in ("gpt-4", "org/micro", "micro%20"):
        r = http.get(f"/v1/models/{missing}")
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["type"] == "not_found_error"


def test_chat_name_accepted_and_not_rendered(http):
    """``name`` is accepted (OpenAI's clients send it) and not rendered: the prompt is the
    same tokens as without it."""
    def chat(**message):
        return post_json(http, "/v1/chat/completions", {
            "model": "micro", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": "hello", **message}]})
    named, plain = chat(name="alice"), chat()
    assert named.status_code == plain.status_code == 200, named.text
    assert named.json()["usage"] == plain.json()["usage"]
    assert named.json()["choices"] == plain.json()["choices"]


def test_chat_default_max_tokens(live, http, monkeypatch):
    """Chat without max_tokens: at most --chat-max-tokens-default tokens per choice."""
    monkeypatch.setattr(live.service.settings, "chat_max_tokens_default", 3)
    r = post_json(http, "/v1/chat/completions", {
        "model": "micro", "n": 4, "temperature": 1.0, "seed": 1, "speculation": "none",
        "messages": [{"role": "user", "content": "count: 1 2 3 4 5 6 7 8 9"}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 4 * 3
    assert {c["finish_reason"] for c in r.json()["choices"]} <= {"length", "stop"}


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
    for given in ("Basic sekrit", "sekrit", "Bearer", "Bearer sekrit2", "Bearersekrit"):
        assert c.get("/v1/models", headers={"Authorization": given}).status_code == 401, given
    for scheme in ("bearer", "BEARER", "BeArEr"):  # the scheme is case-insensitive
        r = c.get("/v1/models", headers={"Authorization": f"{scheme} sekrit"})
        assert r.status_code == 200, scheme
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
        assert int(full.headers["retry-after"]) >= 1  # measured: server.admission
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

    from nodraft.drafters.registry import SpeculationError

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


def counted(spec: dict) -> dict:
    """A response's figures but those timed on the machine (they differ run to run)."""
    timed = {"plain_seconds", "verify_seconds", "draft_seconds", "measured_cost_speedup"}
    return {k: v for k, v in spec.items() if k not in timed}


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
                assert counted(here.json()["speculation"]) == counted(there.json()["speculation"])
        assert metric(thread_server.url, "nodraft_generation_tokens_total") == 4 * 24
        assert c.get("/health").json() == {"status": "ok", "compiled": "off"}
