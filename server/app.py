"""The application: ``create_app(settings)`` builds it, ``main(argv)`` serves it (uvicorn).

    nodraft serve [--host 127.0.0.1] [--port 8000] [--speculation METHOD] [--api-key KEY]
                  [--max-running N] [--max-waiting N] [--max-body-bytes N]
                  [--cors-origins A,B] [--checkpoints DIR] [--drain-seconds S] [--threads N]

The lifespan loads the checkpoints in ``--checkpoints`` (micro and micro-layerskip), the
tokenizer and the drafter registry into a ``Service`` on ``app.state.service``, and starts
the engine thread, which alone runs the models. ``/`` serves the playground page (plain
HTML/JS/CSS from ``server/static``, nothing from outside). Around the routes (``server.api``):

- ``--api-key``: ``/v1/*`` needs ``Authorization: Bearer KEY`` (else 401); ``/health``,
  ``/ready`` and ``/metrics`` stay open for probes and Prometheus.
- ``--max-body-bytes``: larger bodies get a 413. CORS is off unless ``--cors-origins``.
- Every error is an OpenAI error body (``server.errors``); generation requests are counted
  in ``nodraft_requests_total{endpoint,method,status}``.
- SIGTERM (or Ctrl-C) drains: ``/ready`` and new requests answer 503, in-flight requests
  run to their end for up to ``--drain-seconds``, then whatever is left is cancelled (its
  stream ends cleanly, finish reason ``cancelled``) and the process exits 0. A second
  signal exits at once.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import sys
import threading
from contextlib import asynccontextmanager
from pathlib import Path

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
from micro.checkpoint import available_models, load_model, load_tokenizer
from server.api import router
from server.engine import Engine, EngineStopped, QueueFull
from server.errors import APIError, error_response, handle_exception
from server.generation import EventPump
from server.metrics import Metrics
from server.settings import Settings

log = logging.getLogger("nodraft.server")

GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
GRACEFUL_SHUTDOWN_SECONDS = 5  # after draining: for responses still being written
STATIC = Path(__file__).parent / "static"  # the playground page (issue 9)


class Service:
    """What the routes use: models, tokenizer, drafter registry, engine, metrics."""

    def __init__(self, settings: Settings, registry: Registry | None = None):
        self.settings = settings
        self.registry = registry or Registry()
        self.metrics = Metrics()
        self.models: dict = {}
        self.created: dict[str, int] = {}
        self.tokenizer = None
        self.engine: Engine | None = None
        self.context = 0
        self.draining = False
        self.checkpoint_dir = Path(self.settings.checkpoints)

    def load(self) -> None:
        directory = self.checkpoint_dir = Path(self.settings.checkpoints)
        names = available_models(directory)
        if not names:
            raise RuntimeError(f"no checkpoint in {directory} (micro.safetensors, "
                               "micro-layerskip.safetensors): train them or pass --checkpoints")
        tokenizer_json = directory / "tokenizer.json"
        self.tokenizer = load_tokenizer(tokenizer_json if tokenizer_json.exists() else None)
        self.models = {name: load_model(name, directory) for name in names}
        self.created = {name: int((directory / f"{name}.safetensors").stat().st_mtime)
                        for name in names}
        self.context = min(m.config.max_positions for m in self.models.values())
        self.registry.parse(self.settings.speculation)  # a bad default fails at start-up
        self.engine = Engine(self.models, self.registry, self.tokenizer.eot_id,
                             self.settings.max_running, self.settings.max_waiting,
                             observer=self.metrics, threads=self.settings.engine_threads)
        self.engine.checkpoint_dir = directory  # Medusa and EAGLE weights sit beside micro's
        if self.settings.compile:
            for model in self.models.values():
                model.compile(lazy=False, gemm=self.settings.gemm)
        self.engine.start()
        if self.settings.compile:
            log.info("nodraft: compiling the single-sequence passes in the background "
                     "(served eager until then)")
            self.engine.warm_up(self._compiled)
        log.info("nodraft: serving %s from %s", ", ".join(names), directory)

    def _compiled(self, seconds: float) -> None:
        if self.engine.compiled_error is None:
            kinds = {m.compiled.gemm_kind for m in self.models.values() if m.compiled}
            log.info("nodraft: compiled passes ready (%.0f s; products: %s)", seconds,
                     ", ".join(sorted(k for k in kinds if k)))
        else:
            log.warning("nodraft: compiling failed, serving eager passes: %s",
                        self.engine.compiled_error)

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining

    @property
    def status(self) -> str:
        return "draining" if self.draining else "ready" if self.engine else "loading"

    def drain(self, timeout: float) -> bool:
        """Take no new requests; let in-flight ones finish for up to ``timeout`` s, then
        cancel the rest. True if everything finished in time."""
        self.draining = True
        if self.engine is None:
            return True
        finished = self.engine.drain(timeout)
        if not finished:
            log.warning("nodraft: drain timed out after %.1f s; cancelling the rest", timeout)
            self.engine.stop()
        return finished

    def close(self) -> None:
        self.draining = True
        if self.engine is not None:
            self.engine.stop()


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
        await asyncio.to_thread(service.load)
        yield
        await asyncio.to_thread(service.close)

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

    def handle_exit(self, sig, frame) -> None:
        if self._drainer is not None or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal: exit now
            return
        log.info("nodraft: draining for up to %.1f s", self.service.settings.drain_seconds)
        self._drainer = threading.Thread(target=self._drain, name="nodraft-drain", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        self.service.drain(self.service.settings.drain_seconds)
        self.should_exit = True


def serve(settings: Settings, registry: Registry | None = None) -> None:
    app = create_app(settings, registry)
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=settings.log_level, lifespan="on",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
    DrainingServer(config, app.state.service).run()


def main(argv: list[str] | None = None) -> None:
    try:
        settings = Settings.from_argv(argv)
    except ValidationError as e:
        sys.exit(f"nodraft serve: {e}")
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s: %(message)s")
    serve(settings)


if __name__ == "__main__":
    main()
