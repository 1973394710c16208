"""Hostile traffic: long prompts never stall the event loop, a burst is refused
at once with a measured Retry-After, slow and abandoned clients are cut off or counted
honestly, and the connection guards hold."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from server_testing import metric, wait_for

from nodraft.server.admission import MAX_RETRY_AFTER, Admission
from nodraft.server.app import INLINE_TEXT_BYTES, Service, create_app, uvicorn_config
from nodraft.server.errors import APIError
from nodraft.server.settings import Settings

SLOW = {"method": "slow", "delay": 0.02}
HEALTH_BOUND = 0.2  # s: /health answers within this under attack
GAP_BOUND = 0.3  # s: a running stream's largest gap between chunks under attack
REFUSAL_BOUND = 0.3  # s: the 99th percentile of a burst's 429s
POLL_GAP = 0.5  # s: the longest stretch of an attack without a /health request sent
REPEATING = "for i in range(10):\n    print(i)\n" * 4  # a stream that does not end early


def chat(content: str, **kw) -> dict:
    return {"model": "micro", "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, **kw}


def idle(live) -> bool:
    return (metric(live.url, "nodraft_requests_running") == 0
            and metric(live.url, "nodraft_requests_waiting") == 0
            and live.service.admission.in_flight == 0)


async def poll_health(client: httpx.AsyncClient, until: asyncio.Event,
                      sent: list[float] | None = None) -> list[float]:
    """/health's latency, asked every 20 ms until ``until`` is set; each request's send time
    is appended to ``sent`` when given."""
    latencies = []
    while not until.is_set():
        t = time.monotonic()
        if sent is not None:
            sent.append(t)
        r = await client.get("/health")
        latencies.append(time.monotonic() - t)
        assert r.status_code == 200
        await asyncio.sleep(0.02)
    return latencies


def test_short_texts_are_tokenised_on_the_loop_and_longer_ones_on_the_worker():
    """A prompt of at most INLINE_TEXT_BYTES is tokenised where the request is handled (the
    hop to the worker would cost more); a longer one on the text worker, off the loop."""
    service = Service(Settings())

    async def where(size: int) -> str:
        return await service.text_work(size, lambda: threading.current_thread().name)

    try:
        assert asyncio.run(where(INLINE_TEXT_BYTES)) == threading.current_thread().name
        assert asyncio.run(where(INLINE_TEXT_BYTES + 1)).startswith("nodraft-text")
    finally:
        service.text_worker.shutdown()


def test_long_prompts_do_not_stall_the_event_loop(live):
    """Eight ~1 MB chat prompts (over the prompt text limit: refused before any tokenising)
    and eight just under it (tokenised on the text worker, then refused by the context
    rule), all at once, twice, while a stream runs: /health answers within 0.2 s
    throughout, and the stream's largest gap between chunks stays under 0.3 s."""
    assert wait_for(lambda: idle(live), timeout=10)
    limit = live.service.max_prompt_bytes
    huge = json.dumps(chat("x" * 990_000)).encode()  # just under --max-body-bytes
    line = "total = sum(range(10))\n"
    near = json.dumps(chat(line * (limit // len(line)))).encode()  # under the text limit
    assert len(huge) < live.service.settings.max_body_bytes and len(near) > limit - len(line)
    headers = {"content-type": "application/json"}

    async def attack():
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
            arrivals: list[float] = []
            started, done = asyncio.Event(), asyncio.Event()

            async def stream():
                body = {"model": "micro", "prompt": REPEATING, "max_tokens": 400,
                        "temperature": 0, "stream": True, "speculation": SLOW}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for ln in r.aiter_lines():
                        if ln.startswith("data: "):
                            arrivals.append(time.monotonic())
                            started.set()
                        if done.is_set() and time.monotonic() - last_attack[0] > 0.5:
                            return  # the attack is over: close, the engine aborts it

            last_attack = [math.inf]
            sent: list[float] = []
            streamer = asyncio.create_task(stream())
            await asyncio.wait_for(started.wait(), 30)
            poller = asyncio.create_task(poll_health(client, done, sent))
            first = time.monotonic()
            replies = []
            for _ in range(2):
                batch = [client.post("/v1/chat/completions", content=b, headers=headers)
                         for b in [huge] * 8 + [near] * 8]
                replies += await asyncio.gather(*batch)
            last_attack[0] = time.monotonic()
            done.set()
            latencies = await poller
            await asyncio.wait_for(streamer, 30)
            return first, last_attack[0], replies, latencies, sent, arrivals

    first, last, replies, latencies, sent, arrivals = asyncio.run(attack())
    tokenised = 0
    for i, r in enumerate(replies):
        err = r.json()["error"]
        if i % 16 < 8:  # ~1 MB: refused by the text limit, never admitted nor tokenised
            assert r.status_code == 400 and err["code"] == "context_length_exceeded"
            assert "bytes" in err["message"], err["message"]
        elif r.status_code == 429:  # more at once than the capacity left beside the stream
            assert err["code"] == "server_busy"
        else:  # admitted, tokenised off the loop, then refused by the context rule
            assert r.status_code == 400 and err["code"] == "context_length_exceeded"
            assert "tokens" in err["message"] and "bytes" not in err["message"]
            tokenised += 1
    assert tokenised >= 8, "the near-limit prompts must reach the tokenizer"
    # polled throughout the attack (however long it took): no stretch of it without a request
    edges = [first, *sent, last]
    assert len(sent) >= 2 and max(b - a for a, b in zip(edges, edges[1:])) < POLL_GAP, edges
    assert max(latencies) < HEALTH_BOUND, sorted(latencies)[-5:]
    during = [t for t in arrivals if first - 0.5 <= t]
    assert arrivals[0] < first and arrivals[-1] > last, "the stream must span the attack"
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert max(gaps) < GAP_BOUND, sorted(gaps)[-5:]


def test_burst_is_refused_at_once(live):
    """Four times capacity at once: the requests that fit are served; every other gets a
    429 within 0.3 s (the 99th percentile), each with a Retry-After of at least 1 s;
    nothing is a 5xx, and /health answers within 0.2 s throughout."""
    assert wait_for(lambda: idle(live), timeout=10)
    capacity = live.service.admission.capacity
    body = {"model": "micro", "prompt": "import os\n", "max_tokens": 20, "temperature": 0,
            "speculation": {"method": "slow", "delay": 0.05}}

    async def burst():
        limits = httpx.Limits(max_connections=8 * capacity)
        async with httpx.AsyncClient(base_url=live.url, timeout=60, limits=limits) as client:
            done = asyncio.Event()
            poller = asyncio.create_task(poll_health(client, done))

            async def one():
                t = time.monotonic()
                r = await client.post("/v1/completions", json=body)
                return r, time.monotonic() - t

            results = await asyncio.gather(*[one() for _ in range(4 * capacity)])
            done.set()
            return results, await poller

    results, latencies = asyncio.run(burst())
    statuses = [r.status_code for r, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) == capacity, statuses
    refused = sorted(t for r, t in results if r.status_code == 429)
    p99 = refused[math.ceil(0.99 * len(refused)) - 1]
    assert p99 < REFUSAL_BOUND, refused[-5:]
    for r, _ in results:
        if r.status_code == 429:
            assert 1 <= int(r.headers["retry-after"]) <= MAX_RETRY_AFTER
            assert r.json()["error"]["type"] == "rate_limit_error"
    assert max(latencies) < HEALTH_BOUND, sorted(latencies)[-5:]
    assert wait_for(lambda: idle(live), timeout=10)


def test_retry_after_from_the_measured_drain_rate():
    """Retry-After = the sequences that must finish first / the measured finishing rate,
    within [1, MAX_RETRY_AFTER] s; with none finished lately, the span without one."""
    now = [100.0]
    a = Admission(capacity=4, clock=lambda: now[0])
    for rid in range(4):
        a.begin(rid, None, now[0])
    with pytest.raises(APIError) as e, a.reserve(1):
        pass
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"  # just started
    now[0] = 110.0
    assert a.retry_after(1) == 10  # nothing finished in 10 s: at least 10 more
    for rid in range(8):  # 8 finish (and 8 more start) over the next 8 s
        now[0] = 110.0 + rid
        a.observe(rid, _Finish())
        a.begin(100 + rid, None, now[0])
    now[0] = 120.0  # 8 finished in the 20 s since the start: 0.4 per second
    assert a.retry_after(1) == 3 and a.retry_after(2) == 5
    assert a.retry_after(1000) == MAX_RETRY_AFTER
    now[0] = 300.0  # none in the last 30 s (the window)
    assert a.retry_after(1) == 30
    assert a.in_flight == 4 and a.reserved == 0


def test_reservations_count_until_submitted():
    """A request being prepared holds its room: a second that would not fit beside it is
    refused, and the room is free again when the first is done (or fails)."""
    a = Admission(capacity=4)
    a.begin(1, None, 0.0)
    with a.reserve(3):
        assert a.reserved == 3
        with pytest.raises(APIError), a.reserve(1):
            pass
    with pytest.raises(RuntimeError), a.reserve(3):
        raise RuntimeError("tokenising failed")
    assert a.reserved == 0
    with a.reserve(3):
        pass


class _Finish:
    kind = "finish"


def test_drafters_are_imported_at_start(live):
    """No request imports a drafter's module on the event loop (EAGLE's took ~1.2 s)."""
    registry = live.service.registry
    assert set(registry.names()) <= set(registry._classes)


def test_abandoned_upload_counts_as_gone_not_as_an_error(live):
    """A client that stops half-way through its body is counted 499, not 500."""
    errors = metric(live.url, "nodraft_requests_total", status="500")
    gone = metric(live.url, "nodraft_requests_total", status="499")
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                  b"\r\ncontent-length: 1000\r\n\r\n" + b'{"model": "micro", "prompt": "')
        time.sleep(0.2)
    assert wait_for(lambda: metric(live.url, "nodraft_requests_total", status="499")
                    == gone + 1)
    assert metric(live.url, "nodraft_requests_total", status="500") == errors


# -- the connection guards, on a server with no engine (they act before any route) ---------
class Guarded:
    """``create_app`` served with ``nodraft serve``'s uvicorn configuration, lifespan off
    (nothing loaded: the guards and the body reader act before any route does)."""

    def __init__(self, settings: Settings):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(create_app(settings), settings, lifespan="off",
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> "Guarded":
        self.thread.start()
        assert wait_for(lambda: self.server.started, timeout=10)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)


def read_all(s: socket.socket) -> tuple[bytes, float]:
    """Everything until the server closes the connection, and how long that took."""
    t, data = time.monotonic(), b""
    while chunk := s.recv(65536):
        data += chunk
    return data, time.monotonic() - t


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_slow_headers_and_bodies_are_cut_off(serve_checkpoints, parser):
    settings = Settings(checkpoints=serve_checkpoints, header_timeout_seconds=0.4,
                        body_timeout_seconds=0.4, http_parser=parser)
    with Guarded(settings) as g:
        with g.connect() as s:  # headers trickling in
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
            data, took = read_all(s)
        assert data.startswith(b"HTTP/1.1 408 ") and 0.3 < took < 2, (data, took)
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        with g.connect() as s:  # a connection that never says anything
            assert read_all(s)[0].startswith(b"HTTP/1.1 408 ")
        with g.connect() as s:  # a keep-alive connection: the next request's headers too
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            time.sleep(0.1)
            s.sendall(b"GET /health HTTP/1.1\r\n")
            data, _ = read_all(s)
        assert data.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 408 " in data
        with g.connect() as s:  # two requests pipelined: both answered, then a third awaited
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n" * 2)
            data, took = read_all(s)
        assert data.count(b"HTTP/1.1 200 ") == 2 and b"HTTP/1.1 408 " in data, data
        assert 0.3 < took < 2
        with g.connect() as s:  # a body that stops arriving
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                      b"application/json\r\ncontent-length: 100\r\n\r\n{\"model\"")
            data, took = read_all(s)
        assert data.startswith(b"HTTP/1.1 408 ") and took < 2, data
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        # a prompt client is untouched
        assert httpx.get(g.url + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_connections_beyond_the_cap_get_503(serve_checkpoints, parser):
    settings = Settings(checkpoints=serve_checkpoints, max_connections=3,
                        header_timeout_seconds=30, http_parser=parser)
    with Guarded(settings) as g:
        held = [g.connect() for _ in range(3)]
        try:
            time.sleep(0.1)
            r = httpx.get(g.url + "/health", timeout=5)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "too_many_connections"
        finally:
            for s in held:
                s.close()
        assert wait_for(lambda: httpx.get(g.url + "/health", timeout=5).status_code == 200)


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_oversized_headers_are_refused_and_the_server_goes_on(serve_checkpoints, parser):
    """A request line and headers over 16 KiB get an OpenAI 431 and the connection is
    closed, whether they arrive whole or in pieces; a head within the limit, and a body
    larger than it, are served."""
    settings = Settings(checkpoints=serve_checkpoints, http_parser=parser)
    big = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20_000
    with Guarded(settings) as g:
        for pieces in ([big + b"\r\n\r\n"], [big[:9000], big[9000:], b"\r\n\r\n"]):
            with g.connect() as s:
                for piece in pieces:
                    s.sendall(piece)
                    time.sleep(0.05)
                data, took = read_all(s)
            assert data.startswith(b"HTTP/1.1 431 "), data[:200]
            body = json.loads(data.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == "headers_too_large" and took < 2
        r = httpx.get(g.url + "/health", headers={"x-big": "a" * 12_000}, timeout=5)
        assert r.status_code == 200
        # a body past 16 KiB is no head: it reaches the route (an error for its content),
        # sent after a head with CRLF line ends or bare LFs, in the head's piece
        r = httpx.post(g.url + "/v1/completions", json={"model": "nope", "prompt": "a" * 40_000},
                       timeout=5)
        assert r.status_code != 431 and r.status_code < 500, r.text[:200]
        body = json.dumps({"model": "nope", "prompt": "a" * 40_000}).encode()
        with g.connect() as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\nhost: x\ncontent-type: application/json"
                      b"\nconnection: close\ncontent-length: %d\n\n" % len(body) + body)
            data, _ = read_all(s)
        assert data.startswith(b"HTTP/1.1 4") and not data.startswith(b"HTTP/1.1 431"), data[:80]
