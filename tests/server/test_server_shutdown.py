"""Faults and shutdown, on a real ``serve`` process and its engine process: SIGTERM drains
both, a drain that runs out of time cancels cleanly, an engine killed mid-stream fails every
request at once and takes the server down with exit code 1, and an engine never outlives
its server."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_testing import (LiveServer, alive, free_port, registry_with_slow, sse_payloads,
                            wait_for, wait_healthy)

from nodraft.server.settings import Settings

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def stream_request(max_tokens: int, delay: float) -> dict:  # the slow test drafter's
    return {"model": "micro", "prompt": "import sys\n", "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "speculation": {"method": "slow", "delay": delay}}


@pytest.fixture()
def server_process(serve_checkpoints):
    port = free_port()
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        from server_testing import registry_with_slow
        from nodraft.server.app import serve
        from nodraft.server.settings import Settings
        serve(Settings(port={port}, checkpoints={str(serve_checkpoints)!r}, drain_seconds=20,
                       log_level="warning"), registry_with_slow())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    engine = None
    try:
        wait_healthy(url, 120, lambda: proc.poll() is None)
        engine = engine_pid(proc.pid)
        yield proc, url, engine
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if engine is not None and alive(engine):  # never leave one behind, whatever failed
            os.kill(engine, signal.SIGKILL)


def engine_pid(server_pid: int) -> int:
    """The server's engine process: its one child started by multiprocessing's spawn (the
    other is multiprocessing's resource tracker)."""
    children = [int(c) for task in Path(f"/proc/{server_pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
    engines = [c for c in children
               if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(engines) == 1, children
    return engines[0]


def server_output(proc) -> str:
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=30)
    return f"server exit {proc.returncode}, output:\n{out}"


def test_sigterm_drains_in_flight_stream(server_process):
    proc, url, engine = server_process
    try:
        with httpx.Client(base_url=url, timeout=30) as client, \
                client.stream("POST", "/v1/completions", json=stream_request(60, 0.03)) as r:
            lines = r.iter_lines()
            first = next(lines)
            assert first.startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            with httpx.Client(base_url=url, timeout=5) as other:
                assert wait_for(lambda: other.get("/ready").status_code == 503)
                assert other.get("/health").status_code == 200
                refused = other.post("/v1/completions", json={"model": "micro", "prompt": "x"})
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "shutting_down"
            payloads = sse_payloads([first, *lines])
    except Exception as e:  # say what the server said (its log, its exit) with the failure
        raise AssertionError(server_output(proc)) from e
    assert payloads[-1] == "[DONE]"
    assert "speculation" in payloads[-2]
    finish = [p["choices"][0]["finish_reason"] for p in payloads[:-2]
              if p["choices"][0]["finish_reason"]]
    assert finish in (["length"], ["stop"])  # it ran to its end, not cut
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert wait_for(lambda: not alive(engine), timeout=10), "the engine outlived the drain"


def test_a_killed_engine_fails_every_request_at_once_and_the_server_exits_1(server_process):
    proc, url, engine = server_process
    try:
        with httpx.Client(base_url=url, timeout=30) as client, \
                concurrent.futures.ThreadPoolExecutor(1) as pool, \
                client.stream("POST", "/v1/completions", json=stream_request(400, 0.05)) as r:
            plain = pool.submit(client.post, "/v1/completions", json={
                **stream_request(400, 0.05), "stream": False})
            lines = r.iter_lines()
            first = next(lines)
            assert wait_for(lambda: httpx.get(url + "/metrics").text.count(
                "nodraft_requests_running 2.0") == 1, timeout=10)
            os.kill(engine, signal.SIGKILL)
            t0 = time.monotonic()
            payloads = sse_payloads([first, *lines])
            ended = time.monotonic() - t0
            answer = plain.result(timeout=10)
    except Exception as e:
        raise AssertionError(server_output(proc)) from e
    assert ended < 5, f"the stream took {ended:.1f} s to end after the engine died"
    error = payloads[-2]["error"]  # an OpenAI error event, then [DONE]
    assert payloads[-1] == "[DONE]" and "engine process exited" in error["message"]
    assert "signal 9" in error["message"] and error["code"] == "generation_failed"
    assert answer.status_code == 500
    assert "engine process exited" in answer.json()["error"]["message"]
    # /health stops answering 200 (503 while it shuts down, then nothing), and it exits 1
    try:
        assert httpx.get(url + "/health", timeout=5).status_code == 503
    except httpx.TransportError:
        pass
    assert proc.wait(timeout=30) == 1, server_output(proc)
    assert "the engine process exited (killed by signal 9)" in proc.communicate()[0]


def test_the_engine_dies_with_its_server(server_process):
    """SIGKILL leaves the server no time to stop its engine: the engine goes by itself."""
    proc, url, engine = server_process
    assert alive(engine)
    proc.kill()
    proc.wait(timeout=10)
    assert wait_for(lambda: not alive(engine), timeout=10), "the engine outlived its server"


def test_drain_past_its_grace_period_cancels_cleanly(serve_checkpoints):
    """A drain that runs out of time cancels what is left; the stream still ends with its
    figures and [DONE]."""
    settings = Settings(checkpoints=serve_checkpoints, max_running=2, max_waiting=2)
    with LiveServer(settings, registry_with_slow()) as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=stream_request(500, 0.05)) as r:
            lines = r.iter_lines()
            first = next(lines)
            drainer = threading.Thread(target=server.service.drain_from_thread, args=(0.3,))
            drainer.start()
            payloads = sse_payloads([first, *lines])
            drainer.join(timeout=10)
        assert payloads[-1] == "[DONE]"
        assert payloads[-3]["choices"][0]["finish_reason"] == "cancelled"
        assert payloads[-2]["speculation"]["target_passes"] >= 1
        assert client.get("/ready").status_code == 503
        assert client.post("/v1/completions", json={"model": "micro", "prompt": "x"}
                           ).status_code == 503
