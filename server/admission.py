"""Admission in the API process: a request is refused (429) before any work is done for it.

The server holds at most ``capacity`` = ``--max-running + --max-waiting`` sequences in
flight, all models together: submitted to the engine and not yet finished, plus those
*reserved* by requests still being prepared (their text being tokenised). A request for
``k`` sequences (``n`` x prompts) is admitted only if they fit, and holds its reservation
until it has submitted them or failed; so a burst is answered at once, and no request is
tokenised only to be refused afterwards.

``Retry-After`` is an estimate from the measured drain rate: ``excess`` sequences must
finish before the refused request fits (in flight + reserved + k - capacity), and
sequences have been finishing at ``rate`` per second over the last ``WINDOW_SECONDS``
(or since start-up, if sooner), so ``ceil(excess / rate)``, clamped to ``[1,
MAX_RETRY_AFTER]`` seconds. With no sequence finished in that span, none is known to
finish sooner than the span itself: the span, rounded up, within the same bounds.

``Admission`` is also an engine-client observer (``engine.client.Observer``): it counts a
sequence in flight from ``begin`` to its ``finish`` or ``error`` event, the same events
the client's own count follows. The counters are read and written under a lock (the
in-process engine reports from its own thread).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from nodraft.engine.core import Event, GenerationRequest
from nodraft.server.errors import APIError

WINDOW_SECONDS = 30.0
MAX_RETRY_AFTER = 60


class Admission:
    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic):
        self.capacity = capacity
        self.clock = clock
        self.started = clock()
        self.in_flight = 0  # submitted to the engine, not yet finished
        self.reserved = 0  # admitted, still being prepared
        self._ends: deque[float] = deque()  # when sequences finished, within the window
        self._lock = threading.Lock()

    # -- the routes' side --------------------------------------------------------------------
    @contextmanager
    def reserve(self, sequences: int) -> Iterator[None]:
        """Hold room for ``sequences`` while the request is prepared and submitted; raises
        a 429 ``APIError`` with ``Retry-After`` at once if they do not fit."""
        with self._lock:
            excess = self.in_flight + self.reserved + sequences - self.capacity
            if excess <= 0:
                self.reserved += sequences
        if excess > 0:
            raise self.refusal(excess)
        try:
            yield
        finally:
            with self._lock:
                self.reserved -= sequences

    def refusal(self, excess: int) -> APIError:
        """The 429 for a request that needs ``excess`` more sequences to finish first."""
        wait = self.retry_after(excess)
        return APIError(429, f"the server is busy: {self.in_flight} sequences in flight and "
                        f"{self.reserved} being prepared, of {self.capacity}; retry after "
                        f"{wait} s", code="server_busy", headers={"Retry-After": str(wait)})

    def retry_after(self, excess: int) -> int:
        """Seconds until ``excess`` sequences are expected to have finished (module
        docstring), an integer in [1, MAX_RETRY_AFTER]."""
        now = self.clock()
        with self._lock:
            self._forget(now)
            finished = len(self._ends)
        span = min(WINDOW_SECONDS, now - self.started)
        wait = span if finished == 0 else excess * span / finished
        return max(1, min(MAX_RETRY_AFTER, math.ceil(wait)))

    def _forget(self, now: float) -> None:
        while self._ends and self._ends[0] < now - WINDOW_SECONDS:
            self._ends.popleft()

    # -- the engine client's observer --------------------------------------------------------
    def begin(self, rid: int, request: GenerationRequest, submitted: float) -> None:
        with self._lock:
            self.in_flight += 1

    def observe(self, rid: int, event: Event) -> None:
        if event.kind in ("finish", "error"):
            now = self.clock()
            with self._lock:
                self.in_flight -= 1
                self._ends.append(now)
                self._forget(now)

    def on_queue(self, running: int, waiting: int) -> None:
        pass

    def flush(self) -> None:
        pass


class Observers:
    """Several engine-client observers as one, called in order."""

    def __init__(self, *observers):
        self.observers = observers

    def begin(self, rid: int, request: GenerationRequest, submitted: float) -> None:
        for o in self.observers:
            o.begin(rid, request, submitted)

    def observe(self, rid: int, event: Event) -> None:
        for o in self.observers:
            o.observe(rid, event)

    def on_queue(self, running: int, waiting: int) -> None:
        for o in self.observers:
            o.on_queue(running, waiting)

    def flush(self) -> None:
        for o in self.observers:
            o.flush()
