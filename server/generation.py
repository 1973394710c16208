"""From engine events to text: one HTTP request's choices, decoded as they stream.

The engine client delivers each choice's ``Event``s on the event loop (``engine.client``);
``Run`` puts them into one queue for all of the request's choices and turns each step's
token ids into text:

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

``Run.cancel`` -- a client that went away -- aborts every unfinished choice, which frees
their KV slots before the engine's next step.
"""

from __future__ import annotations

import asyncio
import codecs
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.client import EngineClient
from engine.core import Event, GenerationRequest
from engine.stats import SpecStats
from micro.tokenizer import Tokenizer


class GenerationFailed(RuntimeError):
    """The engine reported an error for one of the request's sequences."""


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
    rid: int | None = None  # the engine client's id, once submitted
    completion_tokens: int = 0
    finish_reason: str | None = None  # set by a stop string before the engine's finish
    stats: SpecStats | None = None
    done: bool = False


class Run:
    """The sequences of one HTTP request (``n`` choices per prompt), in the engine."""

    def __init__(self, client: EngineClient, tokenizer: Tokenizer,
                 requests: list[GenerationRequest], stops: list[str]):
        self.client, self.tokenizer = client, tokenizer
        self.choices = [Choice(i, r, TextStream(tokenizer, stops))
                        for i, r in enumerate(requests)]
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    def start(self) -> None:
        """Submit every choice; if one is refused (queue full, draining), none runs."""
        try:
            for c in self.choices:
                c.rid = self.client.submit(c.request, self._deliver(c.index))
        except Exception:
            self.cancel()
            raise

    def _deliver(self, index: int):
        queue = self.queue

        def deliver(event: Event) -> None:  # on the event loop
            queue.put_nowait((index, event))
        return deliver

    def cancel(self) -> None:
        for c in self.choices:
            if c.rid is not None and not c.done:
                self.client.abort(c.rid)

    @property
    def finished(self) -> bool:
        return all(c.done for c in self.choices)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Each choice's deltas as the engine reports them, until every choice is done."""
        while not self.finished:
            index, ev = await self.queue.get()
            c = self.choices[index]
            if ev.kind == "admit":
                continue
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
            self.client.abort(c.rid)
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
