"""The seam between the API and the engine (vLLM's ``EngineCoreClient``): two clients.

    client = MPClient(config, observer)    # the server's default: the engine process
    client = InprocClient(config, observer)  # the engine on a thread of this process
    await client.start()
    rid = client.submit(request, deliver)   # deliver(event) runs on this event loop
    client.abort(rid)                       # a client that went away
    await client.drain(timeout); await client.shutdown()

Both speak plain data: a ``GenerationRequest`` in, ``Event``s out (``engine.core``), in the
order the engine reported them. ``deliver`` is called on the event loop that called
``submit``; the ``observer`` (the Prometheus adapter) sees every event first, wherever it
arrives, whether or not anyone still reads the stream. Admission is checked at once:
``submit`` raises ``QueueFull`` beyond ``max_running + max_waiting`` sequences in flight,
``EngineStopped`` while draining and ``EngineDead`` once the engine process has exited.

If the engine process dies, every request in flight gets an ``error`` event at once and
``on_death(reason)`` is called; the client serves nothing more. Tests, the workshop and
the benchmarks decode in process through ``engine.core.Engine`` itself.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import multiprocessing
import shutil
import threading
import time
import weakref
from typing import Callable, Protocol

import zmq
import zmq.asyncio

from nodraft.engine import messages
from nodraft.engine.core import EngineDead, EngineStopped, Event, GenerationRequest, QueueFull
from nodraft.engine.launch import EngineConfig, Launched, launch
from nodraft.engine.process import build_engine, compiled_status, start_warm_up

START_TIMEOUT = 600.0  # s: loading the checkpoints in the engine process
STOP_TIMEOUT = 10.0  # s: for the engine process to exit once told to
EXIT_STATUS_WAIT = 1.0  # s: at most, for a dead engine's exit status (it takes microseconds)


class Observer(Protocol):
    """What the client tells the metrics: submissions, every event, the queue."""

    def begin(self, rid: int, request: GenerationRequest, submitted: float) -> None: ...
    def observe(self, rid: int, event: Event) -> None: ...
    def on_queue(self, running: int, waiting: int) -> None: ...
    def flush(self) -> None: ...  # a batch of events observed: bring the figures up to date


class _NoObserver:
    def begin(self, rid, request, submitted): ...
    def observe(self, rid, event): ...
    def on_queue(self, running, waiting): ...
    def flush(self): ...


class EngineClient(abc.ABC):
    """What both clients share: admission, request ids, status. Each client also has
    ``running``, ``waiting`` (the engine's queue, as last reported), ``compiled`` and
    ``compiled_error`` (``engine.process.compiled_status``) and ``pid`` (the engine
    process's, or None)."""

    def __init__(self, config: EngineConfig, observer: Observer | None = None):
        self.config = config
        self.observer = observer or _NoObserver()
        self.capacity = config.max_running + config.max_waiting
        self.on_death: Callable[[str], None] | None = None
        self.death: str | None = None  # why the engine stopped unasked
        self._ids = itertools.count(1)
        self._accepting = True

    @property
    def alive(self) -> bool:
        return self.death is None

    def _admit(self, in_flight: int) -> int:
        if self.death is not None:
            raise EngineDead(self.death)
        if not self._accepting:
            raise EngineStopped("the server is shutting down")
        if in_flight >= self.capacity:
            raise QueueFull(f"{in_flight} sequences in flight")
        return next(self._ids)

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the models and start the engine; returns once it serves."""

    @abc.abstractmethod
    def submit(self, request: GenerationRequest, deliver: Callable[[Event], None]) -> int:
        """Queue a request (on the event loop); its events go to ``deliver`` there."""

    @abc.abstractmethod
    def abort(self, rid: int) -> None:
        """Cancel a request; its ``finish`` (``cancelled``) still comes."""

    @abc.abstractmethod
    async def drain(self, timeout: float) -> bool:
        """Take no more requests; wait up to ``timeout`` s for the rest. True if none is left."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Cancel what is left (each stream ends, ``cancelled``) and stop the engine."""


# -- the engine process ------------------------------------------------------------------------
class MPClient(EngineClient):
    """The engine core in a process of its own, over ZeroMQ (``engine.process``)."""

    def __init__(self, config: EngineConfig, observer: Observer | None = None,
                 launched: Launched | None = None):
        """``launched``: an engine process already started for ``config``
        (``engine.launch.launch``, as ``nodraft serve`` does first thing); else ``start``
        starts one."""
        super().__init__(config, observer)
        self.running = self.waiting = 0
        self.compiled, self.compiled_error = "warming" if config.compile else "off", None
        self.pid: int | None = None
        self._requests: dict[int, Callable[[Event], None]] = {}
        self._idle = asyncio.Event()
        self._stopping = False
        self._launched = launched
        self.process: multiprocessing.process.BaseProcess | None = None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        launched, self._launched = self._launched or launch(self.config), None
        launched.adopted = True
        self.process, self._dir = launched.process, launched.directory
        self._sync, self._input = launched.context, launched.input
        self._async = zmq.asyncio.Context()
        self._output = self._async.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(launched.output_address)
        self.pid = self.process.pid
        exited = asyncio.Event()
        self.loop.add_reader(self.process.sentinel, exited.set)
        first = asyncio.ensure_future(self._output.recv())
        gone = asyncio.ensure_future(exited.wait())
        done, _ = await asyncio.wait({first, gone}, timeout=START_TIMEOUT,
                                     return_when=asyncio.FIRST_COMPLETED)
        self.loop.remove_reader(self.process.sentinel)
        if first not in done:
            first.cancel()
            gone.cancel()
            self.process.kill()
            self.process.join(STOP_TIMEOUT)
            self._close_sockets()
            raise RuntimeError(f"the engine process did not start ({self._exit_reason()}); "
                               "its log above says why")
        gone.cancel()
        self._on_outputs(messages.decode_outputs(first.result()))
        self.loop.add_reader(self.process.sentinel, self._engine_exited)
        self._receiver = asyncio.ensure_future(self._receive())

    def submit(self, request: GenerationRequest, deliver: Callable[[Event], None]) -> int:
        rid = self._admit(len(self._requests))
        self._requests[rid] = deliver
        self._idle.clear()
        self.observer.begin(rid, request, time.monotonic())
        self._input.send(messages.encode(messages.Add(rid, messages.Request.of(request))))
        return rid

    def abort(self, rid: int) -> None:
        if rid in self._requests and self.alive:
            self._input.send(messages.encode(messages.Abort([rid])))

    async def drain(self, timeout: float) -> bool:
        self._accepting = False
        if not self._requests:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def shutdown(self) -> None:
        self._accepting = False
        if self.process is None or self._stopping:
            return
        self._stopping = True
        if self.process.is_alive():
            self._input.send(messages.encode(messages.Shutdown()))
            await asyncio.to_thread(self.process.join, STOP_TIMEOUT)
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join, STOP_TIMEOUT)
        self._receiver.cancel()
        while await self._output.poll(50):  # the last outputs, sent before the exit
            self._on_outputs(messages.decode_outputs(await self._output.recv()))
        self.loop.remove_reader(self.process.sentinel)
        self._fail_all("the engine stopped")
        self._close_sockets()

    # -- on the event loop ------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            raw = await self._output.recv()
            self._on_outputs(messages.decode_outputs(raw))

    def _on_outputs(self, out: messages.Outputs) -> None:
        self.running, self.waiting = out.running, out.waiting
        self.compiled, self.compiled_error = out.compiled, out.compiled_error
        self.observer.on_queue(out.running, out.waiting)
        for rid, event in out.events:
            deliver = self._requests.get(rid)
            if deliver is None:
                continue
            self.observer.observe(rid, event)
            if event.kind in ("finish", "error"):
                del self._requests[rid]
            deliver(event)
        self.observer.flush()
        if not self._requests:
            self._idle.set()

    def _engine_exited(self) -> None:
        self.loop.remove_reader(self.process.sentinel)
        # the sentinel is readable once the process has closed its files, a moment before
        # it can be reaped: wait for that moment (a non-blocking join could find no exit
        # status yet, and the error would not say how the engine died)
        self.process.join(EXIT_STATUS_WAIT)
        if self._stopping:
            return
        self.death = f"the engine process exited ({self._exit_reason()})"
        self._fail_all(self.death)
        self.running = self.waiting = 0
        self.observer.on_queue(0, 0)
        if self.on_death is not None:
            self.on_death(self.death)

    def _fail_all(self, reason: str) -> None:
        requests, self._requests = self._requests, {}
        for rid, deliver in requests.items():
            event = Event("error", error=reason)
            self.observer.observe(rid, event)
            deliver(event)
        self._idle.set()

    def _exit_reason(self) -> str:
        code = self.process.exitcode if self.process is not None else None
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def _close_sockets(self) -> None:
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._sync.term()
        self._async.term()
        shutil.rmtree(self._dir, ignore_errors=True)


# -- the engine on a thread of this process ---------------------------------------------------
class InprocClient(EngineClient):
    """The engine on a thread of the API process (``--engine-process false``): the engine
    thread's events reach the event loop through its ``EventPump``."""

    pid = None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.pump = EventPump.for_loop(self.loop)
        self.engine = await asyncio.to_thread(build_engine, self.config)
        self._handles: dict[int, object] = {}
        self.engine.start()
        start_warm_up(self.engine, self.config)

    def submit(self, request: GenerationRequest, deliver: Callable[[Event], None]) -> int:
        rid = self._admit(len(self._handles))
        observer, pump, handles = self.observer, self.pump, self._handles

        def on_event(event: Event) -> None:  # on the engine thread
            observer.observe(rid, event)
            if event.kind in ("finish", "error"):
                observer.flush()  # (steps' figures reach the counters at ends and scrapes)
                handles.pop(rid, None)
            try:
                pump.post(deliver, event)
            except RuntimeError:  # the event loop has closed: nobody is listening
                pass

        observer.begin(rid, request, time.monotonic())
        handles[rid] = None  # counted in flight from now
        try:
            handles[rid] = self.engine.submit(request, on_event)
        except Exception:  # refused after all (a race with draining): reported as an error
            handles.pop(rid, None)
            observer.observe(rid, Event("error", error="refused"))
            raise
        return rid

    def abort(self, rid: int) -> None:
        handle = self._handles.get(rid)
        if handle is not None:
            self.engine.cancel(handle)

    @property
    def running(self) -> int:
        return self.engine.load[0]

    @property
    def waiting(self) -> int:
        return self.engine.load[1]

    @property
    def compiled(self) -> str:
        return compiled_status(self.engine, self.config)[0]

    @property
    def compiled_error(self) -> str | None:
        return compiled_status(self.engine, self.config)[1]

    async def drain(self, timeout: float) -> bool:
        self._accepting = False
        return await asyncio.to_thread(self.engine.drain, timeout)

    async def shutdown(self) -> None:
        self._accepting = False
        await asyncio.to_thread(self.engine.stop)


class EventPump:
    """Carries (deliver, item) pairs from other threads onto one event loop, in order.

    The first item after a quiet spell wakes the loop at once (``call_soon_threadsafe``),
    so a lone token is never held. After a hand-out that found items, the loop looks
    again ``interval`` seconds later on a timer of its own, and goes on so while items
    keep coming; only when a look finds none does the next item wake it again. So a busy
    engine thread never wakes the loop, and the loop runs at most once per ``interval``.
    ``interval`` 0: one hand-out per wake-up, with at most one wake-up pending. A wake-up
    pulls the event loop onto the GIL in the middle of the engine thread's step, which is
    why the in-process client batches them.
    """

    interval = 0.0  # seconds; the server sets it from --stream-interval-ms

    _pumps: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EventPump]" = \
        weakref.WeakKeyDictionary()
    _pumps_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[object], None], object]] = []
        self._due = False  # a hand-out is scheduled (a wake-up or the loop's own timer)

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> "EventPump":
        with cls._pumps_lock:
            pump = cls._pumps.get(loop)
            if pump is None:
                pump = cls._pumps[loop] = cls(loop)
            return pump

    def post(self, deliver: Callable[[object], None], item: object) -> None:
        """From any thread: ``deliver(item)`` on the loop. Raises RuntimeError once the
        loop is closed."""
        with self._lock:
            self._pending.append((deliver, item))
            wake, self._due = not self._due, True
        try:
            if wake:
                self.loop.call_soon_threadsafe(self._drain)
            elif self.loop.is_closed():  # closed with its timer pending
                raise RuntimeError("the event loop is closed")
        except RuntimeError:  # closed: nobody will drain; drop what is pending
            with self._lock:
                self._pending.clear()
                self._due = False
            raise

    def _drain(self) -> None:  # on the loop
        with self._lock:
            items, self._pending = self._pending, []
            again = bool(items) and self.interval > 0
            self._due = again
        if again:  # more are likely: look again on our own timer, unwoken
            self.loop.call_later(self.interval, self._drain)
        for deliver, item in items:
            deliver(item)
