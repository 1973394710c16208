"""The engine core: one thread owns the models and their KV caches and runs every sequence.

A caller submits a ``GenerationRequest`` with a callback; the engine admits it when a KV
slot is free (at most ``max_running`` sequences, at most ``max_waiting`` queued, else
``QueueFull``) and reports through the callback, in order: ``admit``, a ``step`` per
target pass that emitted tokens (each with its figures: what was drafted, accepted and
what the draft cost), then one ``finish`` or ``error`` carrying the request's totals.
Events are plain data (``engine.messages`` sends them between processes). Step events are
held until the iteration's passes are done, then delivered together. Cancelling a
request -- a client that went away -- frees its slot before the next pass.

``run_once`` is one iteration (admit, one pass per model, deliver, reap); ``start`` runs
it on a thread of the engine's own (the in-process client), and the engine process
(``engine.process``) calls it from its own loop between reading requests.

Continuous batching: each iteration runs ONE packed target pass per model over every
running sequence of that model -- each one's current token and draft (ragged: chains and
trees of any size, packed, each attending only to its own KV slot), plus chunks of the
prompts still being prefilled (at most ``PREFILL_TOKENS`` rows per pass, so a long prompt
never stalls the others). Sequences join between passes and leave when done. How many
draft tokens each sequence may carry is the ``DraftScheduler``'s call: measured goodput,
so drafting shrinks, then stops, as the batch grows. A lone sequence takes the
single-sequence path (``Sequence.step``: the leanest pass, early exit's KV reuse where
asked, and the request's own draft length).

Compiled passes (``Micro.compile``, micro/compiled.py) serve the single-sequence path once
``warm_up`` has compiled them; it runs in a thread of its own on a scratch cache of the
engine cache's shape, so requests are served eagerly meanwhile and none waits on a
compiler. Drafters with graphs of their own (EAGLE's draft step) compile theirs next, for
their default parameters. A draining server compiles nothing more. Packed passes run
compiled too once their families are (``CompiledPasses.packed``), eager until then.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import torch
from torch import Tensor

from nodraft.drafters import costs
from nodraft.drafters.base import Draft, DrafterEnv, has_hook
from nodraft.drafters.registry import Registry
from nodraft.micro.model import KVCache, Micro
from nodraft.micro.ops import inference
from nodraft.micro.packed import Segment, forward_packed, packed_draft_cap
from nodraft.engine.artifacts import as_a_build
from nodraft.engine.launch import KV_CACHE_DTYPES, PREFIX_CACHE_BYTES
from nodraft.engine.prefix_cache import PrefixCache
from nodraft.engine.scheduler import DraftScheduler, SeqDraftState
from nodraft.engine.sequence import Sequence, StepResult
from nodraft.engine.stats import SpecStats
from nodraft.engine.verify import SamplingParams, greedy_tokens, race_blocks, races_whole

log = logging.getLogger("nodraft.engine")


PREFILL_TOKENS = 256  # prompt rows per packed pass, over all sequences being prefilled
IDLE_POLL_S = 0.1  # an idle engine thread looks for idle work this often
WARM_UP_SWITCH_INTERVAL = 2e-4  # s: the GIL's switch interval while compiling (default 5 ms)
GAP_WAIT_S = 1.0  # s: the longest a graph load waits for a gap between requests
# a lone sequence's prefill runs on ``threads`` threads from this many prompt tokens, on one
# below (docs/BENCHMARKS.md, "Serving": a short prompt's first token came later on two)
THREADED_PREFILL_TOKENS = 128


class QueueFull(RuntimeError):
    """More requests than ``max_running`` + ``max_waiting``: the caller should retry later."""


class EngineStopped(RuntimeError):
    """The engine is draining or stopped and takes no new requests."""


class EngineDead(EngineStopped):
    """The engine process has exited: nothing more will be decoded."""


@dataclass
class GenerationRequest:
    model: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    method: str = "none"
    params: Any = None  # the drafter's Params (Registry.parse)
    stop_token_ids: tuple[int, ...] = ()  # besides the engine's end-of-text
    logprobs: int | None = None  # per token: its logprob and the top k (``StepResult``)
    prompt_logprobs: bool = False  # the prompt tokens' too, on the first step


class Event(msgspec.Struct, array_like=True, gc=False):
    """What the engine reports: ``admit``, ``step`` (tokens and figures), then one
    ``finish`` or ``error``; both carry the request's totals (``stats`` over the request,
    ``stats_by_method`` by the drafter that proposed) when it was admitted. A msgspec
    Struct, as ``StepResult`` is: an array on the wire, untracked by the collector."""

    kind: str  # "admit" | "step" | "finish" | "error"
    step: StepResult | None = None
    finish_reason: str | None = None
    stats: SpecStats | None = None
    stats_by_method: dict[str, SpecStats] | None = None
    error: str | None = None
    # a step's ``time.monotonic()`` when the engine delivered it (a clock every process on
    # the machine shares): the time its tokens were ready, however late another process
    # reads them
    at: float | None = None


@dataclass
class Handle:
    id: int
    request: GenerationRequest
    callback: Callable[[Event], None]
    cancelled: bool = False
    error: str | None = None  # why the request failed, once it has
    sequence: Sequence | None = None
    draft_state: SeqDraftState = field(default_factory=SeqDraftState)

    def cancel(self) -> None:
        self.cancelled = True

    def report(self, event: Event) -> None:
        """Deliver an event; a callback that fails cancels its own request, nothing more."""
        try:
            self.callback(event)
        except Exception:
            self.cancelled = True


class Engine:
    def __init__(self, models: dict[str, Micro], registry: Registry, eot_id: int | None,
                 max_running: int = 16, max_waiting: int = 64, threads: int | None = None,
                 prefix_cache_bytes: int = PREFIX_CACHE_BYTES, kv_cache_dtype: str = "float32"):
        """``prefix_cache_bytes``: each model's prompt blocks kept for the next prompts
        that start with them (``engine.prefix_cache``); 0: none. ``kv_cache_dtype``: the
        KV caches' element, ``KV_CACHE_DTYPES``."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, "
                             f"got {kv_cache_dtype!r}")
        if kv_cache_dtype == "float16" and any(
                m.tok_embeddings.weight.dtype != torch.float32 for m in models.values()):
            raise ValueError("a float16 KV cache serves float32 models only")
        self.models = models
        self.registry = registry
        self.eot_id = eot_id
        self.max_running, self.max_waiting = max_running, max_waiting
        self.threads = threads
        self.kv_cache_dtype = kv_cache_dtype
        dtype = getattr(torch, kv_cache_dtype)
        self.caches = {name: KVCache(m.config, max_running, dtype=dtype)
                       for name, m in models.items()}
        self.free_slots = {name: list(range(max_running)) for name in models}
        self.prefix_caches = ({name: PrefixCache(prefix_cache_bytes) for name in models}
                              if prefix_cache_bytes > 0 else {})
        self.shared: dict[tuple[str, str], dict] = {}  # (method, model) -> drafter state
        self.checkpoint_dir = None  # where trained drafters find weights (None: the default)
        self.scheduler = DraftScheduler()
        self.prefill_tokens = PREFILL_TOKENS
        self.passes = 0  # packed passes run (for tests and the curious)
        self._threads_now: int | None = None  # what _use_threads last set
        self._pass_threads = threads or torch.get_num_threads()  # for prefill and batches
        self.compiled_ready = False  # warm_up finished
        self.compiled_error: str | None = None  # warm_up failed: eager passes only
        self._warming = False  # warm_up's thread is compiling
        self._engine_cores: set[int] | None = None  # warm_up's thread's, before it widened
        # the pass-cost tables wait for the compiled passes (a warm start loads them in
        # seconds: an eager table measured meanwhile would only slow the load down)
        self.costs_after_load = False
        self._iterating: int | None = None  # the thread that runs the iterations
        self._cost_failed: set[tuple[str, int]] = set()  # (model, compiled state)
        self.waiting: deque[Handle] = deque()
        self.running: list[Handle] = []
        self._outbox: list[tuple[Handle, Event]] = []  # this iteration's step events
        # finished sequences whose drafters are closed at the next iteration's start, after
        # their last outputs went out (``Sequence.close``)
        self._closing: list[Sequence] = []
        self._ids = itertools.count(1)
        self._cv = threading.Condition()
        self._accepting = True
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="nodraft-engine", daemon=True)

    # -- the API's side (any thread) ---------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def warm_up(self, on_done: Callable[[float], None] | None = None,
                load: Callable[[], None] | None = None) -> threading.Thread:
        """Compile the compiled models' graphs in the background (each on a scratch KV
        cache shaped like the engine's, freed afterwards); ``on_done(seconds)`` after. A
        model whose graphs fail to compile goes back to eager (``compiled_error`` says why).

        The graphs are generated for ONE thread, whatever ``threads`` is: inductor bakes
        the compiling thread's thread count into its C++ loops, and a pass of a few rows is
        too small to split -- with two threads every fused loop pays an OpenMP fork and
        join, and a lone stream decoded slower on two cores than on one
        (docs/BENCHMARKS.md). ``threads`` still serves the eager passes: prefill and the
        packed passes of a batch.

        ``load``: instead of compiling here, call it (the server's: build the graphs in a
        process of their own if this machine has none, then load them, engine.artifacts)
        and then only run what it loaded, once each -- nothing compiles in this process."""
        def work() -> None:
            torch.set_num_threads(1)
            self._warming = True
            t0 = time.perf_counter()
            # the compilers it starts (nodraft's kernels; inductor's, or the build process's)
            # yield the CPU to requests, and use every core, not the engine's alone; what
            # it times, it times on the engine's cores (``_on_engine_cores``)
            self._engine_cores = _affinity()
            as_a_build()
            # compiling is mostly Python holding the GIL; every torch call of the engine's
            # eager steps meanwhile waits for it, up to a switch interval each
            switch = sys.getswitchinterval()
            sys.setswitchinterval(WARM_UP_SWITCH_INTERVAL)
            try:
                if load is None:
                    self._compile_all()
                else:
                    self._load_all(load)
            except Exception as e:  # whatever went wrong, never "warming" for ever: eager
                log.exception("nodraft: compiled passes failed")
                self.compiled_error = self.compiled_error or f"{type(e).__name__}: {e}"
                for model in self.models.values():
                    model.compiled = None
            finally:
                sys.setswitchinterval(switch)
                self._warming = False
            self.compiled_ready = self.compiled_error is None
            if on_done is not None:
                on_done(time.perf_counter() - t0)

        thread = threading.Thread(target=work, name="nodraft-compile", daemon=True)
        thread.start()
        return thread

    def _compile_all(self) -> None:
        for name, model in self.models.items():
            compiled = model.compiled
            if compiled is None or self._stop or not self._accepting:  # stopping or draining
                continue
            scratch = self._scratch(name)
            try:
                compiled.warm_up(scratch, 0)
            except Exception as e:  # no C++ compiler, an inductor bug: serve eager
                model.compiled = None
                self.compiled_error = f"{name}: {type(e).__name__}: {e}"
            del scratch
            if model.compiled is not None:
                self._warm_up_drafters(name, model)

    def _scratch(self, name: str) -> KVCache:
        """A KV cache shaped like the engine's for ``name``: graphs are built per shape."""
        c = self.caches[name]
        return KVCache(self.models[name].config, c.n_slots, c.max_len, c.k.dtype)

    def between_requests(self, longest: float = GAP_WAIT_S) -> None:
        """Wait until no sequence runs or waits, for up to ``longest`` s: background work
        that holds the GIL a while (loading a saved graph) goes between requests, and under
        unbroken load still goes on, one piece per ``longest``."""
        if threading.get_ident() == self._iterating:  # asked by a pass itself (a drafter
            return  # loading its graphs at a request's first use): that is the gap
        end = time.monotonic() + longest
        while self.busy and not self._stop and time.monotonic() < end:
            time.sleep(0.005)

    def _load_all(self, load: Callable[[], None]) -> None:
        for model in self.models.values():
            if model.compiled is not None:
                model.compiled.between_loads = self.between_requests
        # nodraft's one-call pass for lone sequences first: its library loads in a second
        # where built, and a first start's artifact build makes it before any graph (this
        # waits on that build's lock, off the requests' thread), so lone sequences run at
        # compiled speed minutes before the graphs are ready
        for model in self.models.values():
            if model.compiled is not None and not self._stop:
                model.compiled.block_serves(compile=True)
        try:
            load()
        except Exception as e:  # the build failed: eager passes, and /health says why
            for model in self.models.values():
                model.compiled = None
            self.compiled_error = f"{type(e).__name__}: {e}"
            return
        for name, model in self.models.items():
            if model.compiled is None or self._stop or not self._accepting:
                continue
            scratch = self._scratch(name)
            self.between_requests()
            model.compiled.warm_up(scratch, 0, compile=False)
            self.between_requests()
            self._warm_up_drafters(name, model, compile=False)
            # the pass-cost table of the loaded graphs, before they are said to be ready:
            # else the first request after "ready" (auto's, or its figures) would time it
            self.between_requests()
            try:
                with self._on_engine_cores():
                    costs.measure(model, scratch, 0, costs.timing_start(scratch.max_len))
            except Exception:  # the engine's idle measurement tries again, and logs it
                log.debug("nodraft: %s's pass costs not measured after the load", name)

    @contextlib.contextmanager
    def _on_engine_cores(self):
        """This (warm-up) thread on the engine's cores meanwhile: what it times is what
        the engine's passes cost where they run."""
        if self._engine_cores is None:
            yield
            return
        wide = _affinity()
        _set_affinity(self._engine_cores)
        try:
            yield
        finally:
            _set_affinity(wide)

    def _warm_up_drafters(self, name: str, model: Micro, compile: bool = True) -> None:
        """Drafters with compiled graphs of their own (a ``warm_up(cache)`` method: EAGLE's
        draft step) compile them for their default parameters, after the target's graphs;
        other parameters compile at first use in lazy mode only, else draft eager. A
        drafter that cannot be built for this model (no trained weights) is skipped; one
        whose graphs fail to compile drafts eager, which the log says."""
        for method in self.registry.names():
            if self._stop or not self._accepting:  # a draining server compiles no more
                return
            try:
                cls = self.registry.drafter_class(method)
                if not has_hook(cls, "warm_up"):
                    continue
                env = DrafterEnv(name, model, self.shared.setdefault((method, name), {}))
                if self.checkpoint_dir is not None:
                    env.checkpoint_dir = self.checkpoint_dir
                _, params = self.registry.parse(method)
                drafter = self.registry.build(method, params, env)
            except Exception:  # not available for this model: nothing to compile
                continue
            try:
                if compile:
                    drafter.warm_up(self.caches[name])
                else:
                    drafter.warm_up(self.caches[name], compile=False)
            except Exception as e:
                log.warning("nodraft: %s's draft graphs for %s did not compile (%s: %s); it "
                            "drafts eager", method, name, type(e).__name__, e)

    def submit(self, request: GenerationRequest, callback: Callable[[Event], None]) -> Handle:
        with self._cv:
            if not self._accepting:
                raise EngineStopped("the server is shutting down")
            if len(self.running) + len(self.waiting) >= self.max_running + self.max_waiting:
                raise QueueFull(f"{len(self.running)} running and {len(self.waiting)} waiting")
            handle = Handle(next(self._ids), request, callback)
            self.waiting.append(handle)
            self._cv.notify()
        return handle

    def cancel(self, handle: Handle) -> None:
        with self._cv:
            handle.cancel()
            self._cv.notify()

    @property
    def load(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    def drain(self, timeout: float) -> bool:
        """Stop taking requests; wait up to ``timeout`` s for in-flight ones to finish."""
        with self._cv:
            self._accepting = False
            end = time.monotonic() + timeout
            while self.running or self.waiting:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def stop(self) -> None:
        with self._cv:
            self._accepting = False
            self._stop = True
            for h in list(self.waiting) + list(self.running):
                h.cancel()
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    # -- the engine thread ---------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Sequences running or waiting, or finished ones to close: ``run_once`` has work."""
        return bool(self.running or self.waiting or self._closing)

    @torch.inference_mode()
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self.busy:
                    if self.idle_work():
                        break
                    self._cv.wait(IDLE_POLL_S)
                if self._stop and not self.busy:
                    return
                idle = not self.busy
            if idle:
                self.idle()
            else:
                self.run_once()

    # -- idle work -------------------------------------------------------------------------
    def idle_work(self) -> bool:
        """Work an idle engine should do: a model's pass-cost table (``drafters.costs``)
        not measured yet, or not for its compiled graphs now that the warm-up is done."""
        return bool(self._stale_costs())

    def _stale_costs(self, defer: bool = True) -> list[str]:
        if (defer and self.costs_after_load and not self.compiled_ready
                and self.compiled_error is None):
            return []
        return [name for name, m in self.models.items()
                if (name, costs.compiled_state(m)) not in self._cost_failed
                and (costs.latest(m) is None or (not self._warming and costs.current(m) is None))]

    def idle(self, pending: Callable[[], bool] | None = None) -> None:
        """Called with nothing running: measure the stale pass-cost tables (a few dozen
        small passes each, in a free KV slot), so no request waits for them. A request
        that comes meanwhile goes first: the measurement stops between its rounds (and is
        made again when idle) -- ``pending()`` says whether one is on its way that this
        engine has not seen (the engine process's inbox)."""
        def interrupted() -> bool:
            return bool(self.running or self.waiting or (pending is not None and pending()))

        for name in self._stale_costs():
            with self._cv:
                if interrupted() or not self.free_slots[name]:
                    return
                slot = min(self.free_slots[name])
            self._measure_costs(name, slot, interrupted)

    def _measure_costs(self, name: str, slot: int, stop: Callable[[], bool] | None = None
                       ) -> costs.PassCost | None:
        """None if the passes failed (logged once per compiled state; the figures then go
        without, and requests meet the same failure as their own error), or ``stop()``
        stopped them."""
        self._use_threads(1)  # as a lone sequence's step runs
        model, cache = self.models[name], self.caches[name]
        cache.reset(slot)
        try:
            return costs.measure(model, cache, slot, costs.timing_start(cache.max_len), stop)
        except Exception:
            log.exception("nodraft: the pass costs of %s could not be measured", name)
            self._cost_failed.add((name, costs.compiled_state(model)))
            return None
        finally:
            cache.reset(slot)

    def _pass_cost(self, name: str, slot: int) -> costs.PassCost | None:
        """The latest table for this model; measured now (in ``slot``, which is about to
        be prefilled) if there is none -- an engine that never idled."""
        got = costs.latest(self.models[name])
        if (got is None and self.caches[name].max_len > costs.ROWS[-1]
                and name in self._stale_costs(defer=False)):
            got = self._measure_costs(name, slot)
        return got

    @inference
    def run_once(self) -> None:
        """One iteration: admit what fits, run one target pass per model over its running
        sequences (a lone sequence takes the single-sequence path), deliver the
        iteration's step events, then free finished and cancelled sequences. It starts
        with the drafters' close hooks of the sequences the last one finished, whose
        outputs have gone out since. In inference mode, entered here only where the caller
        is not in it already: the engine's loops run in it throughout, as a lone stream's
        iteration is one per token and entering the mode is a context object each time."""
        self._iterating = threading.get_ident()
        closing, self._closing = self._closing, []
        for seq in closing:
            seq.close()
        with self._cv:
            self._reap()
            self._admit()
            batch = list(self.running)
        by_model: dict[str, list[Handle]] = {}
        for handle in batch:
            if not handle.cancelled:
                by_model.setdefault(handle.request.model, []).append(handle)
        for name, handles in by_model.items():
            if len(handles) == 1:
                # a lone sequence's step is too small to split between threads, and so is a
                # short prompt's prefill; a long one's is not
                seq = handles[0].sequence
                long_prefill = (not seq.prefilled
                                and len(seq.prompt) >= THREADED_PREFILL_TOKENS)
                self._use_threads(self._pass_threads if long_prefill else 1)
                self._step(handles[0])
            else:
                self._use_threads(self._pass_threads)
                self._packed_pass(name, handles)
        self._deliver()
        with self._cv:
            self._reap()
            self._cv.notify_all()

    def _use_threads(self, n: int) -> None:
        """torch threads for this thread's next pass (OpenMP's count is per thread). A
        lone sequence's step runs on one: in process, two threads decoded one stream no
        faster, and served, the second thread takes the core the API process streams on
        and spins there between kernels (docs/BENCHMARKS.md, "Serving")."""
        if n != self._threads_now:
            torch.set_num_threads(n)
            self._threads_now = n

    def _admit(self) -> None:
        while self.waiting:
            handle = self.waiting[0]
            if handle.cancelled:
                self.waiting.popleft()
                self._finish(handle, "cancelled")
                continue
            name = handle.request.model
            if not self.free_slots[name]:
                break
            self.waiting.popleft()
            slot = min(self.free_slots[name])  # the lowest: packed passes read a slot range
            self.free_slots[name].remove(slot)
            try:
                handle.sequence = self._sequence(handle, slot)
                handle.draft_state = self.scheduler.state_for(handle.request.method,
                                                              handle.request.sampling.temperature)
            except Exception as e:  # a drafter that cannot be built fails its request only
                self.free_slots[name].append(slot)
                handle.report(Event("error", error=f"{type(e).__name__}: {e}"))
                continue
            self.running.append(handle)
            handle.report(Event("admit"))

    def _sequence(self, handle: Handle, slot: int) -> Sequence:
        req = handle.request
        model = self.models[req.model]
        env = DrafterEnv(req.model, model, self.shared.setdefault((req.method, req.model), {}))
        if self.checkpoint_dir is not None:
            env.checkpoint_dir = self.checkpoint_dir
        drafter = self.registry.build(req.method, req.params, env)
        stops = frozenset(req.stop_token_ids) | ({self.eot_id} if self.eot_id is not None else set())
        # a chain drafter never sends more than its num_speculative_tokens: the batch's
        # plan prices no longer draft for it
        longest = getattr(req.params, "num_speculative_tokens", None)
        seq = Sequence(model, self.caches[req.model], slot, req.prompt, drafter, req.max_tokens,
                       req.sampling, stops, req.method,
                       max_draft=min(Sequence.max_draft, longest or Sequence.max_draft),
                       logprobs=req.logprobs,
                       prompt_logprobs=req.prompt_logprobs,
                       pass_cost=self._pass_cost(req.model, slot),
                       prefix_cache=self.prefix_caches.get(req.model))
        seq.defer_close = True  # closed after its last outputs (``run_once``)
        return seq

    def _step(self, handle: Handle) -> None:
        seq = handle.sequence
        try:
            result = seq.step()
        except Exception as e:  # the target itself failed: end this request, keep serving
            self._fail(handle, e)
            return
        self._report_step(handle, result, _depth(result))

    def _packed_pass(self, name: str, handles: list[Handle]) -> None:
        """One target pass for every sequence of one model: prefill chunks and drafts."""
        t_start = time.perf_counter()
        model, cache = self.models[name], self.caches[name]
        segments: list[Segment] = []
        jobs: list[tuple[Handle, Draft | None]] = []  # None: a prefill chunk
        budget = self.prefill_tokens
        stepping: list[Handle] = []
        for h in handles:
            seq = h.sequence
            if not seq.prefilled:
                if budget > 0:  # else this pass's prefill rows are spent: the next pass
                    seg = seq.prefill_segment(budget)
                    budget -= len(seg)
                    segments.append(seg)
                    jobs.append((h, None))
                continue
            stepping.append(h)
        # a draft that would put its block, or the pass's drafted blocks, past what the
        # compiled packed pass takes costs a second, eager pass: never planned
        cap = block_cap(model, 1)
        longest = Sequence.max_draft if cap is None else cap
        plan = [(h.draft_state, h.request.method, min(h.sequence.budget(), longest))
                for h in stepping]
        limits = self.scheduler.limits(plan, len(stepping), sum(len(s) for s in segments))
        drafting = sum(1 for k in limits if k)
        cap = block_cap(model, drafting) if drafting > 1 else None
        if cap is not None:
            limits = [min(k, cap) for k in limits]
        drafting_s = 0.0
        for h, k in zip(stepping, limits):
            seq = h.sequence
            t0 = time.perf_counter()
            draft = seq.propose(k)  # k = 0: the drafter is not consulted this pass
            if seq.asked:  # consulted, and it looked (``Draft.not_looked``)
                seconds = time.perf_counter() - t0
                drafting_s += seconds
                self.scheduler.observe_propose(h.request.method, seconds)
            try:
                segments.append(seq.verify_segment(draft))
            except Exception as e:
                self._fail(h, e)
                continue
            jobs.append((h, draft))
        if not segments:
            return
        t0 = time.perf_counter()
        try:
            outputs = forward_packed(model, segments, cache)
        except Exception as e:  # the target itself failed: end these requests, keep serving
            for h, _ in jobs:
                self._fail(h, e)
            return
        decode = [len(s) for s in segments if s.logits]
        pass_s = time.perf_counter() - t0
        self.scheduler.timer.observe(len(decode), pass_s,
                                     drafted=sum(1 for n in decode if n > 1),
                                     prefill=sum(len(s) for s in segments if not s.logits),
                                     draft=sum(decode) - len(decode))
        self.passes += 1
        targets = _targets(jobs, outputs)
        for (h, draft), seg, (logits, hidden), ids in zip(jobs, segments, outputs, targets):
            seq = h.sequence
            try:
                if draft is None:  # a prompt's chunk; after its last, the first token
                    result = seq.prefill_done(seg, hidden)
                    if result is not None:
                        self._report_step(h, result, 0)
                    continue
                result = seq.finish_step(draft, logits, hidden, ids)
            except Exception as e:
                self._fail(h, e)
                continue
            # a sampled sequence's drafter asked for a draft that sent none gained nothing
            # from being asked: to the plan, a draft rejected at its first token (greedy
            # text can start a loop at any step: a greedy sequence is not held back)
            refused = seq.asked and not h.draft_state.greedy
            self._report_step(h, result, max(draft.depths(), default=int(refused)))
        if stepping:  # what a step costs a sequence besides the pass and its drafter
            self.scheduler.observe_overhead(
                (time.perf_counter() - t_start - pass_s - drafting_s) / len(stepping))

    def _report_step(self, handle: Handle, result: StepResult, depth: int) -> None:
        self.scheduler.observe(handle.draft_state, depth, result.n_accepted)
        self._outbox.append((handle, Event("step", step=result)))

    def _deliver(self) -> None:
        """The iteration's step events, in order, before any finish is reported."""
        outbox, self._outbox = self._outbox, []
        now = time.monotonic()
        for handle, event in outbox:
            event.at = now
            handle.report(event)

    def _fail(self, handle: Handle, e: Exception) -> None:
        """End one request with an error (reported, with its figures, when it is reaped)."""
        handle.sequence.finish("error")
        handle.error = f"{type(e).__name__}: {e}"

    def _reap(self) -> None:
        """Free the slots of finished and cancelled sequences; report their end."""
        keep = []
        for handle in self.running:
            seq = handle.sequence
            if handle.cancelled and not seq.done:
                seq.finish("cancelled")
            if seq.done:
                self.free_slots[handle.request.model].append(seq.slot)
                self._finish(handle, seq.finish_reason)
                self._closing.append(seq)
            else:
                keep.append(handle)
        self.running = keep

    def _finish(self, handle: Handle, reason: str) -> None:
        seq = handle.sequence
        handle.report(Event("error" if reason == "error" else "finish",
                            finish_reason=None if reason == "error" else reason,
                            stats=seq.stats if seq else SpecStats(handle.request.method),
                            stats_by_method=seq.stats_by_method if seq else {},
                            error=handle.error if reason == "error" else None))


def block_cap(model: Micro, drafting: int) -> int | None:
    """The most draft tokens each of ``drafting`` sequences' blocks may carry for a packed
    pass to run as one: ``packed_draft_cap`` for the compiled packed graphs; None (no
    bound but each drafter's own) where ``nodraft::packed_block`` runs the pass, which takes
    blocks of any size, or where the passes are eager."""
    compiled = model.compiled
    if compiled is None or compiled.block_serves():
        return None
    return packed_draft_cap(drafting)


def _targets(jobs: list[tuple[Handle, Draft | None]], outputs: list
             ) -> list[list[int] | None]:
    """Per job of a packed pass, its block rows' own tokens (``verify.accept``): greedy, the
    argmax; sampling that races (``Sequence.race_noise``), the race -- each kind taken for
    all its rows in one call, not one per sequence. None for the rest (drafts with their q
    under unseeded sampling; drafted blocks too big to race whole, or filtered by top-k or
    top-p where the race cannot filter inside: ``verify.races_whole``): ``accept`` finds
    those."""
    greedy, racing = [], []
    for j, (h, draft) in enumerate(jobs):
        if draft is None:
            continue
        if h.request.sampling.greedy:
            greedy.append(j)
        elif (h.sequence.race_noise(draft) is not None
              and races_whole(len(draft), h.request.sampling, packed=True)):
            racing.append(j)
    out: list[list[int] | None] = [None] * len(jobs)
    if greedy:
        _scatter(out, greedy, [outputs[j][0].shape[0] for j in greedy],
                 greedy_tokens(_joined([outputs[j][0] for j in greedy])))
    if racing:
        rows, noises, positions, sizes = [], [], [], []
        for j in racing:
            h, draft = jobs[j]
            n = len(draft) + 1
            lg = outputs[j][0]
            rows.append(lg if lg.shape[0] == n else lg[:n])
            sizes.append(n)
            noises += [h.sequence.race_noise(draft)] * n
            start = len(h.sequence.tokens)
            positions += [start + d for d in (0, *draft.depths())]
        blocks = [(jobs[j][0].request.sampling, n) for j, n in zip(racing, sizes)]
        _scatter(out, racing, sizes, race_blocks(_joined(rows), blocks, noises, positions))
    return out


def _joined(rows: list[Tensor]) -> Tensor:
    """The blocks' rows (T_i, V) as one (sum T_i, V) tensor: a view where they lie one after
    another in one contiguous tensor (a packed pass's logits, each block a slice), else a
    copy."""
    first = rows[0]
    if all(r.is_contiguous() for r in rows) and all(
            b.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and b.storage_offset() == a.storage_offset() + a.numel()
            for a, b in zip(rows, rows[1:])):
        n = sum(r.shape[0] for r in rows)
        return first.as_strided((n, first.shape[1]), first.stride(), first.storage_offset())
    return torch.cat(rows)


def _scatter(out: list, jobs: list[int], sizes: list[int], ids: list[int]) -> None:
    o = 0
    for j, n in zip(jobs, sizes):
        out[j], o = ids[o:o + n], o + n


def _depth(result: StepResult) -> int:
    return len(result.draft)  # chains; a tree's depth is at most its size


def _affinity() -> set[int] | None:
    """The calling thread's cores (None where the platform does not say)."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None


def _set_affinity(cores: set[int] | None) -> None:
    if cores:
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setaffinity(0, cores)
