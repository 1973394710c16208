"""What a target pass costs on this machine, by its rows and its context: measured.

``PassCost(rows)`` is the seconds of ONE sequence's verification pass over ``rows`` rows
(the current token and its draft), timed here on the model's own graphs (compiled when
they are) at ``ROWS`` sizes and interpolated between them, then corrected by the passes
requests run (``PassCost.observe``). A table, not a line: compiled passes jump from one
row to two (another graph) and then grow with the matmuls. ``PassCost.at(context)`` prices
passes past ``context`` cached rows: every row of a pass attends to all of them, so a pass
costs more, row by row, the longer the context -- timed too (``CONTEXTS``), not assumed.

Two readers: ``auto`` prices each candidate draft with it, and the engine prices every
request's passes with it for the measured-cost speed-up (``engine.stats``). A table is
measured once per model object and compiled state (``compiled_state``) in this process:
when the model's compiled graphs change, passes cost something else.
"""

from __future__ import annotations

import statistics
import time
import weakref
from typing import Callable

import torch

ROWS = (1, 2, 3, 5, 9, 17)  # the pass sizes timed; between them, linear interpolation
MAX_ROWS = 65  # the current token and the longest draft auto sends
ROUNDS = 7  # timed runs per size
RUN = 3  # consecutive passes of one size a run: its first pays for the switch of graphs
# (its weights and code out of the caches), which a decode loop of that size does not
LEARN = 0.1  # how fast the prices follow the passes requests run
# the cached rows the engine's passes are timed past: a request's passes run past its
# prompt, and compiled graphs only past a few cached rows (micro.compiled.MIN_CONTEXT;
# shorter prefixes run eager), so a table timed at 0 priced compiled passes as eager ones
CONTEXT = 32
# cached rows past the table's start where a one-row pass and one of ``ROWS[-1]`` rows are
# timed as well (those the cache has room for): what a row's attention over a longer
# context adds, interpolated between them. Not one coefficient: past a few hundred rows the
# keys and values leave the caches and each cached row costs more (docs/LOG.md, 2026-12-06)
CONTEXTS = (96, 224, 480, 960)
CONTEXT_ROUNDS = 4  # timed runs per size at each of them


def timing_start(max_len: int) -> int:
    """Where passes are timed in a cache of ``max_len`` rows: ``CONTEXT``, or as near it as
    leaves room for the largest pass."""
    return max(0, min(CONTEXT, max_len - ROWS[-1]))


