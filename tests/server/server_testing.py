"""Helpers for the server tests: checkpoints, a live server on loopback, metrics, SSE.

Importable from the tests (pytest puts this folder on ``sys.path``) and from the
subprocess that the SIGTERM test starts.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from nodraft.drafters.base import Draft, DraftContext
from nodraft.drafters.registry import DrafterEnv, Registry
from nodraft.micro.checkpoint import CHECKPOINT_DIR, MODEL_NAMES, available_models, save_model
from nodraft.micro.model import Micro, MicroConfig
from nodraft.server.app import create_app, uvicorn_config
from nodraft.server.settings import Settings
from tests.ports import free_port  # noqa: F401  (the server tests import it from here)

MAX_RUNNING, MAX_WAITING = 4, 4  # the session server's admission limits


class SlowDraft:
    """A test drafter: proposes nothing, and pauses after every step (``observe`` runs every
    step, even when the batching scheduler does not ask for a draft), so that a sequence is
    still running when a test disconnects, fills the queue or sends SIGTERM."""

    name = "slow"

    @dataclass(frozen=True)
    class Params:
        delay: float = 0.05

    def __init__(self, params: Params, env: DrafterEnv):
        self.params = params

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        return Draft.empty()

    def observe(self, ctx: DraftContext, accepted: list[int]) -> None:
        time.sleep(self.params.delay)


def registry_with_slow() -> Registry:
    """The built-in drafters plus ``slow``."""
    registry = Registry()
    registry.register("slow", SlowDraft)
    return registry


def serving_checkpoints(tmp: Path) -> Path:
    """The trained checkpoints when both exist; else a random-weight pair written to
    ``tmp`` (same shapes, so the server is exercised the same way, in a second)."""
    if set(available_models(CHECKPOINT_DIR)) == set(MODEL_NAMES):
        return CHECKPOINT_DIR
    tmp.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(MODEL_NAMES):
        torch.manual_seed(seed)
        save_model(Micro(MicroConfig()), name, {"note": "random weights for the server tests"},
                   tmp)
    shutil.copy(CHECKPOINT_DIR / "tokenizer.json", tmp / "tokenizer.json")
    return tmp


class LiveServer:
    """uvicorn serving ``create_app(settings)`` in a background thread, on loopback, with
    ``nodraft serve``'s own uvicorn configuration (``server.app.uvicorn_config``)."""

    def __init__(self, settings: Settings, registry: Registry | None = None):
        self.app = create_app(settings, registry)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn_config(self.app, settings, log_level="warning",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    @property
    def service(self):
        return self.app.state.service

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        wait_healthy(self.url, 60, lambda: self.thread.is_alive())
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def wait_healthy(url: str, timeout: float, alive=lambda: True) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not alive():
            raise RuntimeError("the server stopped while starting")
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def metrics(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics: (name, labels) -> value."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of ``name`` over the samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in metrics(url).items() if n == name and want <= ls)


def wait_for(condition, timeout: float = 5.0, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(step)
    return condition()


def sse_payloads(lines) -> list:
    """The ``data:`` payloads of an SSE stream (JSON decoded, ``[DONE]`` kept as a string),
    checking the framing: every event is ``data: ...`` lines ended by a blank line."""
    payloads, pending = [], None
    for line in lines:
        if line.startswith(":"):  # comment (keep-alive ping)
            continue
        if line == "":
            if pending is not None:
                payloads.append(pending)
            pending = None
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        assert pending is None, "one data line per event expected"
        data = line[len("data: "):]
        pending = data if data == "[DONE]" else json.loads(data)
    assert pending is None, "the stream ended inside an event"
    return payloads


# -- fixtures shared by the test folders that need a live server -----------------------------
@pytest.fixture(scope="session")
def serve_checkpoints(tmp_path_factory) -> Path:
    return serving_checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def live(serve_checkpoints) -> LiveServer:
    """A server with default limits and one engine thread (the server tests override it)."""
    with LiveServer(Settings(checkpoints=serve_checkpoints, threads=1)) as server:
        yield server
