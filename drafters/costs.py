"""What a target pass costs on this machine, by its rows: a measured table.

``PassCost(rows)`` is the seconds of ONE sequence's verification pass over ``rows`` rows
(the current token and its draft), timed here on the model's own graphs (compiled when
they are) at ``ROWS`` sizes and interpolated between them, then corrected by the passes
requests run (``PassCost.observe``). A table, not a line: compiled passes jump from one
row to two (another graph) and then grow with the matmuls.

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


def timing_start(max_len: int) -> int:
    """Where passes are timed in a cache of ``max_len`` rows: ``CONTEXT``, or as near it as
    leaves room for the largest pass."""
    return max(0, min(CONTEXT, max_len - ROWS[-1]))


class PassCost:
    """Seconds of a target pass over ``rows`` rows: the table timed on this machine at
    ``ROWS`` sizes (interpolated; extrapolated past the largest), scaled by how the passes
    requests run compare with it (``observe``) -- a scale for one-row passes, and one for
    each timed size of several rows, interpolated between them as the table is; never
    below a one-row pass.

    The table prices passes as a loop of one size runs them, past few cached rows. A
    request's passes cost more, and not by the same factor at every size: sampling and
    bookkeeping run between them, a pass of several rows after one of one row (another
    graph) starts with its weights and code out of the caches, and each row reads all the
    request's cached rows. Priced by the table alone, drafts looked cheaper than they
    were, and ``auto`` drafted under sampling where drafts cost more than they gave;
    priced with one scale for every size of several rows, learnt mostly from a loop's
    long drafts, short drafts looked dearer than they were, and ``auto`` sent none where
    they paid (docs/LOG.md, 2026-12-07). A size no pass of its own has taught yet is
    priced at the one-row passes' scale (the cheapest guess: a draft that then costs more
    teaches its size its price). Only the passes it prices teach it -- a plain pass and a
    chain drafted without a model (``engine.sequence.Sequence.step``): a pass after a
    drafter's own model ran, a tree's and one with lookahead's window rows cost otherwise."""

    def __init__(self, table: dict[int, float]):
        self.rows = sorted(table)
        self.secs = [table[r] for r in self.rows]
        # every size a draft can reach, looked up rather than interpolated per call
        self.by_rows = [self._interpolate(r) for r in range(MAX_ROWS + 1)]
        self.one_scale = 1.0  # moving averages of (a pass run) / (the table's figure):
        # one-row passes'; each timed size of several rows' (None: none seen near it; the
        # first entry, the one-row size's, unused)
        self.scales: list[float | None] = [None] * len(self.rows)
        self._brackets = [self._bracket(r) for r in range(MAX_ROWS + 1)]
        # ``prices``' terms for 2..MAX_ROWS rows, (lo, hi, w, table): the scale is
        # ``s[lo] + w * (s[hi] - s[lo])`` -- ``_blend``'s, to the bit (a timed size's own
        # scale as (i, i, 0.0), exactly s[i])
        self._terms = [(i, i, 0.0, t) if w == 1.0 else (i - 1, i, w, t)
                       for (i, w), t in zip(self._brackets[2:], self.by_rows[2:])]

    def _bracket(self, rows: int) -> tuple[int, float]:
        """(i, w): a pass of ``rows`` (> 1) rows is scaled by ``w`` of timed size i's scale
        and the rest by size i - 1's; past the largest size, by the largest's; between one
        row and the smallest timed size of several, by that size's."""
        r = self.rows
        if rows >= r[-1]:
            return len(r) - 1, 1.0
        i = next(i for i in range(1, len(r)) if rows <= r[i])
        if i == 1:
            return 1, 1.0
        return i, (rows - r[i - 1]) / (r[i] - r[i - 1])

    def _at(self, rows: int) -> tuple[int, float]:
        return self._brackets[rows] if rows <= MAX_ROWS else self._bracket(rows)

    def _scales(self) -> list[float]:
        """Each timed size's scale, the one-row scale where none is learnt yet."""
        one = self.one_scale
        return [one if x is None else x for x in self.scales]

    @staticmethod
    def _blend(s: list[float], i: int, w: float) -> float:
        return s[i] if w == 1.0 else s[i - 1] + w * (s[i] - s[i - 1])

    def table(self, rows: int) -> float:
        """The timed table's figure for ``rows``."""
        return self.by_rows[rows] if rows <= MAX_ROWS else self._interpolate(rows)

    def __call__(self, rows: int) -> float:
        one = self.one_scale * self.by_rows[1]
        if rows <= 1:
            return one
        return max(one, self._blend(self._scales(), *self._at(rows)) * self.table(rows))

    def prices(self, rows: int) -> list[float]:
        """``[self(r) for r in range(rows + 1)]``, at once."""
        one = self.one_scale * self.by_rows[1]
        s, out = self._scales(), [one, one]
        # ``_blend`` inlined over the terms made once (and ``max`` written out): auto reads
        # this at every ask
        for lo, hi, w, t in self._terms[:max(0, rows - 1)]:
            x = (s[lo] + w * (s[hi] - s[lo])) * t
            out.append(x if x > one else one)
        for r in range(MAX_ROWS + 1, rows + 1):  # past the terms: as a call prices it
            out.append(self(r))
        return out if rows else out[:1]

    def observe(self, rows: int, seconds: float) -> None:
        """A request's pass of ``rows`` rows took ``seconds``: move the scale of its size
        a step (``LEARN``) towards what it says -- for a size between two timed ones, each
        of theirs by its share. A pass counts as at most three times its price, so a
        preempted one moves the scales little."""
        ratio = seconds / self.table(rows)
        if rows <= 1:
            self.one_scale += LEARN * (min(ratio, 3.0 * self.one_scale) - self.one_scale)
            return
        i, w = self._at(rows)
        for j, share in ((i, w), (i - 1, 1.0 - w)):
            if share > 0.0:
                now = self.one_scale if self.scales[j] is None else self.scales[j]
                self.scales[j] = now + share * LEARN * (min(ratio, 3.0 * now) - now)
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
    Needs ``start + ROWS[-1] <= cache.max_len``. ``stop()``, asked between rounds: give up
    (None, nothing kept), a request has come."""
    times: dict[int, list[float]] = {rows: [] for rows in ROWS}
    with torch.inference_mode():
        for rows in times:  # warm-up
            model.verify_chain([0] * rows, cache, slot, start)
        for _ in range(ROUNDS):
            if stop is not None and stop():
                return None
            for rows in times:
                x = [0] * rows  # a chain: as a lone sequence's steps and chains are run
                for i in range(RUN):
                    t0 = time.perf_counter()
                    model.verify_chain(x, cache, slot, start)
                    if i:
                        times[rows].append(time.perf_counter() - t0)
    table = {rows: statistics.median(t) for rows, t in times.items()}
    for i in range(1, len(ROWS)):  # more rows never cost less
        table[ROWS[i]] = max(table[ROWS[i]], table[ROWS[i - 1]])
    cost = PassCost(table)
    state = compiled_state(model)  # the state after timing (a lazy compile may have run)
    _COSTS.setdefault(model, {})[state] = cost
    _LATEST[model] = (state, cost)
    return cost


# per model object: measured once per process and compiled state
_COSTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LATEST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
