"""``lookahead``: lookahead decoding (Fu et al., 2024). No draft model: the target itself
generates n-grams by Jacobi iteration in the same pass that verifies earlier ones.

One target pass holds three parts (the block the engine builds is
``[current, *verification branch, *lookahead branch]``, see ``engine.sequence``):

- the **current token** c, at position n;
- the **verification branch**: up to ``guesses`` (G) n-grams from the pool that start with
  c, each ``ngram - 1`` tokens long, merged on common prefixes into a tree (the draft's
  nodes; verified like any tree, deterministic, so sampling uses the sibling rule and stays
  lossless);
- the **lookahead branch**: the Jacobi window, ``ngram - 1`` (N-1) levels of ``window``
  (W) columns, sent as ``Draft.aux``: rows the target runs but nobody verifies; their
  logits come back as ``ctx.aux_logits``.

The window (W = 3, N = 4; offsets from n; c is the current token, not an aux row)::

    offset        0    1    2    3    4
    level 0       c    a1   a2                 (a: level 0, W-1 tokens after c)
    level 1            b0   b1   b2            (level l, column i: offset l + i)
    level 2                 d0   d1   d2       (the top level; its outputs are new)

Column i is a *trajectory*: a_i, b_i, d_i (with a_0 = c) at offsets i, i+1, i+2. A row sees
the committed context, level 0 up to its column (c, a_1 .. a_i), and its own column from
level 1 up to itself -- the consecutive positions n .. n+l+i, like a normal sequence::

    aux row   sees (besides the context)
    a1        c a1
    a2        c a1 a2
    b0        c b0
    b1        c a1 b1
    b2        c a1 a2 b2
    d0        c b0 d0
    d1        c a1 b1 d1
    d2        c a1 a2 b2 d2

(the reference implementation's ``j_make_causal_mask_multilevel``: level 0 causal, every
level sees level 0 causally up to its column and the diagonal of each level below it).
The target's greedy output at d_i, o_i, continues that trajectory, so each column gives the
n-gram ``(a_i, b_i, d_i, o_i)`` of N tokens at offsets i .. i+3: harvested into the pool
under its first token. Then the levels shift (one Jacobi step): level 0 becomes
``[c', b1, b2]`` (c' the next current token in place of b0), level 1 becomes ``[d0, d1,
d2]``, the top level the outputs ``[o0, o1, o2]``. Each guess goes from level l+1 to level
l, its offset one less, so it keeps its absolute position when the step emits one token. When
it emits more (accepted draft tokens) the window is reused as it is, one step ahead, as the
reference implementation does by default (``ALWAYS_FWD_ONE``); dropping the passed columns
and refilling them at random instead (its other mode) measured no better on micro.

**Start-up**, as the reference does: level 0 is W + N - 3 tokens drawn at random from the
prompt, at offsets 1 .. W+N-3, causal; each of the next N-2 steps adds a level made of the
top level's outputs (its first column dropped), and every level drops its first column, so
after N-2 steps the window is W columns by N-1 levels. Greedy argmax drives the window
whatever the request's temperature: it only proposes; verification keeps the output exact.
Near the end of the context, when the window's rows do not fit, the step verifies only and
the window waits.

**The pool**: per sequence, first token -> the N-1 tokens after it, de-duplicated, at most
G per first token, the most recently seen kept (a seen n-gram becomes the most recent).
``seed_from_prompt`` fills it with every n-gram of the prompt at the start and adds every
n-gram of the output as it is emitted (the reference's ``POOL_FROM_PROMPT``); the window's
harvest adds to it in any case. To draft, the n-grams under c, most recent first, are merged
on common prefixes into a tree within the step's budget (parents before children). Unlike
the reference, verification starts at the first step, not once the window is full: a
seeded pool has n-grams to verify from the start.

**Draft cost**, in target-pass units. The verification branch is the verification pass, as
for every drafter (not counted). The lookahead branch is m extra rows of that same pass,
m = (N-1)·W - 1 once the window is full (W + N - 3 at the first step). By FLOPs each row is
a whole 1-token pass, so a compute-bound device pays m. micro on a CPU is far from
compute-bound: a pass over T rows takes about ``1 + ROW_COST·(T - 1)`` times a 1-token pass
(the pass-cost table of a lone sequence's pass, ``benchmarks/passes.py``: 1.13 / 1.35 /
1.63 one-row passes at 2 / 3 / 5 rows; docs/BENCHMARKS.md, "What a pass costs by its
rows"), so the model is ``cost = ROW_COST · m`` with ROW_COST = 0.16. The default window
(m = 1) costs 0.16 of a pass per step; the reference's W = 7, N = 5 (m = 27) 4.3; llama.cpp's
W = 15 (m = 59) 9.4 -- more than the curve's straight line, which rises past 5 rows.

**Defaults**: W = 1, N = 3, G = 1, the pool seeded from the prompt: the smallest step,
chosen on the workload suite (``nodraft bench --methods lookahead:window=W:ngram=N:...``;
docs/BENCHMARKS.md, "Choosing lookahead's defaults"): with a pass's every row costing
0.13-0.25 of a one-row pass, the fewest rows won in 28 of 30 rows against six other
settings, the former default (W = 2, N = 5, G = 4: up to 24 rows a step) included.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import torch
from torch import Tensor

from nodraft.drafters.base import AuxRows, Draft, DraftContext, DrafterBase, DrafterEnv
from nodraft.micro.ops import longs

ROW_COST = 0.16  # one more row in a target pass, in 1-token passes (micro, CPU, measured)


@functools.lru_cache(maxsize=256)
def window_layout(width: int, levels: int) -> tuple[Tensor, Tensor]:
    """Offsets (m,) and mask (m, 1+m) of a window of ``levels`` levels of ``width``
    columns; level 0 starts with the current token, so it has width-1 aux rows and
    m = levels·width - 1. Aux rows in order: level 0 columns 1.., then level 1, 2, ...

    Row (l, i) is at offset l + i and sees the current token (mask column 0), level 0
    columns 1..i, and column i of levels 1..l. Cached: the engine only reads them."""
    def index(l: int, i: int) -> int:  # aux row of (level l, column i); c is -1
        return i - 1 if l == 0 else width - 1 + (l - 1) * width + i

    m = levels * width - 1
    pos = torch.empty(m, dtype=torch.long)
    mask = torch.zeros(m, 1 + m, dtype=torch.bool)
    mask[:, 0] = True
    for l in range(levels):
        for i in range(1 if l == 0 else 0, width):
            r = index(l, i)
            pos[r] = l + i
            for j in range(1, i + 1):
                mask[r, 1 + index(0, j)] = True
            for k in range(1, l + 1):
                mask[r, 1 + index(k, i)] = True
    return pos, mask


def ngram_tree(grams: list[tuple[int, ...]], budget: int) -> tuple[list[int], list[int]]:
    """Merge n-grams on common prefixes: (tokens, parents) of a tree of at most ``budget``
    nodes, parents before children, in the order the n-grams come."""
    tokens: list[int] = []
    parents: list[int] = []
    node: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for gram in grams:
        parent = -1
        for t in gram:
            child = node.get((parent, t))
            if child is None:
                if len(tokens) >= budget:
                    break
                child = node[(parent, t)] = len(tokens)
                tokens.append(t)
                parents.append(parent)
            parent = child
    return tokens, parents


class NgramPool:
    """First token -> up to ``per_key`` tails (the n-gram's other tokens), most recent last."""

    def __init__(self, per_key: int):
        self.per_key = per_key
        self.tails: dict[int, dict[tuple[int, ...], None]] = {}

    def add(self, key: int, tail: tuple[int, ...]) -> None:
        d = self.tails.setdefault(key, {})
        if tail in d:  # seen again: it becomes the most recent
            del d[tail]
        d[tail] = None
        if len(d) > self.per_key:
            del d[next(iter(d))]

    def add_text(self, tokens: list[int], n: int, first_end: int = 0) -> None:
        """Every n-gram of ``tokens`` that ends at index >= first_end."""
        for end in range(max(first_end, n - 1), len(tokens)):
            self.add(tokens[end - n + 1], tuple(tokens[end - n + 2:end + 1]))

    def get(self, key: int) -> list[tuple[int, ...]]:
        """The tails under ``key``, most recent first."""
        return list(reversed(self.tails.get(key, ())))


class Lookahead(DrafterBase):
    name = "lookahead"

    @dataclass(frozen=True)
    class Params:
        window: int = 1  # W: Jacobi window columns
        ngram: int = 3  # N: n-gram size; the window has N-1 levels
        guesses: int = 1  # G: n-grams verified per step (and kept per first token)
        seed_from_prompt: bool = True  # pool the prompt's and the output's n-grams too

        def __post_init__(self):
            if not 1 <= self.window <= 32:
                raise ValueError("window must be in 1..32")
            if not 3 <= self.ngram <= 8:
                raise ValueError("ngram must be in 3..8")
            if not 1 <= self.guesses <= 64:
                raise ValueError("guesses must be in 1..64")

    def __init__(self, params: Params, env: DrafterEnv | None = None):
        self.params = params

    def _state(self, ctx: DraftContext) -> dict:
        st = ctx.state
        if "pool" not in st:
            p = self.params
            rng = random.Random(0)  # the same start for the same prompt
            prompt = ctx.tokens[:ctx.prompt_len]
            st["pool"] = NgramPool(p.guesses)
            # level 0 of the start-up window; levels 1.. follow from the target's outputs
            st["levels"] = [[rng.choice(prompt) for _ in range(p.window + p.ngram - 3)]]
            st["pending"] = None
            if p.seed_from_prompt:
                st["pool"].add_text(ctx.tokens, p.ngram)
            st["pooled"] = len(ctx.tokens)  # tokens whose n-grams are in the pool
        return st

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        st = self._state(ctx)
        grams = st["pool"].get(ctx.tokens[-1])[:self.params.guesses]
        tokens, parents = ngram_tree(grams, budget)
        levels = st["levels"]
        width = len(levels[0]) + 1
        pos, mask = window_layout(width, len(levels))
        m = pos.numel()
        room = ctx.cache.max_len - len(ctx.tokens) - len(tokens)  # rows the cache has left
        if parents == list(range(-1, len(parents) - 1)):  # a chain
            parents = None
        if m > room:  # near the end of the context: verify only, the window waits
            st["pending"] = None
            return Draft.of(tokens, parents)
        st["pending"] = m
        aux = AuxRows(longs([t for lvl in levels for t in lvl]), pos, mask)
        return Draft.of(tokens, parents, cost=ROW_COST * m, aux=aux)

    def observe(self, ctx: DraftContext, accepted: list[int]) -> None:
        st = self._state(ctx)
        m, st["pending"] = st["pending"], None
        logits = ctx.aux_logits
        if m is not None and logits is not None and logits.shape[0] == m:
            levels = st["levels"]
            top = len(levels[0]) if len(levels) == 1 else len(levels[-1])  # the top level's rows
            current = ctx.tokens[-len(accepted) - 2]  # the pass's current token
            self._jacobi_step(st, logits[m - top:].argmax(-1).tolist(), current)
        if self.params.seed_from_prompt:
            st["pool"].add_text(ctx.tokens, self.params.ngram, st["pooled"])
        st["pooled"] = len(ctx.tokens)

    def _jacobi_step(self, st: dict, top: list[int], current: int) -> None:
        """One Jacobi iteration of the window from the target's greedy outputs at the top
        level's rows, ``top``; ``current`` is the token that was current in that pass."""
        N = self.params.ngram
        levels = st["levels"]
        width = len(levels[0]) + 1
        if len(levels) < N - 1:  # start-up: add a level, drop every level's first column
            new = top if len(levels) == 1 else top[1:]
            st["levels"] = [lvl[1:] for lvl in levels] + [new]
            return
        pool = st["pool"]
        for i in range(width):  # column i: (level 0, levels 1..N-2, output) is an n-gram
            key = current if i == 0 else levels[0][i - 1]
            pool.add(key, tuple(levels[l][i] for l in range(1, N - 1)) + (top[i],))
        st["levels"] = [levels[1][1:], *levels[2:], top]
