"""From engine events to text: one HTTP request's choices, decoded as they stream.

The engine thread calls back with ``Event``s; ``Run`` hops them onto the event loop into
one queue for all of the request's choices, and turns each step's token ids into text:

- **One wake-up per batch, and none while busy.** Events cross threads through the
  loop's ``EventPump``: the engine thread appends to a list and wakes the loop
  (``call_soon_threadsafe``, a write to the loop's self-pipe) only when no hand-out is
  due, so one engine iteration over 32 streams costs one wake-up, not 32. The loop hands
  the whole list out at once, in order, and while events keep coming it collects them
  itself every ``interval`` (``--stream-interval-ms``) instead of being woken per engine
  step: a wake-up pulls the event loop onto the GIL in the middle of the engine's step.

- **UTF-8 safety.** A token may end inside a multi-byte character. Each choice decodes its
  tokens' bytes with an incremental UTF-8 decoder, so a token's text is only what completes
  a character ("" otherwise), and bytes that can never form one become U+FFFD.
- **Stop strings.** Matched on the decoded text. While streaming, text that could be the
  start of a stop string is held back until it is known not to be; when a stop string
  appears, the text ends before it, the finish reason is ``stop``, and the sequence is
  cancelled in the engine (its figures still arrive with the engine's ``finish`` event).
- **Origins.** Each step's tokens are reported as ``accepted`` (an accepted draft token)
  or ``bonus`` (the target's own token at the end of the pass), with the rejected draft
  tokens, for the playground.

``Run.cancel`` -- a client that went away -- cancels every unfinished choice, which frees
their KV slots before the engine's next step.
"""

from __future__ import annotations

import asyncio
import codecs
import threading
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from micro.tokenizer import Tokenizer
from server.engine import Engine, Event, GenerationRequest, Handle
from server.stats import SpecStats


class GenerationFailed(RuntimeError):
    """The engine reported an error for one of the request's sequences."""


class EventPump:
    """Carries (queue, item) pairs from other threads onto one event loop, in order.

    The first item after a quiet spell wakes the loop at once (``call_soon_threadsafe``),
    so a lone token is never held. After a hand-out that found items, the loop looks
    again ``interval`` seconds later on a timer of its own, and goes on so while items
    keep coming; only when a look finds none does the next item wake it again. So a busy
    engine thread never wakes the loop, and the loop runs at most once per ``interval``.
    ``interval`` 0: one hand-out per wake-up, with at most one wake-up pending.

    Why: each wake-up costs the engine's step more than the loop's own work. Measured in
    process (the server's engine, one stream, no HTTP): 1700 tokens/s; with an empty
    callback scheduled on another thread's loop per step, 1420; with ~0.1 ms of Python in
    that callback, 1050 (the loop takes the GIL whenever the engine's step lets it go).
    """

    interval = 0.0  # seconds; the server sets it from --stream-interval-ms

    _pumps: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EventPump]" = \
        weakref.WeakKeyDictionary()
    _pumps_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, object]] = []
        self._due = False  # a hand-out is scheduled (a wake-up or the loop's own timer)

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> "EventPump":
        with cls._pumps_lock:
            pump = cls._pumps.get(loop)
            if pump is None:
                pump = cls._pumps[loop] = cls(loop)
            return pump

    def post(self, queue: asyncio.Queue, item: object) -> None:
        """From any thread. Raises RuntimeError once the loop is closed."""
        with self._lock:
            self._pending.append((queue, item))
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
        for queue, item in items:
            queue.put_nowait(item)


