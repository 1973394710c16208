"""Draining: SIGTERM to a real server process mid-stream, and a drain that runs out of time."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest
from server_testing import (LiveServer, free_port, registry_with_slow, sse_payloads, wait_for,
                            wait_healthy)

from server.settings import Settings

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def stream_request(max_tokens: int, delay: float) -> dict:
    return {"model": "micro", "prompt": "import sys\n", "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "speculation": {"method": "slow", "delay": delay}}


@pytest.fixture()
def server_process(serve_checkpoints):
    port = free_port()
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        from server_testing import registry_with_slow
        from server.app import serve
        from server.settings import Settings
        serve(Settings(port={port}, checkpoints={str(serve_checkpoints)!r}, drain_seconds=20,
                       log_level="warning"), registry_with_slow())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 120, lambda: proc.poll() is None)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_sigterm_drains_in_flight_stream(server_process):
    proc, url = server_process
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
        proc.kill()
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"server exit {proc.returncode}, output:\n{out}") from e
    assert payloads[-1] == "[DONE]"
    assert "speculation" in payloads[-2]
    finish = [p["choices"][0]["finish_reason"] for p in payloads[:-2]
              if p["choices"][0]["finish_reason"]]
    assert finish in (["length"], ["stop"])  # it ran to its end, not cut
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out


def test_drain_past_its_grace_period_cancels_cleanly(serve_checkpoints):
    """A drain that runs out of time cancels what is left; the stream still ends with its
    figures and [DONE]."""
    settings = Settings(checkpoints=serve_checkpoints, max_running=2, max_waiting=2)
    with LiveServer(settings, registry_with_slow()) as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=stream_request(500, 0.05)) as r:
            lines = r.iter_lines()
            first = next(lines)
            drainer = threading.Thread(target=server.service.drain, args=(0.3,))
            drainer.start()
            payloads = sse_payloads([first, *lines])
            drainer.join(timeout=10)
        assert payloads[-1] == "[DONE]"
        assert payloads[-3]["choices"][0]["finish_reason"] == "cancelled"
        assert payloads[-2]["speculation"]["target_passes"] >= 1
        assert client.get("/ready").status_code == 503
        assert client.post("/v1/completions", json={"model": "micro", "prompt": "x"}
                           ).status_code == 503
