"""The engine core in a process of its own, and what builds an engine from its settings.

    API process                                  engine process (``run_engine_process``)
      MPClient.submit --Add/Abort/Shutdown-->  PULL  read every pending message
                                                     Engine.run_once(): one pass per model
      MPClient._receive <----Outputs---------  PUSH  that iteration's events, in one message

The API process binds two ZeroMQ ``ipc://`` sockets and starts this process with
multiprocessing's ``spawn`` (``engine.launch``: a fresh interpreter, no OpenMP or torch
state inherited); the engine connects, loads the checkpoints and imports every drafter's
module, starts loading its compiled graphs in a background thread when asked, and sends an
empty ``Outputs`` to say it is serving. Then one thread alternates
between reading requests (without blocking while sequences run) and running engine
iterations: the engine's Python and its kernels never share a GIL or a core with the event
loop that streams responses.

Lifetime: the engine process ignores SIGINT and SIGTERM -- a Ctrl-C reaches the whole
process group, and the API process drains first and then sends ``Shutdown``. It exits when
told to, and when its parent dies, however it dies (``PR_SET_PDEATHSIG`` on Linux, and a
check of its parent's pid between iterations everywhere): no engine outlives its server.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from pathlib import Path

import torch
import zmq

from nodraft.drafters.registry import Registry
from nodraft.engine import messages
from nodraft.engine.core import Engine, Event, GenerationRequest, Handle
from nodraft.engine.launch import EngineConfig, io_context, stop_children

log = logging.getLogger("nodraft.engine")

IDLE_POLL_MS = 100  # an idle engine looks at its parent and its compile status this often


def build_engine(config: EngineConfig) -> Engine:
    """Load the checkpoints into an engine (not started); compiled passes are set up, and
    built later by ``Engine.warm_up``."""
    from nodraft.micro.checkpoint import available_models, load_model, load_tokenizer

    directory = Path(config.checkpoints)
    names = available_models(directory)
    if not names:
        raise RuntimeError(f"no checkpoint in {directory} (micro.safetensors, "
                           "micro-layerskip.safetensors): train them or pass --checkpoints")
    tokenizer_json = directory / "tokenizer.json"
    tokenizer = load_tokenizer(tokenizer_json if tokenizer_json.exists() else None)
    models = {name: load_model(name, directory) for name in names}
    registry = Registry(builtin=config.drafters, plugins=False) if config.drafters else Registry()
    registry.describe()  # every drafter's module now, so that no request imports one
    engine = Engine(models, registry, tokenizer.eot_id, config.max_running,
                    config.max_waiting, threads=config.threads,
                    prefix_cache_bytes=config.prefix_cache_bytes,
                    kv_cache_dtype=config.kv_cache_dtype)
    engine.checkpoint_dir = directory  # Medusa and EAGLE weights sit beside micro's
    if config.compile:
        for model in models.values():
            model.compile(lazy=False, gemm=config.gemm)
    freeze_heap()
    return engine


def freeze_heap() -> None:
    """Collect, then move every object alive now (torch's and the compiler's modules, the
    models, the loaded graphs) out of the garbage collector's reach (``gc.freeze``, as
    vLLM's engine does after start-up), so that a full collection -- which stops the
    engine thread, and every stream with it -- walks only what serving made since
    (docs/ARCHITECTURE.md, "The engine core is a process of its own"). Objects made later
    are collected as usual. Called once the models are loaded and again once the compiled
    graphs are; the API process calls it once it has started (``server.app.Service``)."""
    gc.collect()
    gc.freeze()


def compiled_status(engine: Engine, config: EngineConfig) -> tuple[str, str | None]:
    if not config.compile:
        return "off", None
    if engine.compiled_error is not None:
        return "failed", engine.compiled_error
    return ("ready" if engine.compiled_ready else "warming"), None


def start_warm_up(engine: Engine, config: EngineConfig) -> None:
    """Compiled passes in the background, if asked: the graphs built for this machine
    (``engine.artifacts``) are loaded, after a process of their own has built them if
    there are none yet -- never compiled in this process. The log says when they are
    ready and with what, or why not."""
    if not config.compile:
        return
    from nodraft.engine import artifacts

    artifacts.use_inductor_cache(artifacts.cache_home(config.compile_cache))
    store = artifacts.Store(config, config.compile_cache)
    # what loading a graph imports, now, before serving: on the warm-up thread it would
    # hold the GIL for seconds while requests are served
    artifacts.import_runtime()
    if store.complete():
        log.info("nodraft: loading the compiled passes built for this machine: %s", store.path)
        engine.costs_after_load = True

    def load() -> None:
        folder = store.ensure()
        artifacts.trust_the_build(store.manifest())
        log.info("nodraft: %d compiled graphs loaded", artifacts.load(engine, folder))

    def done(seconds: float) -> None:
        freeze_heap()
        if engine.compiled_error is None:
            kinds = {m.compiled.gemm_kind for m in engine.models.values() if m.compiled}
            log.info("nodraft: compiled passes ready (%.0f s; products: %s)", seconds,
                     ", ".join(sorted(k for k in kinds if k)))
        else:
            log.warning("nodraft: compiling failed, serving eager passes: %s",
                        engine.compiled_error)

    engine.warm_up(done, load=load)


def keep_first_core(config: EngineConfig) -> None:
    """With two or more engine cores and threads: start the pass threads now (OpenMP's,
    a parallel region's), on every engine core, then keep this thread -- the loop, and
    every pass a lone sequence runs on one thread -- to the first core. Threads started
    before (the warm-up's, and the artifact build it starts) keep every engine core.

    Without it, an engine given every core floated its loop onto the API process's core,
    and one stream decoded slower with two threads than with one (docs/BENCHMARKS.md,
    "Serving"). Call it on the engine's main thread, after the other threads started."""
    cores = config.cores
    if not cores or len(cores) < 2 or config.threads < 2:
        return
    torch.set_num_threads(config.threads)
    torch.ones(1 << 20).add_(1)  # parallel: the pass threads start, with this thread's cores
    os.sched_setaffinity(0, cores[:1])  # this thread only


# -- the engine process ------------------------------------------------------------------------
def run_engine_process(config: EngineConfig, input_address: str, output_address: str,
                       parent_pid: int) -> None:
    """The engine process's main function, after ``engine.launch.engine_main``'s first steps
    (the death signal, the signals ignored, the cores)."""
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s: %(message)s")
    if config.threads:
        torch.set_num_threads(config.threads)
    engine = build_engine(config)
    context = io_context(config)
    inbox = context.socket(zmq.PULL)
    inbox.connect(input_address)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.setsockopt(zmq.RECONNECT_IVL, 10)  # ms: the API may bind its end after we connect
    outbox.connect(output_address)
    start_warm_up(engine, config)
    keep_first_core(config)
    try:
        EngineCore(engine, config, inbox, outbox, parent_pid).run()
    finally:
        outbox.close()  # lingers until the last outputs are written
        inbox.close(linger=0)
        context.term()
    # daemon threads (a compile in progress) must not hold the exit up, nor outlive it
    # through the processes they started (the kernels' compilers)
    stopped = stop_children()
    if stopped:
        log.info("nodraft: stopped the engine's child processes %s", stopped)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class EngineCore:
    """The engine process's loop: read requests, run an iteration, send its outputs."""

    def __init__(self, engine: Engine, config: EngineConfig, inbox: zmq.Socket,
                 outbox: zmq.Socket, parent_pid: int):
        self.engine, self.config = engine, config
        self.inbox, self.outbox = inbox, outbox
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        self.handles: dict[int, Handle] = {}
        self.events: list[tuple[int, Event]] = []
        self.status: tuple[str, str | None] | None = None
        self.load: tuple[int, int] | None = None
        self.stopping = False
        self.streaming: set[int] = set()  # requests with a token sent
        self.sent_at = 0.0  # time.monotonic() of the last outputs sent
        self.iteration_s = 0.0  # how long the last engine iteration took

    @torch.inference_mode()  # the whole loop: each iteration need not enter it again
    def run(self) -> None:
        engine = self.engine
        self._send()  # the first outputs say the engine is serving
        while True:
            busy = engine.busy
            if self.poller.poll(0 if busy else IDLE_POLL_MS):
                while True:
                    try:
                        raw = self.inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(messages.decode_input(raw))
                self._send()  # the queue's new length, before the iteration
            if self.stopping:
                engine.stop()  # cancels everything; the iterations below report it
                while engine.busy:
                    engine.run_once()
                self._send()
                return
            if engine.busy:
                t0 = time.monotonic()
                engine.run_once()
                self.iteration_s = time.monotonic() - t0
            elif engine.idle_work():
                self._send()  # a status that changed (compiled passes ready) goes first
                engine.idle(pending=lambda: bool(self.poller.poll(0)))
            self._send()
            if not busy and os.getppid() != self.parent_pid:
                return  # the API process is gone (where PDEATHSIG is not available)

    def _handle(self, msg: messages.Input) -> None:
        if isinstance(msg, messages.Add):
            self._add(msg.rid, msg.request)
        elif isinstance(msg, messages.Abort):
            for rid in msg.rids:
                handle = self.handles.get(rid)
                if handle is not None:
                    self.engine.cancel(handle)
        elif isinstance(msg, messages.Shutdown):
            self.stopping = True

    def _add(self, rid: int, r: messages.Request) -> None:
        def report(event: Event) -> None:
            self.events.append((rid, event))

        try:
            method, params = self.engine.registry.parse({"method": r.method, **r.params})
            request = GenerationRequest(r.model, r.prompt, r.max_tokens, r.sampling, method,
                                        params, tuple(r.stop_token_ids), r.logprobs,
                                        r.prompt_logprobs)
            self.handles[rid] = self.engine.submit(request, report)
        except Exception as e:  # QueueFull, EngineStopped, a bad request: that request only
            report(Event("error", error=f"{type(e).__name__}: {e}"))

    def _send(self) -> None:
        """The events so far, with the queue and compile status; nothing if nothing
        changed, or if all that changed is more steps of requests that already have a
        token out, sequences still run and the next iteration (timed as the last) ends
        within ``stream_interval`` of the last outputs sent: they go with its outputs.

        So a fast stream costs the engine a message per interval, not per step (what a
        message costs it: docs/ARCHITECTURE.md, "The engine core is a process of its
        own"). A request's first token, its end and any error never wait; each step carries
        the time it was ready (``Event.at``), which the metrics use."""
        status = compiled_status(self.engine, self.config)
        load = self.engine.load
        events = self.events
        if not events and status == self.status and load == self.load:
            return
        now = time.monotonic()
        if (status == self.status and load == self.load and self.engine.busy
                and now + self.iteration_s - self.sent_at < self.config.stream_interval
                and all(e.kind == "step" and rid in self.streaming for rid, e in events)):
            return
        self.events = []
        for rid, event in events:
            if event.kind == "step":
                self.streaming.add(rid)
            elif event.kind in ("finish", "error"):
                self.handles.pop(rid, None)
                self.streaming.discard(rid)
        self.status, self.load, self.sent_at = status, load, now
        self.outbox.send(messages.encode(messages.Outputs(
            events, load[0], load[1], status[0], status[1])))