class TextStream:
    """One choice's text: incremental UTF-8 decoding, then stop strings held back."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # everything decoded so far
        self.sent = 0  # len of the prefix of ``text`` already released
        self.stopped = False  # a stop string was found; nothing more is released

    def feed(self, ids: list[int]) -> list[str]:
        """Decode ``ids``; the text each token completed (possibly "")."""
        pieces = [self.decoder.decode(self.tokenizer.token_bytes(i)) for i in ids]
        self.text += "".join(pieces)
        return pieces

    def release(self, final: bool = False) -> str:
        """Text that can be sent now: up to a stop string, or up to what might begin one.
        ``final``: the sequence has ended; flush the decoder and hold nothing back."""
        if self.stopped:
            return ""
        if final:
            self.text += self.decoder.decode(b"", final=True)
        hit = min((i for s in self.stops if (i := self.text.find(s, self.sent)) >= 0),
                  default=-1)
        if hit >= 0:
            self.stopped = True
            end = hit
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - self._held_back()
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest unsent tail of the text that is a proper prefix of a stop
        string (it may yet become one)."""
        tail = self.text[self.sent:]
        for n in range(min(len(tail), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stops):
                return n
        return 0


@dataclass
class Delta:
    """What one choice gained: text to send, its tokens' origins, and maybe its end."""

    index: int
    text: str
    tokens: list[dict] = field(default_factory=list)  # {"id", "text", "origin"}
    rejected: list[dict] = field(default_factory=list)  # {"id", "text"}
    finish_reason: str | None = None


@dataclass
class Choice:
    index: int
    request: GenerationRequest
    stream: TextStream
    handle: Handle | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None  # set by a stop string before the engine's finish
    stats: SpecStats | None = None
    done: bool = False


class Run:
    """The sequences of one HTTP request (``n`` choices per prompt), in the engine."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer,
                 requests: list[GenerationRequest], stops: list[str]):
        self.engine, self.tokenizer = engine, tokenizer
        self.choices = [Choice(i, r, TextStream(tokenizer, stops))
                        for i, r in enumerate(requests)]
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    def start(self) -> None:
        """Submit every choice; if one is refused (queue full, draining), none runs."""
        loop = asyncio.get_running_loop()
        try:
            for c in self.choices:
                c.handle = self.engine.submit(c.request, self._callback(loop, c.index))
        except Exception:
            self.cancel()
            raise

    def _callback(self, loop: asyncio.AbstractEventLoop, index: int):
        pump = EventPump.for_loop(loop)

        def on_event(ev: Event) -> None:  # on the engine thread
            try:
                pump.post(self.queue, (index, ev))
            except RuntimeError:  # the event loop has closed: nobody is listening
                pass
        return on_event

    def cancel(self) -> None:
        for c in self.choices:
            if c.handle is not None and not c.done:
                self.engine.cancel(c.handle)

    @property
    def finished(self) -> bool:
        return all(c.done for c in self.choices)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Each choice's deltas as the engine reports them, until every choice is done."""
        while not self.finished:
            index, ev = await self.queue.get()
            c = self.choices[index]
            if ev.kind == "step":
                yield self._step(c, ev)
            elif ev.kind == "finish":
                c.done, c.stats = True, ev.stats
                c.finish_reason = c.finish_reason or ev.finish_reason
                yield Delta(index, c.stream.release(final=True), finish_reason=c.finish_reason)
            else:
                c.done = True
                self.cancel()
                raise GenerationFailed(ev.error or "generation failed")

    def _step(self, c: Choice, ev: Event) -> Delta:
        step = ev.step
        c.completion_tokens += len(step.tokens)
        if c.stream.stopped:  # cancelled at a stop string; the engine had already stepped
            return Delta(c.index, "")
        pieces = c.stream.feed(step.tokens)
        text = c.stream.release()
        if c.stream.stopped:
            c.finish_reason = "stop"
            self.engine.cancel(c.handle)
        tokens = [{"id": t, "text": p, "origin": "accepted" if i < step.n_accepted else "bonus"}
                  for i, (t, p) in enumerate(zip(step.tokens, pieces))]
        rejected = [{"id": t, "text": self.tokenizer.token_bytes(t).decode("utf-8", "replace")}
                    for t in step.rejected]
        return Delta(c.index, text, tokens, rejected)

    # -- totals, once finished --------------------------------------------------------------
    def stats(self) -> SpecStats:
        """The figures summed over the choices (one choice: its own)."""
        method = self.choices[0].request.method
        total = SpecStats(method)
        for c in self.choices:
            if c.stats is not None:
                total.merge(c.stats)
        return total

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)
