"""What a target pass costs on this machine, by its rows: a measured table.

``PassCost(rows)`` is the seconds of ONE sequence's verification pass over ``rows`` rows
(the current token and its draft), timed here on the model's own graphs (compiled when
they are) at ``ROWS`` sizes and interpolated between them. A table, not a line: compiled
passes jump from one row to two (another graph) and then grow with the matmuls.

Two readers: ``auto`` prices each candidate draft with it, and the engine prices every
request's passes with it for the measured-cost speed-up (``engine.stats``). A table is
measured once per model object and compiled state (``compiled_state``) in this process:
when the model's compiled graphs change, passes cost something else.
"""

from __future__ import annotations

import time
import weakref
from typing import Callable

import torch

ROWS = (1, 2, 3, 5, 9, 17)  # the pass sizes timed; between them, linear interpolation
MAX_ROWS = 65  # the current token and the longest draft auto sends
ROUNDS = 7  # timed passes per size (each keeps its fastest)
# the cached rows the engine's passes are timed past: a request's passes run past its
# prompt, and compiled graphs only past a few cached rows (micro.compiled.MIN_CONTEXT;
# shorter prefixes run eager), so a table timed at 0 priced compiled passes as eager ones
CONTEXT = 32


def timing_start(max_len: int) -> int:
    """Where passes are timed in a cache of ``max_len`` rows: ``CONTEXT``, or as near it as
    leaves room for the largest pass."""
    return max(0, min(CONTEXT, max_len - ROWS[-1]))


class PassCost:
    """Seconds of a target pass over ``rows`` rows, from passes timed on this machine at
    ``ROWS`` sizes and interpolated (extrapolated past the largest)."""

    def __init__(self, table: dict[int, float]):
        self.rows = sorted(table)
        self.secs = [table[r] for r in self.rows]
        # every size a draft can reach, looked up rather than interpolated per call
        self.by_rows = [self._interpolate(r) for r in range(MAX_ROWS + 1)]

    def __call__(self, rows: int) -> float:
        return self.by_rows[rows] if rows <= MAX_ROWS else self._interpolate(rows)

    def _interpolate(self, rows: int) -> float:
        r, s = self.rows, self.secs
        if rows <= r[0]:
            return s[0]
        for i in range(1, len(r)):
            if rows <= r[i]:
                return s[i - 1] + (s[i] - s[i - 1]) * (rows - r[i - 1]) / (r[i] - r[i - 1])
        return s[-1] + (s[-1] - s[-2]) * (rows - r[-1]) / (r[-1] - r[-2])


def compiled_state(model) -> int:
    """Changes when the model's compiled graphs do (then passes cost something else)."""
    return -1 if model.compiled is None else len(model.compiled._ready)


def current(model) -> PassCost | None:
    """The table measured for the model's present compiled state, if any."""
    return _COSTS.get(model, {}).get(compiled_state(model))


def latest(model) -> PassCost | None:
    """The table measured last for this model, whatever its compiled state then."""
    got = _LATEST.get(model)
    return None if got is None else got[1]


def measure(model, cache, slot: int, start: int,
            stop: Callable[[], bool] | None = None) -> PassCost | None:
    """Time passes of every ``ROWS`` size in ``cache``'s ``slot`` at positions ``start``..
    (rows the caller treats as scratch: nothing is committed) and keep the table for the
    model's compiled state. The sizes alternate and each keeps its fastest time: on a
    shared machine the minimum is the pass's own cost, a median can be another process's.
    Needs ``start + ROWS[-1] <= cache.max_len``. ``stop()``, asked between rounds: give up
    (None, nothing kept), a request has come."""
    times = {rows: float("inf") for rows in ROWS}
    with torch.inference_mode():
        for rows in times:  # warm-up
            model.verify_pass(torch.zeros(rows, dtype=torch.long), cache, slot, start)
        for _ in range(ROUNDS):
            if stop is not None and stop():
                return None
            for rows in times:
                x = torch.zeros(rows, dtype=torch.long)
                t0 = time.perf_counter()
                model.verify_pass(x, cache, slot, start)
                times[rows] = min(times[rows], time.perf_counter() - t0)
    for i in range(1, len(ROWS)):  # more rows never cost less
        times[ROWS[i]] = max(times[ROWS[i]], times[ROWS[i - 1]])
    cost = PassCost(times)
    state = compiled_state(model)  # the state after timing (a lazy compile may have run)
    _COSTS.setdefault(model, {})[state] = cost
    _LATEST[model] = (state, cost)
    return cost


# per model object: measured once per process and compiled state
_COSTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LATEST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
