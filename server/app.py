"""The application: ``create_app(settings)`` builds it, ``main(argv)`` serves it (uvicorn).

    nodraft serve [--host 127.0.0.1] [--port 8000] [--speculation METHOD] [--api-key KEY]
                  [--max-running N] [--max-waiting N] [--max-body-bytes N]
                  [--cors-origins A,B] [--checkpoints DIR] [--drain-seconds S] [--threads N]
                  ... (``nodraft serve --help`` lists every flag: ``server.settings``)

The lifespan reads the checkpoints in ``--checkpoints`` (micro and micro-layerskip: their
configs, not their weights), the tokenizer and the drafter registry into a ``Service`` on
``app.state.service``, imports every drafter's module (so that no request imports one on
the event loop), and starts the engine: by default a process of its own
(``engine.client.MPClient``), which alone loads and runs the models -- ``nodraft serve``
launches it before this module is even imported (``server.main``), and the lifespan takes
it over; with ``--engine-process false`` a thread of this process. On a machine with two or
more cores ``nodraft serve`` gives the engine process every core but the last and keeps the
last for this one (``Settings.cores``). ``/`` serves the playground page (plain HTML/JS/CSS from
``server/static``, nothing from outside). Around the routes (``server.api``):

- ``--api-key``: ``/v1/*`` needs ``Authorization: Bearer KEY`` (the scheme in any case;
  else 401); ``/health``, ``/ready`` and ``/metrics`` stay open for probes and Prometheus.
- ``--max-body-bytes``: larger bodies get a 413; a body must arrive within
  ``--body-timeout-seconds`` of its headers (else 408). CORS is off unless
  ``--cors-origins``.
- Connections (``ConnectionGuards`` on uvicorn's httptools protocol, or on its h11 one
  with ``--http-parser h11``): a request's headers must arrive within
  ``--header-timeout-seconds`` of the connection's opening or of the previous response's
  end (else a 408 and the connection is closed); a request on a connection beyond
  ``--max-connections`` open ones gets a 503 and its connection is closed; an idle
  keep-alive connection closes after ``--keep-alive-seconds`` (uvicorn's
  ``timeout_keep_alive``); a request line and headers over 16 KiB get a 431 and the
  connection is closed.
- A generation request whose body validates is served without FastAPI's request handling
  (``DirectGeneration``: parsed as FastAPI parses it, the route's own function called);
  any other goes to FastAPI, whose error it gets.
- Every error is an OpenAI error body (``server.errors``); generation requests are counted
  in ``nodraft_requests_total{endpoint,method,status}``; a client that goes away before
  its response is complete, while uploading its body included, counts as 499.
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
import functools
import hmac
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Callable, TypeVar

import h11
import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from nodraft.drafters.registry import Registry, SpeculationError
from nodraft.engine.client import EngineClient, EventPump, InprocClient, MPClient
from nodraft.engine.core import EngineStopped, QueueFull
from nodraft.engine.launch import Launched
from nodraft.engine.process import freeze_heap
from nodraft.micro.checkpoint import available_models, load_config, load_tokenizer
from nodraft.micro.model import MicroConfig
from nodraft.server.admission import Admission, Observers
from nodraft.server.api import DIRECT_ROUTES, direct_body, router
from nodraft.server.errors import APIError, error_body, error_response, handle_exception
from nodraft.server.metrics import Metrics
from nodraft.server.settings import Settings

log = logging.getLogger("nodraft.server")

GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
GRACEFUL_SHUTDOWN_SECONDS = 5  # after draining: for responses still being written
STATIC = Path(__file__).parent / "static"  # the playground page
MAX_HEADER_BYTES = 16 * 1024  # a request line and headers larger get a 431
INLINE_TEXT_BYTES = 512  # text work this small runs on the event loop (``Service.text_work``)
T = TypeVar("T")


class Service:
    """What the routes use: model configs, tokenizer, drafter registry, engine client,
    metrics, admission (``server.admission``) and the text worker. The API process holds no
    weights: the engine (its own process by default) loads them.

    ``max_prompt_bytes``: a prompt text of more UTF-8 bytes cannot fit in the context
    whatever it says: it would be more than ``context - 1`` tokens of at most
    ``longest_token_bytes`` each (the longest token user text can produce).

    ``off_loop(fn, ...)`` runs text work -- tokenising, the chat template -- on ONE worker
    thread: the tokenizer releases the GIL while it runs, so the event loop keeps serving
    meanwhile, and one worker keeps this process to the one core it is pinned to.
    ``text_work(size, fn, ...)`` runs it on the event loop instead when its text is at
    most ``INLINE_TEXT_BYTES`` of UTF-8: tokenising that little costs less than the hop to
    the worker and back (docs/ARCHITECTURE.md, "The request path"). Both threads tokenise
    with ``Tokenizer.encode_batch`` only, which always reads special-token strings as text,
    so they never set the tokenizer's special-token switch to different values."""

    def __init__(self, settings: Settings, registry: Registry | None = None,
                 launched: Launched | None = None):
        self.settings = settings
        self.launched = launched  # an engine process started before this process's imports
        self.registry = registry or Registry()
        self.metrics = Metrics()
        self.admission = Admission(settings.max_running + settings.max_waiting)
        self.models: dict[str, MicroConfig] = {}
        self.created: dict[str, int] = {}
        self.tokenizer = None
        self.client: EngineClient | None = None
        self.context = 0
        self.longest_token_bytes = 0
        self.text_worker = ThreadPoolExecutor(1, thread_name_prefix="nodraft-text")
        self.draining = False
        self.checkpoint_dir = Path(self.settings.checkpoints)
        self.on_fatal: Callable[[], None] | None = None  # the engine died: exit non-zero
        self.loop: asyncio.AbstractEventLoop | None = None
        # decided before ``serve`` pins this process, which would change the answer
        self.api_cores = settings.cores()[1]
        self.engine_config = (launched.config if launched is not None
                              else settings.engine_config(self.registry.targets()))

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            if self.launched is not None and self.client is None:  # nobody took it over
                self.launched.close()
            raise

    async def _start(self) -> None:
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
        special = set(self.tokenizer.special_ids.values())
        self.longest_token_bytes = max(len(self.tokenizer.token_bytes(i))
                                       for i in range(self.tokenizer.vocab_size)
                                       if i not in special)
        self.registry.parse(self.settings.speculation)  # a bad default fails at start-up
        # every drafter's module now, while the engine starts, not at a first request
        imports = asyncio.ensure_future(asyncio.to_thread(self.registry.describe))
        observers = Observers(self.metrics, self.admission)
        if self.launched is not None:  # started first thing by ``main``, before our imports
            self.client = MPClient(self.engine_config, observers, self.launched)
        else:
            kind = MPClient if self.settings.engine_process else InprocClient
            self.client = kind(self.engine_config, observers)
        self.client.on_death = self._engine_died
        try:
            await self.client.start()
        finally:
            await imports
        where = (f"an engine process (pid {self.client.pid})" if self.settings.engine_process
                 else "an engine thread")
        log.info("nodraft: serving %s from %s on %s (KV cache: %s)", ", ".join(names),
                 directory, where, self.engine_config.kv_cache_dtype)
        # out of the collector's reach, as the engine's: what start-up made (torch's,
        # FastAPI's and pydantic's modules and models, ~200k objects) would make every full
        # collection walk it -- a stall of tens of milliseconds for every stream, and a
        # share of this process's time under load
        freeze_heap()

    @property
    def max_prompt_bytes(self) -> int:
        return (self.context - 1) * self.longest_token_bytes

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the text worker (class docstring)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.text_worker, functools.partial(fn, *args))

    async def text_work(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, text work on ``size`` bytes of UTF-8: on the event loop up to
        ``INLINE_TEXT_BYTES``, else on the text worker (class docstring)."""
        if size <= INLINE_TEXT_BYTES:
            return fn(*args)
        return await self.off_loop(fn, *args)

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
        self.text_worker.shutdown(wait=False, cancel_futures=True)


class ApiKeyAuth:
    """``/v1/*`` requires ``Authorization: Bearer KEY``; the scheme is case-insensitive
    (RFC 9110), the key compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["path"].startswith("/v1/")
                and scope["method"] != "OPTIONS"):
            scheme, _, key = Headers(scope=scope).get("authorization", "").strip().partition(" ")
            if not (hmac.compare_digest(key.strip().encode(), self.expected)
                    and scheme.lower() == "bearer"):
                err = APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Reads a request's body whole and hands it on: over ``max_bytes`` (declared by
    Content-Length or counted as it arrives) it gets a 413; not all there within
    ``timeout`` seconds, a 408 (and the connection is closed). A client that goes away
    while sending is marked gone (``client_gone``: counted as 499, not as an error)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

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
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client left while sending
                        scope.setdefault("state", {})["client_gone"] = True
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_bytes or not message.get("more_body", False):
                        break
        except TimeoutError:
            late = APIError(408, f"the request body did not arrive within {self.timeout:g} s",
                            code="request_timeout", headers={"Connection": "close"})
            await error_response(late)(scope, receive, send)
            return
        if size > self.max_bytes:
            await too_large(scope, receive, send)
            return
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, replaying(whole, receive), send)


def replaying(first: Message, receive: Receive) -> Receive:
    """A ``receive`` that hands ``first`` (a message already read) once, then reads on
    (after a whole body: the disconnect, when it comes)."""
    handed = False

    async def replay() -> Message:
        nonlocal handed
        if not handed:
            handed = True
            return first
        return await receive()
    return replay


class DirectGeneration:
    """The generation routes (``server.api.DIRECT_ROUTES``) served without FastAPI's
    routing, dependency solving and content-type parsing: the body ``BodyLimit`` read,
    parsed and validated as FastAPI does it (``server.api.direct_body``), the route's own
    function called, an exception it raises answered by the application's one handler
    (``server.errors.handle_exception``), its response sent. A request whose body FastAPI
    would reject, or which this cannot tell apart from one (a body not read whole
    included), goes to FastAPI unchanged, so every validation error is still FastAPI's,
    rendered as before; the routes stay FastAPI's too (the OpenAPI schema, ``/docs``).
    What it saves: docs/BENCHMARKS.md, "Time to first token on a 4-token prompt"."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = (DIRECT_ROUTES.get(scope["path"]) if scope["type"] == "http"
                 and scope["method"] == "POST" and not scope.get("root_path") else None)
        if route is None:
            await self.app(scope, receive, send)
            return
        message = await receive()  # the whole body: ``BodyLimit`` read it
        model, endpoint = route
        whole = message["type"] == "http.request" and not message.get("more_body", False)
        parsed = (direct_body(model, Headers(scope=scope).get("content-type"),
                              message.get("body", b"")) if whole else None)
        if parsed is None:
            await self.app(scope, replaying(message, receive), send)
            return
        request = Request(scope, receive)
        try:
            response = await endpoint(parsed, request)
        except Exception as e:  # what FastAPI's exception handlers would answer
            response = await handle_exception(request, e)
        await response(scope, receive, send)


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


def create_app(settings: Settings | None = None, registry: Registry | None = None,
               launched: Launched | None = None) -> FastAPI:
    settings = settings or Settings()
    service = Service(settings, registry, launched)

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
    app.add_middleware(DirectGeneration)  # inside BodyLimit: it has the whole body
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes,
                       timeout=settings.body_timeout_seconds)
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


class ConnectionGuards:
    """The guards uvicorn's HTTP protocols lack, for either of them (``GuardedHttpTools``,
    ``GuardedH11``; ``configured`` sets them):

    - ``header_timeout``: a request's headers must be complete within this many seconds of
      the connection's opening or of the previous response's end, else the server answers
      408 and closes the connection (uvicorn waits for headers forever: a client trickling
      them holds a connection as long as it likes);
    - ``max_connections``: a request on a connection beyond this many open ones gets an
      OpenAI 503 (``Retry-After: 1``) and its connection is closed (uvicorn's own
      ``limit_concurrency`` answers in plain text);
    - a request line and headers over ``MAX_HEADER_BYTES`` get an OpenAI 431 and the
      connection is closed, however they arrive (h11 buffers at most 16 KiB of an
      unfinished head but passes a larger one that arrives in one piece; llhttp, under
      httptools, sets no limit).

    A protocol says whether it awaits a head (``_awaiting``: no request of the connection
    has a complete head without its response), passes the bytes of a head arriving to
    ``_count_head``, and starts and stops the header timer (``_await_headers``,
    ``_headers_done``) as heads begin and end."""

    header_timeout = 10.0
    max_connections = 512
    _head_bytes = 0  # of the request line and headers arriving
    _header_timer: asyncio.TimerHandle | None = None

    @classmethod
    def configured(cls, settings: Settings) -> type:
        return type(cls.__name__, (cls,), {"header_timeout": settings.header_timeout_seconds,
                                           "max_connections": settings.max_connections})

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._cap()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._awaiting():
            self._await_headers()  # keep-alive: the next request's headers

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_done()
        super().connection_lost(exc)

    def _cap(self) -> None:
        """Put the connection cap in front of the application."""
        app, connections, cap = self.app, self.connections, self.max_connections

        async def capped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and len(connections) > cap:
                full = APIError(503, f"the server has {len(connections)} connections open, "
                                f"more than the {cap} it serves at once; retry shortly",
                                code="too_many_connections",
                                headers={"Retry-After": "1", "Connection": "close"})
                await error_response(full)(scope, receive, send)
                return
            await app(scope, receive, send)

        self.app = capped

    def _count_head(self, data: bytes) -> bool:
        """Count ``data`` to a head's blank line; False (and a 431 sent, the connection
        closing) once the head is over ``MAX_HEADER_BYTES``."""
        ends = [i + len(blank) for blank in (b"\r\n\r\n", b"\n\n")
                if (i := data.find(blank)) >= 0]
        self._head_bytes += min(ends) if ends else len(data)
        if self._head_bytes <= MAX_HEADER_BYTES:
            return True
        self._headers_done()
        self._reply_and_close(431, "Request Header Fields Too Large", error_body(
            f"the request line and headers are over {MAX_HEADER_BYTES} bytes",
            "invalid_request_error", code="headers_too_large"))
        return False

    def _await_headers(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _headers_done(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._awaiting():
            return
        self._reply_and_close(408, "Request Timeout", error_body(
            f"the request's headers did not arrive within {self.header_timeout:g} s",
            "invalid_request_error", code="request_timeout"))

    def _reply_and_close(self, status: int, reason: str, error: dict) -> None:
        """An OpenAI error body written straight to the connection, which is then closed:
        for a request that never reached the application."""
        body = JSONResponse(error).body
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                             b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, reason.encode(), len(body), body))
        self.transport.close()


class GuardedHttpTools(ConnectionGuards, HttpToolsProtocol):
    """uvicorn's httptools protocol (llhttp's parser, in C) with ``ConnectionGuards``: the
    server's default (``--http-parser``). Its parser reads pipelined requests ahead of the
    responses, so a connection counts the requests whose heads are complete and not yet
    answered: a head is awaited, and timed, only where none is."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._head_open = True  # the next bytes parsed belong to a request's head
        self._open_requests = 0  # heads complete, responses not

    def _awaiting(self) -> bool:
        return self._head_open and not self._open_requests

    def data_received(self, data: bytes) -> None:
        if self._head_open and not self._count_head(data):
            return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_open = True

    def on_headers_complete(self) -> None:
        self._head_open, self._head_bytes = False, 0
        self._open_requests += 1
        self._headers_done()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_open = True  # what follows is the next request's

    def on_response_complete(self) -> None:
        self._open_requests -= 1
        super().on_response_complete()


class GuardedH11(ConnectionGuards, H11Protocol):
    """uvicorn's h11 protocol (pure Python) with ``ConnectionGuards``
    (``--http-parser h11``)."""

    def _awaiting(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def data_received(self, data: bytes) -> None:
        if self._awaiting() and not self._count_head(data):  # a head arriving
            return
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._awaiting():  # no request yet, or its headers unfinished
            self._await_headers()
        else:
            self._head_bytes = 0
            self._headers_done()


HTTP_PARSERS = {"httptools": GuardedHttpTools, "h11": GuardedH11}


def uvicorn_config(app: ASGIApp, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """uvicorn's configuration for ``app`` under ``settings`` (the guarded protocol, the
    keep-alive timeout); ``overrides`` replace any of uvicorn's options."""
    options: dict[str, Any] = dict(
        host=settings.host, port=settings.port, log_level=settings.log_level, lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        timeout_keep_alive=settings.keep_alive_seconds,
        http=HTTP_PARSERS[settings.http_parser].configured(settings))
    options.update(overrides)
    return uvicorn.Config(app, **options)


def serve(settings: Settings, registry: Registry | None = None,
          launched: Launched | None = None) -> None:
    """Serve until stopped. ``launched``: the engine process, already started for
    ``settings.engine_config()`` (``server.main``)."""
    app = create_app(settings, registry, launched)
    config = uvicorn_config(app, settings)
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
    from nodraft.server.main import main as serve_main

    serve_main(argv)


if __name__ == "__main__":
    main()