class PassCost:
    """Seconds of a target pass over ``rows`` rows: the table timed on this machine at
    ``ROWS`` sizes (interpolated; extrapolated past the largest) past ``start`` cached rows,
    plus what attending to a longer context adds (``reads``; ``at``), scaled by how the
    passes requests run compare with it (``observe``) -- one scale for one-row passes, one
    for passes of several rows (another graph), never below a one-row pass.

    The table prices passes as a loop of one size runs them. A request's passes cost
    more, and not by the same factor at every size: sampling and bookkeeping run between
    them, and a pass of several rows after one of one row (another graph) starts with its
    weights and code out of the caches. Priced by the table alone, drafts looked cheaper
    than they were, and ``auto`` drafted under sampling where drafts cost more than they
    gave."""

    def __init__(self, table: dict[int, float], start: int = CONTEXT,
                 reads: dict[int, tuple[float, float]] | None = None):
        """``table``: seconds by rows, timed past ``start`` cached rows; ``reads``: for
        more cached rows, the seconds a one-row pass takes more than there, and what each
        row of a pass of several takes more (none: every context is priced as ``start``)."""
        self.rows = sorted(table)
        self.secs = [table[r] for r in self.rows]
        # every size a draft can reach, looked up rather than interpolated per call
        self.by_rows = [self._interpolate(r) for r in range(MAX_ROWS + 1)]
        self.start = start
        points = {start: (0.0, 0.0), **{c: r for c, r in (reads or {}).items() if c > start}}
        self.contexts = sorted(points)
        self.extra = [points[c] for c in self.contexts]
        self.one_scale = 1.0  # moving averages of (a pass run) / (the table's figure):
        self.rows_scale: float | None = None  # one-row passes; several (None: none seen)

    def table(self, rows: int) -> float:
        """The timed table's figure for ``rows``."""
        return self.by_rows[rows] if rows <= MAX_ROWS else self._interpolate(rows)

    def reads(self, context: int | None) -> tuple[float, float]:
        """(a one-row pass's, each row of a longer pass's) seconds past ``context`` cached
        rows more than past ``start``: interpolated between the contexts timed, held past
        the last one's rate per cached row; zero at ``start`` and below (None: zero)."""
        cs, ex = self.contexts, self.extra
        if context is None or context <= cs[0] or len(cs) == 1:
            return 0.0, 0.0
        i = 1
        while i < len(cs) - 1 and context > cs[i]:
            i += 1
        f = (context - cs[i - 1]) / (cs[i] - cs[i - 1])  # > 1 past the last: extrapolated
        return (ex[i - 1][0] + f * (ex[i][0] - ex[i - 1][0]),
                ex[i - 1][1] + f * (ex[i][1] - ex[i - 1][1]))

    def _base(self, rows: int, context: int | None) -> float:
        """The timed figure for ``rows`` past ``context`` cached rows, before the scales."""
        one, each = self.reads(context)
        return self.table(rows) + (one if rows <= 1 else rows * each)

    def __call__(self, rows: int, context: int | None = None) -> float:
        return self.at(context)(rows)

    def at(self, context: int | None) -> Callable[[int], float]:
        """Prices of passes past ``context`` cached rows, by their rows (the scales as
        they are now): what a step that weighs drafts of several lengths asks for."""
        one_extra, each = self.reads(context)
        one = self.one_scale * (self.by_rows[1] + one_extra)
        scale = self.one_scale if self.rows_scale is None else self.rows_scale
        by_rows, table = self.by_rows, self.table

        def price(rows: int) -> float:
            if rows <= 1:
                return one
            return max(one, scale * ((by_rows[rows] if rows <= MAX_ROWS else table(rows))
                                     + rows * each))
        return price

    def observe(self, rows: int, seconds: float, context: int | None = None) -> None:
        """A request's pass of ``rows`` rows past ``context`` cached rows took ``seconds``:
        move the scale of its kind (one row, several) a step (``LEARN``) towards what it
        says. A pass counts as at most three times its price, so a preempted one moves the
        scale little."""
        ratio = seconds / self._base(rows, context)
        if rows <= 1:
            self.one_scale += LEARN * (min(ratio, 3.0 * self.one_scale) - self.one_scale)
        else:
            now = self.one_scale if self.rows_scale is None else self.rows_scale
            self.rows_scale = now + LEARN * (min(ratio, 3.0 * now) - now)

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
    model's compiled state. Runs of ``RUN`` passes of one size alternate, and each size
    keeps the median of its passes after the first of each run. (Not the fastest: a pass of
    several rows varies more than a one-row pass, and its fastest is far from its typical
    cost in a decode loop: docs/LOG.md, 2026-12-02.)
    Then passes of one row and of ``ROWS[-1]`` rows past ``start + CONTEXTS`` cached rows,
    as far as the cache has room, the same way (``CONTEXT_ROUNDS`` runs): what a longer
    context adds (``PassCost.reads``). Those rows' keys and values are whatever the slot
    holds; a pass's time does not depend on their values.
    Needs ``start + ROWS[-1] <= cache.max_len``. ``stop()``, asked between runs: give up
    (None, nothing kept), a request has come."""
    times = _timed(model, cache, slot, {start: ROWS}, ROUNDS, stop)
    if times is None:
        return None
    table = {rows: statistics.median(times[start, rows]) for rows in ROWS}
    for i in range(1, len(ROWS)):  # more rows never cost less
        table[ROWS[i]] = max(table[ROWS[i]], table[ROWS[i - 1]])
    far = [start + c for c in CONTEXTS if start + c + ROWS[-1] <= cache.max_len]
    wide = (1, ROWS[-1])
    got = _timed(model, cache, slot, {c: wide for c in far}, CONTEXT_ROUNDS, stop)
    if got is None:
        return None
    # never less at more cached rows, nor below the table's: a context's figure out of
    # order is pooled with its neighbours' (one slow run is not carried to every longer one)
    one = _rising([statistics.median(got[c, 1]) - table[1] for c in far])
    each = _rising([(statistics.median(got[c, ROWS[-1]]) - table[ROWS[-1]]) / ROWS[-1]
                    for c in far])
    cost = PassCost(table, start, {c: (a, b) for c, a, b in zip(far, one, each)})
    state = compiled_state(model)  # the state after timing (a lazy compile may have run)
    _COSTS.setdefault(model, {})[state] = cost
    _LATEST[model] = (state, cost)
    return cost


def _rising(values: list[float]) -> list[float]:
    """The closest non-decreasing, non-negative sequence to ``values`` (least squares:
    pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([max(v, 0.0), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    return [total / n for total, n in blocks for _ in range(int(n))]


def _timed(model, cache, slot: int, plan: dict[int, tuple[int, ...]], rounds: int,
           stop: Callable[[], bool] | None) -> dict[tuple[int, int], list[float]] | None:
    """Seconds of passes by (cached rows, rows) for ``plan`` (cached rows -> sizes):
    ``rounds`` runs of ``RUN`` passes of each, alternated, each run's first left out,
    after one untimed pass of each; None if ``stop()`` said so between runs."""
    times: dict[tuple[int, int], list[float]] = {
        (c, rows): [] for c, sizes in plan.items() for rows in sizes}
    with torch.inference_mode():
        for c, rows in times:  # warm-up
            model.verify_pass(torch.zeros(rows, dtype=torch.long), cache, slot, c)
        for _ in range(rounds):
            for c, rows in times:
                if stop is not None and stop():
                    return None
                x = torch.zeros(rows, dtype=torch.long)
                for i in range(RUN):
                    t0 = time.perf_counter()
                    model.verify_pass(x, cache, slot, c)
                    if i:
                        times[c, rows].append(time.perf_counter() - t0)
    return times


# per model object: measured once per process and compiled state
_COSTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LATEST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
