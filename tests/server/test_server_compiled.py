"""The server with compiled passes (``--compile true``, the default outside the tests): its
engine process serves while the graphs compile in the background, /health says so, and once
they are ready it answers greedy requests with the same tokens as the eager server. It
serves micro-layerskip alone (its trained exits make early exit's graphs matter): the
warm-up compiles a model's graphs the same way for each. (What the warm-up readies, graph
by graph, is tested on the engine itself: tests/engine.)"""

import time
from pathlib import Path

import httpx
from server_testing import LiveServer

from server.settings import Settings

METHODS = ["none", "prompt_lookup", "suffix", {"method": "early_exit", "exit_layer": 2},
           "eagle", "auto"]
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return"


def _complete(url: str, speculation) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": "micro-layerskip", "prompt": PROMPT, "max_tokens": 24,
                         "temperature": 0, "speculation": speculation})
    assert r.status_code == 200, r.text
    return r.json()


def one_model(checkpoints: Path, name: str, into: Path) -> Path:
    """A checkpoint folder with ``name`` alone (its weights, record and drafter heads) and
    the tokenizer, linked to ``checkpoints``'s files."""
    into.mkdir()
    for f in checkpoints.iterdir():
        if f.name == "tokenizer.json" or f.name.startswith(f"{name}.") or (
                f.name.startswith(f"{name}-") and f.suffix in (".safetensors", ".json")):
            (into / f.name).symlink_to(f)
    return into


def test_compiled_server_serves_while_warming_then_matches_eager(serve_checkpoints, live,
                                                                 tmp_path):
    checkpoints = one_model(serve_checkpoints, "micro-layerskip", tmp_path / "checkpoints")
    settings = Settings(checkpoints=checkpoints, threads=1, compile=True)
    with LiveServer(settings) as server:
        first = httpx.get(server.url + "/health").json()
        served = httpx.get(server.url + "/v1/models").json()["data"]
        assert [m["id"] for m in served] == ["micro-layerskip"]
        assert first["compiled"] in ("warming", "ready")
        early = _complete(server.url, "none")  # served at once, eager or compiled
        end = time.monotonic() + 600
        while httpx.get(server.url + "/health").json()["compiled"] != "ready":
            assert time.monotonic() < end, "compiled passes not ready after 600 s"
            time.sleep(0.5)
        for speculation in METHODS:
            got = _complete(server.url, speculation)
            want = _complete(live.url, speculation)
            assert got["choices"][0]["text"] == want["choices"][0]["text"], speculation
        assert early["choices"][0]["text"] == _complete(live.url, "none")["choices"][0]["text"]
    assert httpx.get(live.url + "/health").json()["compiled"] == "off"
