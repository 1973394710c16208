"""The application: ``create_app(settings)`` builds it, ``main(argv)`` serves it (uvicorn).

    nodraft serve [--host 127.0.0.1] [--port 8000] [--speculation METHOD] [--api-key KEY]
                  [--max-running N] [--max-waiting N] [--max-body-bytes N]
                  [--cors-origins A,B] [--checkpoints DIR] [--drain-seconds S] [--threads N]

The lifespan reads the checkpoints in ``--checkpoints`` (micro and micro-layerskip: their
configs, not their weights), the tokenizer and the drafter registry into a ``Service`` on
``app.state.service``, and starts the engine: by default a process of its own
(``engine.client.MPClient``), which alone loads and runs the models; with
``--engine-process false`` a thread of this process. On a machine with two or more cores
``nodraft serve`` gives the engine process every core but the last and keeps the last for
this one (``Settings.cores``). ``/`` serves the playground page (plain HTML/JS/CSS from
``server/static``, nothing from outside). Around the routes (``server.api``):

- ``--api-key``: ``/v1/*`` needs ``Authorization: Bearer KEY`` (else 401); ``/health``,
  ``/ready`` and ``/metrics`` stay open for probes and Prometheus.
- ``--max-body-bytes``: larger bodies get a 413. CORS is off unless ``--cors-origins``.
- Every error is an OpenAI error body (``server.errors``); generation requests are counted
  in ``nodraft_requests_total{endpoint,method,status}``.
- SIGTERM (or Ctrl-C) drains: ``/ready`` and new requests answer 503, in-flight requests
  run to their end for up to ``--drain-seconds``, then whatever is left is cancelled (its
  stream ends cleanly, finish reason ``cancelled``), the engine process is stopped and the
  server exits 0. A second signal exits at once.
- If the engine process dies, every request in flight ends at once with an error (an SSE
  error event, or a 500 body), ``/health`` and ``/ready`` answer 503, and ``nodraft serve``
  exits 1 so that its supervisor (Docker, Kubernetes, systemd) starts it again.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import sys
import threading
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Callable

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from drafters.registry import Registry, SpeculationError
from engine.client import EngineClient, EventPump, InprocClient, MPClient
from engine.core import EngineStopped, QueueFull
from engine.process import EngineConfig
from micro.checkpoint import available_models, load_config, load_tokenizer
from micro.model import MicroConfig
from server.api import router
from server.errors import APIError, error_response, handle_exception
from server.metrics import Metrics
from server.settings import Settings

log = logging.getLogger("nodraft.server")

GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
GRACEFUL_SHUTDOWN_SECONDS = 5  # after draining: for responses still being written
STATIC = Path(__file__).parent / "static"  # the playground page (issue 9)


class Service:
    """What the routes use: model configs, tokenizer, drafter registry, engine client,
    metrics. The API process holds no weights: the engine (its own process by default)
    loads them."""

    def __init__(self, settings: Settings, registry: Registry | None = None):
        self.settings = settings
        self.registry = registry or Registry()
        self.metrics = Metrics()
        self.models: dict[str, MicroConfig] = {}
        self.created: dict[str, int] = {}
        self.tokenizer = None
        self.client: EngineClient | None = None
        self.context = 0
        self.draining = False
        self.checkpoint_dir = Path(self.settings.checkpoints)
        self.on_fatal: Callable[[], None] | None = None  # the engine died: exit non-zero
        self.loop: asyncio.AbstractEventLoop | None = None
        # decided before ``serve`` pins this process, which would change the answer
        self.engine_threads = settings.engine_threads
        self.engine_cores, self.api_cores = settings.cores()

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        directory = self.checkpoint_dir = Path(self.settings.checkpoints)
        names = available_models(directory)
        if not names:
            raise RuntimeError(f"no checkpoint in {directory} (micro.safetensors, "
                               "micro-layerskip.safetensors): train them or pass --checkpoints")
        tokenizer_json = directory / "tokenizer.json"
        self.tokenizer = load_tokenizer(tokenizer_json if tokenizer_json.exists() else None)
        self.models = {name: load_config(name, directory) for name in names}
        self.created = {name: int((directory / f"{name}.safetensors").stat().st_mtime)
                        for name in names}
        self.context = min(c.max_positions for c in self.models.values())
        self.registry.parse(self.settings.speculation)  # a bad default fails at start-up
        config = EngineConfig(str(directory), self.registry.targets(),
                              self.settings.max_running, self.settings.max_waiting,
                              self.engine_threads, self.settings.compile,
                              self.settings.gemm, self.engine_cores, self.settings.log_level)
        kind = MPClient if self.settings.engine_process else InprocClient
        self.client = kind(config, self.metrics)
        self.client.on_death = self._engine_died
        await self.client.start()
        where = (f"an engine process (pid {self.client.pid})" if self.settings.engine_process
                 else "an engine thread")
        log.info("nodraft: serving %s from %s on %s", ", ".join(names), directory, where)

    def _engine_died(self, reason: str) -> None:
        log.error("nodraft: %s; every request in flight has failed, and the server exits "
                  "so that it can be restarted", reason)
        if self.on_fatal is not None:
            self.on_fatal()

    @property
    def ready(self) -> bool:
        return self.client is not None and self.client.alive and not self.draining

    @property
    def status(self) -> str:
        if self.client is not None and not self.client.alive:
            return "engine_dead"
        return "draining" if self.draining else "ready" if self.client else "loading"

    async def drain(self, timeout: float) -> bool:
        """Take no new requests; let in-flight ones finish for up to ``timeout`` s, then
        cancel the rest (their streams end, ``cancelled``). True if everything finished."""
        self.draining = True
        if self.client is None:
            return True
        finished = await self.client.drain(timeout)
        if not finished:
            log.warning("nodraft: drain timed out after %.1f s; cancelling the rest", timeout)
            await self.client.shutdown()
        return finished

    def drain_from_thread(self, timeout: float) -> bool:
        """``drain``, from a thread other than the event loop's (a signal's drainer)."""
        loop = self.loop
        if loop is None or loop.is_closed():
            self.draining = True
            return True
        try:
            return asyncio.run_coroutine_threadsafe(self.drain(timeout), loop).result()
        except RuntimeError:  # the loop stopped under us: nothing left to drain
            return True

    async def close(self) -> None:
        self.draining = True
        if self.client is not None:
            await self.client.shutdown()


class ApiKeyAuth:
    """``/v1/*`` requires ``Authorization: Bearer KEY``."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["path"].startswith("/v1/")
                and scope["method"] != "OPTIONS"):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected):
                err = APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Bodies over ``max_bytes`` get a 413 (declared by Content-Length or counted as they
    arrive); the body is read here and handed on whole."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_large = error_response(APIError(413, f"the request body is over the limit of "
                                            f"{self.max_bytes} bytes", code="request_too_large"))
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body, handed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)


class RequestCounter:
    """``nodraft_requests_total{endpoint,method,status}`` for the generation endpoints; the
    status is the HTTP one, or 499 when the client went away before the end."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_ENDPOINTS:
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            state = scope.get("state") or {}
            self.metrics.count_request(scope["path"], state.get("speculation_method", "unknown"),
                                       499 if state.get("client_gone") else status)


def create_app(settings: Settings | None = None, registry: Registry | None = None) -> FastAPI:
    settings = settings or Settings()
    service = Service(settings, registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        EventPump.for_loop(asyncio.get_running_loop()).interval = \
            settings.stream_interval_ms / 1000
        await service.start()
        yield
        await service.close()

    app = FastAPI(title="nodraft", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible streaming server for micro, with a "
                  "speculative-decoding drafter chosen per request (`speculation`).")
    app.state.service = service
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.add_api_route("/", lambda: FileResponse(STATIC / "index.html"), include_in_schema=False)
    for exc in (APIError, RequestValidationError, HTTPException, SpeculationError, QueueFull,
                EngineStopped, Exception):
        app.add_exception_handler(exc, handle_exception)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.api_key is not None:  # checked before the body is read
        app.add_middleware(ApiKeyAuth, api_key=settings.api_key.get_secret_value())
    app.add_middleware(RequestCounter, metrics=service.metrics)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins,
                           allow_methods=["GET", "POST"], allow_headers=["*"])
    return app


class DrainingServer(uvicorn.Server):
    """uvicorn, with the first SIGTERM/SIGINT draining the service before the exit."""

    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service
        self._drainer: threading.Thread | None = None
        self.exit_code = 0
        service.on_fatal = self._fatal

    def _fatal(self) -> None:  # on the event loop: the engine died
        self.exit_code = 1
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        if self._drainer is not None or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal: exit now
            return
        log.info("nodraft: draining for up to %.1f s", self.service.settings.drain_seconds)
        self._drainer = threading.Thread(target=self._drain, name="nodraft-drain", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        self.service.drain_from_thread(self.service.settings.drain_seconds)
        self.should_exit = True


def serve(settings: Settings, registry: Registry | None = None) -> None:
    app = create_app(settings, registry)
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=settings.log_level, lifespan="on",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
    service = app.state.service
    if service.api_cores:  # the engine process has cores of its own; the event loop keeps this
        os.sched_setaffinity(0, service.api_cores)
    server = DrainingServer(config, service)
    server.run()
    if server.exit_code:
        sys.exit(server.exit_code)  # the engine died: let the orchestrator restart us
    if not server.started:
        sys.exit(3)  # the start failed (uvicorn's own code for it); the log says why


def main(argv: list[str] | None = None) -> None:
    try:
        settings = Settings.from_argv(argv)
    except ValidationError as e:
        sys.exit(f"nodraft serve: {e}")
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s: %(message)s")
    serve(settings)


if __name__ == "__main__":
    main()
