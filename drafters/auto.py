"""``auto``: per step, the drafter and draft length with the best expected goodput.

Goodput is tokens per second, by the one model the engine's batching scheduler uses too
(``drafters.goodput``): a Beta belief over each candidate's per-token acceptance, the
expected tokens of a draft under it (``Acceptance.tokens``: while the belief is wide a
long draft is worth more than at its mean, so a fresh server does not trim its first long
matches to a few tokens while it learns), and the seconds of the pass that verifies it
from the table measured on this machine (``drafters.costs.PassCost``) plus the drafter's
own measured time plus what a drafted step costs besides its pass, more than an asked
step without a draft (``_draft_overhead``: the draft's tensor, verification's and the
commit's work on its rows -- measured on this server's lone steps beside the passes they
ran, the median over recent ones, ``DRAFT_OVERHEAD_PRIOR`` one-row passes until then).
What an asked step takes beyond its pass whether it sends a draft or not is added to plain
decoding's step and to every draft's alike (``_step_overhead``: the median over the
server's recent asked steps without a draft): the choice is between whole steps, not
passes. The candidates, and the signals each is judged on:

- ``prompt_lookup`` and ``suffix``: cheap (no model; tens of microseconds), so auto asks
  them for their draft at every step it asks (rests: below) -- that *is* the signal: no
  n-gram or suffix match, no draft. A match shorter than ``min_match`` tokens (3) is not
  drafted from, nor judged: a draft's first token is what its match length says most
  about, and after matches of one or two tokens it was accepted at most 70% of the time,
  mostly under half (warm greedy servers over the workload suite), which seldom repays a
  drafted step here -- on beliefs learnt from other text, such drafts cost requests where
  nothing gains (docs/LOG.md, "A cheaper ask; no drafts from short matches"). A match's
  draft is trimmed to the length where one more token stops paying.
- ``eagle`` and ``medusa``: when the model has trained weights. Their draft is not free
  (EAGLE runs its decoder layer ``depth`` times), so auto estimates their goodput from
  their recent acceptance (at the belief's mean: trying one costs a whole draft step) and
  measured drafting time first (one target pass until measured), and only drafts with the
  one it picks; while none is worth a draft it looks at them once every ``TRAINED_EVERY``
  asks (their beliefs move only when drafted with). On this 2-core CPU a draft step costs about a pass (EAGLE's compiled chain
  of 6), so they pay only where they are accepted far more often than at the prior's 0.5.
- ``none``: one token per 1-row pass; when nothing beats it, auto does not draft.
- **Rests where nothing pays**: after an asked step where nothing beat plain decoding,
  auto does not ask for a rest of steps that doubles after each further such step in a
  row, up to 64 sampled (``REST_MAX``) and 8 greedy (``GREEDY_REST_MAX``); sampled, a
  rest is never shorter than the steps over which the ask costs ``ASK_SHARE`` (3%) of
  their time (``_rest_floor``: what an asked step without a draft takes beyond a plain
  step, measured on this server), greedy it starts at one step. A draft that paid for its
  step starts them over. A fresh server's requests at temperature
  0.6 and above start at the longest rest (``FRESH_REST_TEMPERATURE``): on the workload
  suite no cheap drafter paid in any category at 0.7 or 1.0, and the drafts ``auto`` sent
  at 0.7 where text repeats gained about what they cost; at 0.3, where suffix decoding
  alone made 1.05-1.09x plain decoding, they start from asking. The passes it rests are
  plain decoding, and a rested step skips auto's own bookkeeping -- where no copy is
  watched for (below) and no candidate keeps per-step state, the sequence does not call
  auto at all until the rest ends (``resting``): the steps cost what plain decoding's do,
  and a batch's plan leaves them out. (In a batch the engine asks auto only at steps its
  plan gives a draft or a probe: a rest auto counts itself -- while it watches for a copy
  -- counts those asks; a rest handed to the sequence counts steps.) An asked step costs
  tens of microseconds of auto's work and a slower pass after it, on a step of a few
  hundred, and under sampling nothing pays at most steps. The rest lengths are the
  server's, per regime: a request goes on from where the server's requests left them
  since a draft last paid (``server_pause``). Where a sampled regime's are at the longest
  -- nothing paid there lately, or a fresh server from 0.6 -- a request rests its whole
  length: it is never asked and builds no candidate (a sampled rest is not watched for
  copies: below). The server learns of that regime after such a request's response instead,
  off the request's time (``_hindsight``): what the cheap candidates would have drafted
  at a few of the response's positions, scored against the tokens that followed, on at
  most ``HINDSIGHT_SHARE`` of the regime's decoding time; where such a draft would then be
  worth sending, the regime's rests start over and the next requests ask from their
  first step -- where the response's last step ran alone (in a batch, other requests
  would wait on it). (An ask every ``REST_MAX`` steps instead cost those requests about one per
  cent: docs/LOG.md, "Learning after the response".) Greedy, a copy that starts at a
  rested step would be met some steps late, so while any cheap drafter's match length is
  believed at least ``COPIES_PAY`` (a copy's first step is worth several tokens) -- this
  request's belief, or at its start the server's -- a rested step looks whether such a
  match is there (``_copy_now``: a search of the request's tokens) and asks at once if it
  is. Sampled, a rest is not watched: on a server that had served other prompts at 0.7,
  watching cost its requests 5-12% against resting unwatched (docs/LOG.md, "Learning
  after the response"). Greedy,
  copies pay and a rest's steps are a copy's first steps missed: rests as long as the
  sampled ones measured a loss there (docs/LOG.md, 2026-12-05 and 2026-12-07), short ones
  a gain where asking cost more than the drafts it found (an ask of two candidates is
  tens of microseconds of a step of a few hundred, and most of micro's greedy asks find
  matches that do not pay: docs/LOG.md, "Greedy rests of at most 8 steps").
- **The winner keeps the step**: after a cheap drafter's draft was accepted whole, the
  next step asks only that drafter (a loop being copied goes on being copied), and sends
  at least twice the length it took whole where its match gives that many -- a fresh
  request's belief would grow a copy's drafts a few tokens a step; the others are asked
  again at the first step it does not win outright.

``alpha`` is estimated per drafter, *match length* (prompt lookup's n-gram, suffix
decoding's matched suffix; ``Draft.match_len``, lengths of 8 and more together) and
*sampling regime* (``goodput.regime``: greedy, temperature up to 0.85, above): a 3-gram
match is accepted far more often than a 1-gram one, and a greedy request's acceptance says
little about a sampled one's. Each belief counts the accepted tokens and
the rejections of the request's recent steps (decayed: an exponential moving average),
starting from what earlier requests on this server counted for that key (kept per model),
scaled to ``PRIOR_STRENGTH`` pseudo-counts, so a fresh request starts informed and its own
steps soon move it; a key the server has not counted starts at weight 2
(as Beta(1, 1)), centred on what it counted of the same drafter's shorter matches in the
same regime, uniform until it counted a few (``POOLED_MIN``). A cheap drafter's chain
that auto did not send is scored too, against the tokens
the pass emitted (its matching prefix; a mismatch within them counts as a rejection), so a
drafter passed over once is not stuck at its prior. A belief not updated for a while is
pulled back towards the server-wide one, so a text that turns repetitive is noticed. The
drafters share one index of the request's tokens (``drafters.ngrams.request_index``).

Pass time as a function of rows is a table (``PassCost``: passes of 1, 2, 3, 5, 9 and 17
rows, interpolated), measured once per model at the first ``auto`` step (in that
request's own KV slot, past its committed rows; a few milliseconds) and again when the
model's compiled graphs change -- the same machine's numbers and the same graphs, not a
FLOP model -- and corrected by what the passes requests run take (``PassCost.observe``).
Drafting times are measured as auto runs.

The figures of each step are attributed to the drafter that proposed (``Draft.method``);
the draft cost is that drafter's own cost model. Lookahead decoding is not a candidate:
its Jacobi window must run in every pass to be of use, which auto cannot promise.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch

from nodraft.drafters.base import (NOT_LOOKED, Draft, DraftContext, DrafterBase, DrafterEnv,
                                  SpeculationError, close_drafter, has_hook, tree_depths)
from nodraft.drafters.registry import Registry
from nodraft.drafters.ngrams import request_index
from nodraft.drafters import costs
from nodraft.drafters.costs import _COSTS, MAX_ROWS, ROWS, PassCost  # noqa: F401 (re-exported)
from nodraft.drafters.goodput import (PRIOR_STRENGTH, SERVER_DECAY, Acceptance,
                                      best_length, regime)
from nodraft.micro.model import KVCache

CHEAP = ("prompt_lookup", "suffix")
TRAINED = ("eagle", "medusa")

MAX_MATCH = 8  # match lengths at or above this share one estimate
# where some match length's acceptance is believed at least this (a copy that starts is
# worth ~4 tokens a step), a copy's first step is worth meeting at once: a rested step
# asks where a match that long is there (``Auto._copy_now``); a trained drafter believed
# this good stops the rests
COPIES_PAY = 0.8
REST_MAX = 64  # the longest rest sampled, in steps (``Auto.propose``)
# the longest greedy: there copies pay, and a long rest missed their first steps (rests
# of up to 64 steps measured 0.96-1.11x `none` where asking at every step made 1.18-1.81x
# on repeating text; of up to 4, 8 and 16 steps, from one, 1.05x, 1.06x and 1.05x asking
# at every step over the workload suite's greedy prompts: docs/LOG.md, 2026-12-07)
GREEDY_REST_MAX = 8
# the temperature from which a fresh server's requests start at the longest rest
# (``Auto._seed``; docs/LOG.md, 2026-12-07)
FRESH_REST_TEMPERATURE = 0.6
# what a drafted step costs beyond its pass, more than an asked step without a draft (the
# draft's tensor, verification's and the commit's work on its rows), in one-row passes,
# until this server has measured it (``Auto._draft_overhead``): ~0.5 measured here
DRAFT_OVERHEAD_PRIOR = 0.5
# the share of plain decoding's time auto's asks may take where nothing pays: after an
# asked step without a draft, it rests at least long enough that asking costs no more
# (``Auto._rest_floor``), from what an asked step costs beyond a plain one
ASK_SHARE = 0.03
# that cost, in one-row passes, until this server has timed both kinds of step: ~0.6
# measured here (an ask's search over the request and its candidates' bookkeeping, and
# the pass after it finding its weights and code out of the caches)
ASK_OVERHEAD_PRIOR = 0.5
OVERHEAD_STEPS = 31  # the recent steps of each kind whose median overhead prices drafts
OVERHEAD_MIN_STEPS = 5  # of each kind, before the medians replace the prior
POOLED_MIN = 6.0  # pseudo-counts of shorter matches before a new key's prior follows them
# asks between looks at the trained candidates while none of them is worth a draft: their
# beliefs move only when drafted with, so a look finds what the last one found, and each
# look is a few microseconds of a cold step per candidate (``propose``)
TRAINED_EVERY = 8
# a sampled request that rests from its start (nothing paid lately in its regime) is not
# asked at any step: what the server learns of that regime it learns after the response, by
# asking the cheap candidates what they would have drafted at up to this many of the
# response's positions and scoring their drafts against the tokens that followed
# (``Auto._hindsight``) ...
HINDSIGHT_POINTS = 8
# ... on at most this share of the regime's plain decoding time (the server's steps)
HINDSIGHT_SHARE = 0.01
# a rest as long as the request (``Auto._seed``)
WHOLE = 1 << 40


def pass_cost(env: DrafterEnv, ctx: DraftContext | None = None) -> PassCost:
    """The pass-cost table for this model (``drafters.costs``), measured once per model
    object in this process and again when its compiled graphs change. Timed in the
    request's own KV slot, on the rows past its committed length (and past
    ``costs.CONTEXT``; scratch until verification overwrites them), so the passes timed are
    the ones that will run -- the same cache, so the same compiled graphs; a private cache
    when the slot has no room."""
    model = env.model
    got = costs.current(model)
    if got is not None:
        return got
    dtype = model.tok_embeddings.weight.dtype
    if ctx is not None:  # the request's cache, whatever its element type: its passes'
        dtype = ctx.cache.k.dtype
        # past the committed rows, and past the few rows compiled passes need
        start = max(ctx.cache.lengths[ctx.slot], costs.CONTEXT)
        if start + ROWS[-1] <= ctx.cache.max_len:
            return costs.measure(model, ctx.cache, ctx.slot, start)
    cache = KVCache(model.config, 1, max_len=min(model.config.max_positions,
                                                 costs.CONTEXT + ROWS[-1]), dtype=dtype)
    return costs.measure(model, cache, 0, costs.timing_start(cache.max_len))


class Auto(DrafterBase):
    name = "auto"
    idle_method = "none"  # passes the engine runs without asking auto are plain decoding

    @dataclass(frozen=True)
    class Params:
        candidates: str = "prompt_lookup,suffix,eagle,medusa"  # comma-separated
        num_speculative_tokens: int = 16  # the longest draft auto will send
        # the shortest match (n-gram, suffix) a cheap candidate's draft is sent from
        min_match: int = 3

        def __post_init__(self):
            names = [c.strip() for c in self.candidates.split(",") if c.strip()]
            bad = sorted(set(names) - set(CHEAP) - set(TRAINED))
            if bad or not names:
                raise ValueError(f"candidates must be among {list(CHEAP + TRAINED)}, got {bad or names}")
            if not 1 <= self.num_speculative_tokens <= MAX_ROWS - 1:
                raise ValueError(f"num_speculative_tokens must be in 1..{MAX_ROWS - 1}")
            if not 1 <= self.min_match <= 16:
                raise ValueError("min_match must be in 1..16")

    def __init__(self, params: Params, env: DrafterEnv):
        self.params = params
        self.names = [c.strip() for c in params.candidates.split(",") if c.strip()]
        # the candidates are built at the first step that asks them (``candidates``): a
        # request auto never drafts for -- most of a sampled batch's -- builds none
        self.drafters: dict[str, object] = {}
        # trained candidates with weights for this model: (method, params, env) to build them
        self.trained_params: dict[str, tuple] = {}
        self._shapes: dict[tuple, tuple[int, int]] = {}  # ``_shape``'s
        self.observers: list[str] = []  # candidates with per-step state (EAGLE's features)
        self.cheap: list[str] = []
        self.trained: list[str] = []
        self.states: dict[str, dict] = {}
        self._built = False
        self.env = env
        self.cost: PassCost | None = None  # measured at the first propose
        # server-wide acceptance per (drafter, match length), and drafting seconds
        self.global_est: dict[tuple, Acceptance] = env.shared.setdefault("auto_alpha", {})
        self.draft_seconds: dict[str, float] = env.shared.setdefault("auto_draft_seconds", {})
        self.est: dict[tuple, Acceptance] = {}  # this request's, same keys
        self.step = 0
        self._subs: dict[str, DraftContext] = {}
        self.last: tuple[tuple, int, int] | None = None  # (key, depth, rows) of the last draft
        self.proposals: dict[tuple, list[int]] = {}  # this step's cheap chains
        self.winner: str | None = None  # the cheap drafter whose last draft was accepted whole
        self.won = 0  # ... and that draft's length
        self.reg = "greedy"  # this request's sampling regime
        self.rest = 0  # steps left not to ask at (``propose``)
        self.pause = 0  # the last rest's length
        # server-wide, per sampling regime: the rest length its requests have reached since
        # a draft last paid there (a request's rests go on from it)
        self.server_pause: dict[str, int] = env.shared.setdefault("auto_pause", {})
        self.copies_pay: set[tuple] = set()  # keys believed at least COPIES_PAY
        self._wake: tuple | None = None  # ``_wake_lengths`` of copies_pay ...
        self._wake_stale = False  # ... unless copies_pay changed since
        self.seeded = False  # the request's first step has run (``_seed``)
        # server-wide: seconds recent steps took beyond their pass, asked without a draft
        # and with a cheap drafter's draft; ``_draft_overhead`` prices drafts by them
        self.overhead: dict[str, deque] = env.shared.setdefault("auto_step_overhead", {})
        self._overhead: float | None = None  # ``_draft_overhead``, until a step is timed
        self._base: float | None = None  # ``_step_overhead``, until a step is timed
        self._asked = False  # this step asked the candidates
        self._first = False  # this step is the first asked
        self._timing: tuple[int, bool] | None = None  # the last step's (rows, drafted)
        self._rested = False  # the last step was one auto did not ask at: plain decoding's
        self._floor: int | None = None  # ``_rest_floor``, until a step is timed
        self._trained_in = 0  # asks until the trained candidates are looked at again
        self.asks = 0  # this request's asked steps
        # server-wide, per sampling regime: seconds of ``_hindsight`` still to be earned
        self.hindsight_credit: dict[str, float] = env.shared.setdefault("auto_hindsight", {})
        self.resting = 0  # rested steps the sequence declines for auto (``propose``) ...
        self._quiet_from: int | None = None  # ... from the step with this many tokens

    def candidates(self, names: list[str] | None = None) -> dict[str, object]:
        """The candidate drafters built so far, the cheap ones built now if they were not
        (``names``: only these). A trained one is checked for weights and built at the
        first step auto would draft with it (``_trained``; one without weights is no longer
        a candidate from then on): until then auto reads only its parameters, and a request
        auto never drafts with it for -- most sampled ones -- neither looks for its files,
        loads its state nor has it observe every step. EAGLE then reads the features of
        the positions it did not see in one pass."""
        for name in self.names if names is None else names:
            if name in self.states:  # built, or found untrained
                continue
            sub_env = DrafterEnv(self.env.model_name, self.env.model,
                                 self.env.shared.setdefault(name, {}), self.env.checkpoint_dir)
            self.states[name] = {}
            method, sub_params = _parsed(name)
            if name in TRAINED:  # checked for weights at its first draft
                self.trained_params[name] = (method, sub_params, sub_env)
            else:
                self.drafters[name] = _CANDIDATES.build(method, sub_params, sub_env)
        if names is None:
            self._built = True
        self._refresh()
        return self.drafters

    def _refresh(self) -> None:
        # EAGLE queues the target's features every step once built; the others' indexes
        # catch up on their next propose, so a step auto does not draft costs them nothing
        self.observers = [n for n, d in self.drafters.items() if has_hook(d, "observe")]
        self.cheap = [n for n in CHEAP if n in self.drafters]
        self.trained = [n for n in TRAINED if n in self.trained_params]

    def _trained(self, name: str):
        """The trained candidate ``name``, checked for its weights and built at its first
        draft; None (and no longer a candidate) if it cannot be built for this model."""
        drafter = self.drafters.get(name)
        if drafter is None:
            method, params, env = self.trained_params[name]
            try:
                _CANDIDATES.check(method, params, env)  # trained weights present
                drafter = self.drafters[name] = _CANDIDATES.build(method, params, env)
            except SpeculationError:
                del self.trained_params[name]
                self._refresh()
                return None
            self._refresh()
        return drafter

    # -- helpers --------------------------------------------------------------------------
    def _ctx(self, ctx: DraftContext, name: str) -> DraftContext:
        """The request's context with this drafter's own state: one object per drafter,
        refreshed field by field (cheaper than ``dataclasses.replace`` per call, with
        four candidates observing every step)."""
        sub = self._subs.get(name)
        if sub is None:
            sub = self._subs[name] = copy.copy(ctx)
        else:
            sub.__dict__.update(ctx.__dict__)
        sub.state = self.states[name]
        return sub

    def _estimate(self, key: tuple) -> Acceptance:
        """This request's estimate for ``key`` (drafter, match length), first the server's
        belief scaled to ``PRIOR_STRENGTH`` pseudo-counts, its mean kept (as the batching
        scheduler starts a sequence): informed, and moved by the request's own first steps
        -- copied whole, hundreds of the server's counts kept a loop's drafts trimmed to
        the server's mean for tens of steps. Each step it is not updated it drifts 5% back
        towards the server's mean (applied when next read, its weight kept), so a text that
        turns repetitive is noticed."""
        est = self.est.get(key)
        g = self.global_est.get(key)
        if est is None:
            if g is None:
                est = self.est[key] = self._prior(key)
            else:
                w = min(1.0, PRIOR_STRENGTH / (g.accepted + g.rejected))
                est = self.est[key] = Acceptance(g.accepted * w, g.rejected * w)
            if est.alpha >= COPIES_PAY:
                self.copies_pay.add(key)
                self._wake_stale = True
        elif g is not None and est.step < self.step:
            w = 0.95 ** (self.step - est.step)
            n, mean = est.accepted + est.rejected, g.accepted / (g.accepted + g.rejected)
            est.accepted = w * est.accepted + (1 - w) * n * mean
            est.rejected = w * est.rejected + (1 - w) * n * (1 - mean)
        est.step = self.step
        return est

    def _prior(self, key: tuple) -> Acceptance:
        """The belief a key the server has not seen starts from: Beta(1, 1), centred on
        what the server believes of the same drafter's shorter matches in the same regime
        once it has counted a few of them (weight 2 still: the key's own first steps soon
        outweigh it). Uniform for every new match length, a fresh server under sampling
        tried each length's long drafts in turn, and at temperature 1.0 nearly all of them
        were rejected."""
        name, match_len, reg = key
        a = r = 0.0
        for (n, m, rg), b in self.global_est.items():
            if n == name and rg == reg and m <= match_len:
                a, r = a + b.accepted, r + b.rejected
        if a + r < POOLED_MIN:
            return Acceptance()
        return Acceptance(2.0 * a / (a + r), 2.0 * r / (a + r))

    def _observe(self, key: tuple, depth: int, accepted: int) -> None:
        est = self._estimate(key)
        est.observe(depth, accepted)
        est.step = self.step + 1  # updated this step: no drift for it
        if est.alpha >= COPIES_PAY:
            self.copies_pay.add(key)
        else:
            self.copies_pay.discard(key)
        self._wake_stale = True
        g = self.global_est.get(key)
        if g is None:
            g = self.global_est[key] = Acceptance()
        g.observe(depth, accepted, SERVER_DECAY)

    def _judged(self, key: tuple, depth: int, matched: int, known: int) -> None:
        """A draft of ``depth`` tokens that was not sent, judged against the ``known``
        tokens that followed it, its first ``matched`` right: a rejection at ``matched``
        where one was seen, else ``matched`` accepted (the rest unknown)."""
        if matched < min(depth, known):
            self._observe(key, depth, matched)
        else:
            self._observe(key, matched, matched)

    def _timed(self, name: str, ctx: DraftContext, budget: int) -> Draft:
        t0 = time.perf_counter()
        draft = self.drafters[name].propose(self._ctx(ctx, name), budget)
        dt = time.perf_counter() - t0
        old = self.draft_seconds.get(name)
        self.draft_seconds[name] = dt if old is None else 0.8 * old + 0.2 * dt
        return draft

    def _shape(self, name: str, budget: int) -> tuple[int, int]:
        """A trained candidate's (depth, draft tokens) under ``budget``, from its
        parameters (EAGLE: ``depth``, ``total_tokens``; Medusa: ``num_heads``)."""
        got = self._shapes.get((name, budget))
        if got is None:
            p = self.trained_params[name][1]
            depth = min(budget, getattr(p, "depth", None) or getattr(p, "num_heads", 4))
            rows = min(budget, max(depth, getattr(p, "total_tokens", depth) - 1))
            got = self._shapes[name, budget] = (depth, rows)
        return got

    def _priced(self, est: Acceptance, tokens: list[int], parents: list[int] | None,
                prices) -> tuple[float, int]:
        """(goodput, tokens to send) of a cheap candidate's draft: a chain trimmed to its
        best length (``best_length``, ``prices`` a function of the rows or their list), a
        tree whole."""
        if parents is None:
            return best_length(est, len(tokens), prices,
                               self._draft_overhead() + self._step_overhead())
        depth = max(tree_depths(parents))
        return self._goodput(est.tokens(depth)[depth], len(tokens), 0.0), len(tokens)

    def _goodput(self, tokens: float, rows: int, seconds: float) -> float:
        return tokens / (self.cost(1 + rows) + seconds + self._draft_overhead()
                         + self._step_overhead())

    def _learn_overhead(self, ctx: DraftContext) -> None:
        """The last step's time beyond its pass into the server's recent steps of its
        kind: an asked step's beyond the pass-cost table's figure for its pass
        (``ctx.step_seconds`` less it: ``_step_overhead``, ``_rest_floor``), and an asked
        or drafted step's beyond the pass it ran (less ``ctx.pass_seconds``:
        ``_draft_overhead``)."""
        timing, self._timing = self._timing, None
        seconds = ctx.step_seconds
        if timing is None or seconds is None or self.cost is None:
            return
        rows, drafted = timing
        if not drafted:
            self._steps("asked").append(seconds - self.cost(rows))
        if ctx.pass_seconds is not None:
            key = "drafted" if drafted else "asked_pass"
            self._steps(key).append(seconds - ctx.pass_seconds)
        self._overhead = self._floor = self._base = None

    def _steps(self, kind: str) -> deque:
        """The server's recent steps of ``kind``: their seconds beyond their pass."""
        got = self.overhead.get(kind)
        if got is None:
            got = self.overhead[kind] = deque(maxlen=OVERHEAD_STEPS)
        return got

    def _learn_plain(self, ctx: DraftContext) -> None:
        """The last step was a rested one, plain decoding's: its time beyond its pass into
        the server's recent plain steps (what an ask is priced against, ``_rest_floor``)."""
        if ctx.step_seconds is not None and self.cost is not None:
            self._steps("plain").append(ctx.step_seconds - self.cost(1))
            self._floor = None

    def _draft_overhead(self) -> float:
        """Seconds a step with a draft takes beyond its pass, more than an asked step
        without one: the difference of the two kinds' median overheads over this server's
        recent steps (``_learn_overhead``; medians, so that a step preempted on a shared
        machine, or one that found its code out of the caches, moves it little), else
        ``DRAFT_OVERHEAD_PRIOR`` one-row passes until ``OVERHEAD_MIN_STEPS`` of each kind
        are timed (a first drafted step meets code out of the caches). A step's own work
        besides its pass is not in the pass-cost table, and a draft adds to it: priced at
        zero, drafts of a token or two looked worth sending under sampling where they cost
        ~1.5 plain steps."""
        if self._overhead is None:
            drafted = self.overhead.get("drafted", ())
            asked = self.overhead.get("asked_pass", ())
            if min(len(drafted), len(asked)) >= OVERHEAD_MIN_STEPS:
                self._overhead = max(0.0, statistics.median(drafted) - statistics.median(asked))
            else:
                self._overhead = DRAFT_OVERHEAD_PRIOR * self.cost(1)
        return self._overhead

    def _step_overhead(self) -> float:
        """Seconds an asked step takes beyond its pass whether or not it sends a draft
        (sampling, verification, the commit, auto's own ask): the median over this
        server's recent asked steps without a draft (``_learn_overhead``), 0 until
        ``OVERHEAD_MIN_STEPS`` are timed. Paid by plain decoding's token and a draft's
        alike, it is in both sides of a choice: left out, a draft of a token or two was
        priced against a plain step cheaper than the step it replaced, and ``auto`` sent
        none where suffix decoding's gained (docs/LOG.md, 2026-12-07)."""
        if self._base is None:
            asked = self.overhead.get("asked", ())
            self._base = (max(0.0, statistics.median(asked))
                          if len(asked) >= OVERHEAD_MIN_STEPS else 0.0)
        return self._base

    def _rest_floor(self) -> int:
        """The shortest rest after an asked step where nothing paid: the steps over which
        the ask's cost beyond a plain step's is ``ASK_SHARE`` of their time. Its cost, the
        difference of the medians of this server's recent asked steps without a draft and
        rested ones (``_learn_overhead``, ``_learn_plain``), is ``ASK_OVERHEAD_PRIOR``
        one-row passes until ``OVERHEAD_MIN_STEPS`` of each are timed. Between 1 and
        ``REST_MAX``; greedy 1: there an ask is weighed against the copies a rest misses,
        and rests are kept short instead (``GREEDY_REST_MAX``)."""
        if self.reg == "greedy":
            return 1
        if self._floor is None:
            asked, plain = self.overhead.get("asked", ()), self.overhead.get("plain", ())
            step = self.cost(1)
            if min(len(asked), len(plain)) >= OVERHEAD_MIN_STEPS:
                extra = max(0.0, statistics.median(asked) - statistics.median(plain))
                step += max(0.0, statistics.median(plain))
            else:
                extra = ASK_OVERHEAD_PRIOR * step
            self._floor = max(1, min(REST_MAX, math.ceil(extra / (ASK_SHARE * step))))
        return self._floor

    def _wake_lengths(self) -> tuple[int, int | None] | None:
        """(L, S) for ``_copy_now``: the shortest match length of a key of one of this
        request's cheap drafters believed at least ``COPIES_PAY``, and of suffix
        decoding's (None: none is); None when no such key is, and always under sampling:
        there a rest is not watched (``propose``). Read again only after ``copies_pay``
        changed."""
        if self.reg != "greedy":
            return None
        here = stored = None
        for name, m, _ in self.copies_pay:
            if name in self.cheap and m >= self.params.min_match:
                here = m if here is None else min(here, m)
                if name == "suffix":
                    stored = m if stored is None else min(stored, m)
        return None if here is None else (here, stored)

    def _trained_copies_pay(self) -> bool:
        """Whether a trained candidate is believed at least ``COPIES_PAY``: auto then
        does not rest (its drafts cost a draft step, so no cheap search can say when to
        wake for them)."""
        return any(k[0] in TRAINED and k[0] in self.names and
                   (k[0] in self.trained_params or not self._built) for k in self.copies_pay)

    def _seed(self, ctx: DraftContext) -> None:
        """The request's first step: its candidates, its sampling regime (beliefs are kept
        per regime), the server's copies that pay (so do ours) and the server's rests,
        which go on from where its requests left them. Where a sampled regime's are at
        ``REST_MAX`` -- nothing has paid in it lately -- the request rests its whole length,
        as its first ask would most likely have found. A greedy request asks at its first
        step."""
        self.seeded = self._first = True  # the first asked step is not timed
        reg = self.reg = regime(ctx.temperature)
        self.copies_pay.update(k for k, g in self.global_est.items()
                               if k[2] == reg and g.alpha >= COPIES_PAY)
        self._wake_stale = True
        # a fresh server's requests from temperature 0.6 start at the longest rest: there
        # nothing paid at most steps, and a draft that pays ends the rests at once (``observe``)
        fresh = REST_MAX if ctx.temperature >= FRESH_REST_TEMPERATURE else 0
        self.pause = self.server_pause.get(reg, fresh)
        if self.pause >= REST_MAX and not self._trained_copies_pay():  # (never greedy)
            # the whole request, unwatched (``_wake_lengths``), its candidates unbuilt: the
            # server learns of the regime after it (``_hindsight``)
            self.rest = WHOLE
            return
        if not self._built:
            self.candidates()

    def _copy_now(self, ctx: DraftContext) -> bool:
        """Whether a match whose acceptance is believed at least ``COPIES_PAY`` is there
        at this step: the context's last L tokens occurred before (``_wake``) -- in the
        request (a search of its tokens, a few microseconds: ``RequestIndex``), or, for
        suffix decoding's keys, in its store of responses (a dict lookup first: the full
        match only where the store has the tail's last n-gram). So a rest ends at a copy's
        first step."""
        here, stored = self._wake
        tokens = ctx.tokens
        if len(tokens) <= here:
            return False
        if request_index(ctx).first_end(tokens[-here:], True) is not None:
            return True
        if stored is None or len(tokens) <= stored:
            return False
        g, tail = self.drafters["suffix"].global_index, tokens[-stored:]
        return (g.first_end(tail[-g.K:]) is not None
                and g.match(tail, stored)[1] == stored)

    # -- the drafter protocol -------------------------------------------------------------
    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        if self._quiet_from is not None:  # the steps the sequence ran without telling us
            self.step += len(ctx.tokens) - self._quiet_from  # (one token each)
            self._quiet_from = None
        if self._timing is not None:
            self._learn_overhead(ctx)
        elif self._rested:
            self._learn_plain(ctx)
        self._rested = False
        if not self.seeded:
            self._seed(ctx)
        if self.rest:  # the last asked step had nothing that could pay: not asked
            if self._wake_stale:
                self._wake, self._wake_stale = self._wake_lengths(), False
            if self._wake is None or not self._copy_now(ctx):  # unless a copy that pays starts
                self.rest -= 1  # (``observe`` left ``_asked``, ``proposals``, ``last`` empty)
                # with no copy to watch for and no candidate keeping per-step state, the
                # rest's steps need nothing of auto: the sequence declines them for it
                # (``resting``) and runs them at plain decoding's cost
                self.resting = 0
                if self.rest and self._wake is None and not self.observers:
                    self.resting, self.rest = self.rest, 0
                    self._quiet_from = len(ctx.tokens)
                self._rested = True  # the next step is timed as plain decoding's
                return NOT_LOOKED
            self.rest = 0
        if not self._built:  # rested from its start (``_seed``)
            self.candidates()
        self._asked = True
        self.asks += 1
        budget = min(budget, self.params.num_speculative_tokens)
        self.cost = pass_cost(self.env, ctx)
        if self.cheap:  # on the request's context, so every candidate reads this one
            request_index(ctx)
        reg = self.reg
        base = self._step_overhead()
        best_key, best_draft, best_g = None, None, 1.0 / (self.cost(1) + base)  # none
        self.proposals = {}
        winner, self.winner = self.winner, None
        cheap = self.cheap if winner is None else (winner,)
        prices = None  # the passes' prices up to the longest draft, listed once a step
        min_match = self.params.min_match
        for name in cheap:  # not timed: tens of microseconds, spent before any choice
            # as lists (``proposal``): a tensor is built only for the draft sent; the cheap
            # drafters keep no per-request state, so they read the request's context itself
            tokens, parents, match_len = self.drafters[name].proposal(ctx, budget)
            if not tokens or match_len < min_match:
                continue
            key = (name, min(match_len, MAX_MATCH), reg)
            est = self._estimate(key)
            if parents is None:  # a chain: trim to the best length
                self.proposals[key] = tokens
                if prices is None:
                    prices = self.cost.prices(budget + 1)
            g, k = self._priced(est, tokens, parents, prices)
            if name == winner and parents is None:  # a copy going on: at least twice the
                k = max(k, min(len(tokens), 2 * self.won))  # draft it took whole
            if g > best_g:
                best_key, best_draft, best_g = key, (tokens, parents, match_len, k), g
        looks = False
        if winner is None and self.trained:  # (0 again below if one is worth a draft)
            looks = self._trained_in == 0
            self._trained_in = TRAINED_EVERY - 1 if looks else self._trained_in - 1
        for name in self.trained if looks else ():
            key = (name, 0, reg)
            est = self._estimate(key)
            # not yet measured on this server: assume a draft step costs one target pass
            # (EAGLE's compiled chain of 6 measured ~1 pass here, Medusa's full-vocabulary
            # tree 0.7), so it is tried only when that would still pay
            seconds = self.draft_seconds.get(name)
            if seconds is None:
                seconds = self.cost(1)
            depth, rows = self._shape(name, budget)
            # valued at the belief's mean, without the optimism of a wide belief: unlike a
            # cheap drafter's chain, which is scored every step whether sent or not, a
            # trained drafter's belief is only informed by drafting with it, at a full
            # draft step's cost (EAGLE's first also reads the whole prompt into its cache)
            g = self._goodput(est.at_mean(depth), rows, seconds)
            if g > best_g and self._trained(name) is not None:
                self._trained_in = 0
                draft = self._timed(name, ctx, budget)
                if len(draft):
                    best_key, best_draft, best_g = key, draft, g
        if best_key is None:  # nothing pays: plain decoding, and its figures say so
            self.last = None
            if not self._trained_copies_pay():
                longest = GREEDY_REST_MAX if reg == "greedy" else REST_MAX
                self.rest = self.pause = self.server_pause[reg] = min(
                    max(2 * self.pause, self._rest_floor()), longest)
            return _NONE
        if isinstance(best_draft, Draft):  # a trained drafter's, sent whole
            draft = dataclasses.replace(best_draft, method=best_key[0])
            depth = max(draft.depths())
        else:  # a cheap drafter's lists, cut to the chosen length
            tokens, parents, match_len, k = best_draft
            parents = None if parents is None else parents[:k]
            draft = Draft.of(tokens[:k], parents, match_len, method=best_key[0])
            depth = k if parents is None else max(tree_depths(parents))
        self.last = (best_key, depth, len(draft))
        return draft

    def observe(self, ctx: DraftContext, accepted: list[int]) -> None:
        if not self._asked:  # a rested step: plain decoding, nothing to judge or time
            self.step += 1
            for name in self.observers:
                self.drafters[name].observe(self._ctx(ctx, name), accepted)
            return
        if self._first:  # the first asked step indexed the prompt: not a step's cost
            self._timing, self._first = None, False
        elif self.last is None:  # an asked step without a draft is timed
            self._timing = (1, False)
        else:  # a trained drafter's draft is timed apart (``draft_seconds``)
            self._timing = (1 + self.last[2], True) if self.last[0][0] in CHEAP else None
        if self.last is not None:
            key, depth, rows = self.last
            self._observe(key, depth, len(accepted))
            # a draft that paid for its step starts the rests over, the server's too
            seconds = 0.0 if key[0] in CHEAP else self.draft_seconds.get(key[0], 0.0)
            # (nothing to start over where both are at 0 already)
            if (self.pause or self.server_pause.get(self.reg) != 0) and self.cost is not None:
                base = self._step_overhead()
                if ((1 + len(accepted)) * (self.cost(1) + base)
                        > self.cost(1 + rows) + seconds + self._draft_overhead() + base):
                    self.pause = self.server_pause[self.reg] = 0
            if key[0] in CHEAP and len(accepted) == depth:  # accepted whole: it keeps the step
                self.winner, self.won = key[0], depth
        # the cheap chains not sent are judged against the tokens the pass did emit, so a
        # drafter auto passed over is still measured (else its estimate would stay at the
        # prior and it would never be picked again)
        emitted = ctx.tokens[len(ctx.tokens) - len(accepted) - 1:]
        for key, proposal in self.proposals.items():
            if self.last is not None and key[0] == self.last[0][0]:
                continue
            self._judged(key, *_matched(proposal, None, emitted), len(emitted))
        self.proposals = {}
        self.step += 1
        for name in self.observers:  # every drafter keeps its state current
            self.drafters[name].observe(self._ctx(ctx, name), accepted)
        self.last, self._asked = None, False

    def close(self, ctx: DraftContext) -> None:
        # (before the store takes the response: not its own copy), where the request's
        # last step ran alone -- in a packed pass other requests would wait on it
        if (self.seeded and not self.asks and self.reg != "greedy"
                and ctx.step_seconds is not None):
            self._hindsight(ctx)
        # a candidate that keeps what the request generated (suffix decoding's store of
        # responses) gets it even if auto never asked it
        self.candidates([n for n in self.names
                         if n in CHEAP and has_hook(_CANDIDATES.drafter_class(n), "close")])
        for name, drafter in self.drafters.items():
            close_drafter(drafter, self._ctx(ctx, name))

    def _hindsight(self, ctx: DraftContext) -> None:
        """A sampled request auto asked at no step, after its response: at up to
        ``HINDSIGHT_POINTS`` positions spread over the response, what each cheap candidate
        would have drafted there (from the tokens before it, as its ask would have), scored
        against the tokens that followed as an unsent draft is (``observe``) -- the
        accepted length of a chain drafted at a position is distributed as that matching
        prefix is, since a drafted token is kept with the probability the target samples
        it -- into the server's beliefs. Where one of those drafts would now be worth
        sending, the regime's rests start over (``server_pause``): the server's next
        requests ask from their first step. Spends at most ``HINDSIGHT_SHARE`` of the plain
        decoding time of the regime's responses (a credit per regime, earned by each
        response's tokens at a one-row pass's price, spent by the seconds this takes);
        runs after the request's last token, off its own time, and only where that token's
        step ran alone (``ctx.step_seconds``): after a packed pass, other requests' steps
        would wait on it."""
        n = len(ctx.tokens) - ctx.prompt_len  # the response, its last token included
        if n < 2:
            return
        self.cost = cost = pass_cost(self.env)
        reg = self.reg
        credit = self.hindsight_credit.get(reg, 0.0) + HINDSIGHT_SHARE * n * cost(1)
        if credit < 0.0:
            self.hindsight_credit[reg] = credit
            return
        t0 = time.perf_counter()
        names = [name for name in CHEAP if name in self.names]
        drafters = self.candidates(names)
        tokens, budget = ctx.tokens, self.params.num_speculative_tokens
        points = min(HINDSIGHT_POINTS, n - 1)
        # context lengths: the response's first token is the prefill's, so from the second
        at = sorted({ctx.prompt_len + 1 + i * (n - 2) // max(1, points - 1)
                     for i in range(points)})
        sub = copy.copy(ctx)
        sub.tokens, sub.ngrams, sub.state = [], None, {}
        drafts: dict[tuple, list] = {}
        for t in at:
            sub.tokens.extend(tokens[len(sub.tokens):t])
            after = tokens[t:]
            for name in names:
                got, parents, match_len = drafters[name].proposal(sub, budget)
                if not got or match_len < self.params.min_match:
                    continue
                key = (name, min(match_len, MAX_MATCH), reg)
                self._judged(key, *_matched(got, parents, after), len(after))
                drafts.setdefault(key, []).append((got, parents))
        # worth sending now? As the server's next request would price them: from the
        # server's beliefs at a request's strength
        self.est.clear()
        base = self._step_overhead()
        plain = 1.0 / (cost(1) + base)
        for key, seen in drafts.items():
            est = self._estimate(key)
            for got, parents in seen:
                if self._priced(est, got, parents, cost)[0] > plain:
                    self.server_pause[reg] = 0
                    break
        self.hindsight_credit[reg] = min(credit, 0.0) - (time.perf_counter() - t0)


def _matched(tokens: list[int], parents: list[int] | None, after: list[int]
             ) -> tuple[int, int]:
    """(depth, matched) of a draft against the tokens that followed it: a chain's length
    and matching prefix; a tree's depth and its path along them."""
    if parents is None:
        m, most = 0, min(len(tokens), len(after))
        while m < most and tokens[m] == after[m]:
            m += 1
        return len(tokens), m
    m, node = 0, -1
    while m < len(after):
        node = next((i for i, (u, q) in enumerate(zip(tokens, parents))
                     if q == node and u == after[m]), None)
        if node is None:
            break
        m += 1
    return max(tree_depths(parents)), m


_NONE = Draft(torch.empty(0, dtype=torch.long), method="none")
_CANDIDATES = Registry(plugins=False)  # the built-ins auto builds its candidates from


@functools.lru_cache(maxsize=None)
def _parsed(name: str) -> tuple:
    """A candidate's (method, default parameters): parsed once (``Params`` are frozen)."""
    return _CANDIDATES.parse(name)
