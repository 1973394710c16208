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
- **Origins.** Each token is reported as ``accepted`` (an accepted draft token) or
  ``bonus`` (the target's own token at the end of the pass), with each step's rejected
  draft tokens, for the playground. A token is reported once its text is released (held
  back with it), so the reported tokens' texts always concatenate to the text sent.
- **Usage.** ``completion_tokens`` counts the tokens whose text was returned: at a stop
  string, the tokens that begin before it (the one it begins inside included, the
  tokens past it not, though the engine generated them); otherwise every token emitted.

``Run.cancel`` -- a client that went away -- aborts every unfinished choice, which frees
their KV slots before the engine's next step.
"""

from __future__ import annotations

import asyncio
import codecs
from collections.abc import AsyncIterator
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

from nodraft.engine.client import EngineClient
from nodraft.engine.core import Event, GenerationRequest
from nodraft.engine.stats import SpecStats
from nodraft.micro.tokenizer import Tokenizer


class GenerationFailed(RuntimeError):
    """The engine reported an error for one of the request's sequences."""


class TextStream:
    """One choice's text: incremental UTF-8 decoding, then stop strings held back.

    Each token fed is remembered with its span of ``text`` (what it completed) and a tag;
    ``take`` hands out the tokens whose text has been released, ``returned_tokens`` counts
    the tokens whose text is (or will be) returned."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # everything decoded so far
        self.sent = 0  # len of the prefix of ``text`` already released
        self.stopped = False  # a stop string was found; nothing more is released
        self.final = False  # the sequence ended and the decoder was flushed
        self.starts: list[int] = []  # where each token's text begins in ``text``
        self.ends: list[int] = []  # and ends
        self.tags: list[Any] = []
        self.taken = 0  # tokens handed out by ``take``

    def feed(self, ids: list[int], tags: list[Any] | None = None) -> list[str]:
        """Decode ``ids`` (each with its tag, for ``take``); the text each token completed
        (possibly "": a token that ends inside a UTF-8 character)."""
        pieces = [self.decoder.decode(self.tokenizer.token_bytes(i)) for i in ids]
        at = len(self.text)
        for i, piece in enumerate(pieces):
            self.starts.append(at)
            at += len(piece)
            self.ends.append(at)
            self.tags.append((ids[i], None if tags is None else tags[i]))
        self.text += "".join(pieces)
        return pieces

    def release(self, final: bool = False) -> str:
        """Text that can be sent now: up to a stop string, or up to what might begin one.
        ``final``: the sequence has ended; flush the decoder and hold nothing back."""
        if self.stopped:
            return ""
        if final and not self.final:
            self.final = True
            self.text += self.decoder.decode(b"", final=True)
            if self.ends:  # a flushed U+FFFD belongs to the last token
                self.ends[-1] = len(self.text)
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

    @property
    def returned_tokens(self) -> int:
        """Tokens whose text is returned: after a stop string, those that begin before it;
        else every token fed."""
        if self.stopped:
            return bisect_left(self.starts, self.sent)
        return len(self.starts)

    def take(self) -> list[tuple[int, Any, str]]:
        """``(id, tag, text)`` of each token whose text has been released since the last
        call, in order; the token a stop string begins inside gets its text up to the stop,
        and tokens past a stop are never taken."""
        if self.stopped:
            last = self.returned_tokens
        elif self.final:
            last = len(self.starts)
        else:  # the tokens wholly inside the released text
            last = bisect_left(self.ends, self.sent + 1, lo=self.taken)
            if self.stops:  # one that completed nothing yet, at the end of the released
                # text, waits for its character: a stop string may begin with it
                last = min(last, bisect_left(self.starts, self.sent, lo=self.taken))
        out = [(*self.tags[i], self.text[self.starts[i]:min(self.ends[i], self.sent)])
               for i in range(self.taken, last)]
        self.taken = max(self.taken, last)
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
    # with logprobs asked for: one per token of ``text`` (the echoed prompt's included),
    # {"id", "text", "logprob" (None for the prompt's first token), "top": [(id, logprob)]}
    logprobs: list[dict] | None = None


@dataclass
class Choice:
    index: int
    request: GenerationRequest
    stream: TextStream
    rid: int | None = None  # the engine client's id, once submitted
    finish_reason: str | None = None  # set by a stop string before the engine's finish
    stats: SpecStats | None = None
    done: bool = False
    echoed: bool = False
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache supplied


class Run:
    """The sequences of one HTTP request (``n`` choices per prompt), in the engine."""

    def __init__(self, client: EngineClient, tokenizer: Tokenizer,
                 requests: list[GenerationRequest], stops: list[str], echo: bool = False):
        """``echo``: each choice's text starts with its prompt (with the prompt's logprobs
        when its request asks for ``prompt_logprobs``), sent before the first step's."""
        self.client, self.tokenizer = client, tokenizer
        self.echo = echo
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
        """Each choice's deltas as the engine reports them, until every choice is done.

        A choice's steps that are already waiting when one is read -- the engine stepped
        faster than this request's response is written -- become one delta, up to and
        including the first with a rejected draft (vLLM's output collector merges deltas
        the same way): the text is the same, in fewer chunks, so a reader that falls
        behind costs the server less per token, not more."""
        pending: tuple[int, Event] | None = None
        while not self.finished:
            if pending is None:
                index, ev = await self.queue.get()
            else:
                (index, ev), pending = pending, None
            c = self.choices[index]
            if ev.kind == "admit":
                continue
            if ev.kind == "step":
                if self.echo and not c.echoed:
                    c.echoed = True
                    yield self._echo(c, ev.step.prompt_logprobs)
                steps = [ev.step]
                # a step with a rejected draft ends a delta: the chunk's ``rejected`` is
                # what its last token replaced (the playground shows it there)
                while not steps[-1].rejected and not self.queue.empty():
                    nxt = self.queue.get_nowait()
                    if nxt[0] != index or nxt[1].kind != "step":
                        pending = nxt
                        break
                    steps.append(nxt[1].step)
                yield self._steps(c, steps)
            elif ev.kind == "finish":
                c.done, c.stats = True, ev.stats
                c.finish_reason = c.finish_reason or ev.finish_reason
                text = c.stream.release(final=True)
                taken = c.stream.take()
                yield Delta(index, text, self._origins(taken), finish_reason=c.finish_reason,
                            logprobs=self._logprobs(c, taken))
            else:
                c.done = True
                self.cancel()
                raise GenerationFailed(ev.error or "generation failed")

    def _steps(self, c: Choice, steps: list) -> Delta:
        """One delta for one or more consecutive steps of a choice."""
        if c.stream.stopped:  # cancelled at a stop string; the engine had already stepped
            return Delta(c.index, "")
        rejected = []
        for step in steps:
            if step.cached_tokens is not None:
                c.cached_tokens = step.cached_tokens
            lps = step.logprobs or [None] * len(step.tokens)
            c.stream.feed(step.tokens, [("accepted" if i < step.n_accepted else "bonus", lps[i])
                                        for i in range(len(step.tokens))])
            rejected += [{"id": t,
                          "text": self.tokenizer.token_bytes(t).decode("utf-8", "replace")}
                         for t in step.rejected]
        text = c.stream.release()
        if c.stream.stopped:
            c.finish_reason = "stop"
            self.client.abort(c.rid)
        taken = c.stream.take()
        return Delta(c.index, text, self._origins(taken), rejected,
                     logprobs=self._logprobs(c, taken))

    def _echo(self, c: Choice, prompt_logprobs: list | None) -> Delta:
        """The prompt as text (``echo``), with its tokens' logprobs when asked for: the
        first token has none; token texts are decoded incrementally (UTF-8 safe) and
        concatenate to the echoed text."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        ids = c.request.prompt
        pieces = [decoder.decode(self.tokenizer.token_bytes(t)) for t in ids]
        if pieces:
            pieces[-1] += decoder.decode(b"", final=True)
        text = "".join(pieces)
        if c.request.logprobs is None:
            return Delta(c.index, text)
        scored = [None, *(prompt_logprobs or [])]
        out = [{"id": t, "text": piece, "logprob": None if lp is None else lp[0],
                "top": None if lp is None else [tuple(x) for x in lp[1]]}
               for t, piece, lp in zip(ids, pieces, scored)]
        return Delta(c.index, text, logprobs=out)

    @staticmethod
    def _origins(taken: list) -> list[dict]:
        return [{"id": t, "text": text, "origin": tag[0]} for t, tag, text in taken]

    @staticmethod
    def _logprobs(c: Choice, taken: list) -> list[dict] | None:
        if c.request.logprobs is None:
            return None
        return [{"id": t, "text": text, "logprob": tag[1][0],
                 "top": [tuple(x) for x in tag[1][1]]} for t, tag, text in taken]

    # -- totals, once finished --------------------------------------------------------------
    def stats(self) -> SpecStats:
        """The figures summed over the choices (one choice: its own)."""
        method = self.choices[0].request.method
        total = SpecStats(method)
        for c in self.choices:
            if c.stats is not None:
                total.merge(c.stats)
        return total

    def cached_tokens(self, per_prompt: int) -> int:
        """Prompt tokens read from the prefix cache, each prompt counted once (as
        ``usage.prompt_tokens`` counts it): its first choice's, of the ``per_prompt``
        choices that share it."""
        return sum(c.cached_tokens for c in self.choices[::per_prompt])

    @property
    def completion_tokens(self) -> int:
        """Tokens returned, over the choices (``TextStream.returned_tokens``)."""
        return sum(c.stream.returned_tokens for c in self.choices)
