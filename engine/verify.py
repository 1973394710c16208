"""Acceptance: which draft tokens one target pass keeps, and the bonus token after them.

The verification block is ``[current token, *draft nodes]``; ``logits[0]`` is the target's
prediction after the current token and ``logits[1 + i]`` its prediction after node i.
A chain is the tree whose node i has parent i - 1.

Greedy (temperature 0): walk from the root; at each node, the child whose token equals the
target's argmax is accepted; where none is, the argmax itself is the bonus token. The
output is, token for token, what plain greedy decoding gives.

Sampling, with p the target's (temperature, top-k, top-p) distribution at the node:

- one child x drawn from a draft distribution q (Leviathan et al.; Chen et al.): accept with
  probability min(1, p(x) / q(x)); on rejection the bonus is drawn from
  norm(max(0, p - q)) and the walk stops;
- children without q (deterministic proposals, and every tree; EAGLE's sibling rule): try
  them in order, accepting child x with probability p(x); on rejection set p(x) = 0 and
  renormalise before the next; if all are rejected, the bonus is drawn from what is left.

Both keep the output distributed exactly as the target's: for one deterministic x,
P(y) = p(x)·[y = x] + (1 - p(x)) · p(y)·[y != x] / (1 - p(x)) = p(y).
If every step along the path is accepted, the bonus is drawn from p at the last node.

Seeded sampling (``noise`` given, see ``engine.sampling``) verifies as greedy does, against
the token the Gumbel-max race picks at each node's position instead of the argmax: the output
is then the same text under every drafter. For deterministic proposals (chains and trees)
both rules accept exactly as often: a child is on the path with probability p(x) under
either. They differ only for drafts with a distribution q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nodraft.drafters.base import Draft
from nodraft.engine.sampling import PositionNoise


GREEDY_BELOW = 1e-5  # temperatures this small are greedy (logits / 1e-300 overflow)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # below GREEDY_BELOW (0 included): greedy
    top_p: float = 1.0  # the most likely token is always kept, however small top_p is
    top_k: int = 0  # 0 = no limit
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


NUCLEUS_TOPK = (256, 1024)  # top-k sizes tried for top-p's nucleus before a full sort


def target_probs(logits: Tensor, sp: SamplingParams) -> Tensor:
    """The target's sampling distribution, rows (..., V): temperature, then top-k, then top-p.

    Top-p keeps the smallest prefix of the tokens, most likely first, whose probabilities
    reach ``top_p`` (never less than the most likely token). That prefix is looked for in
    the ``NUCLEUS_TOPK`` most likely tokens first (``topk``, cheaper than ranking the whole
    vocabulary): where it ends inside them in every row, the rest of the ranking cannot
    matter, and the result is the full sort's."""
    logits = logits.float() / sp.temperature
    if sp.top_k and sp.top_k < logits.shape[-1]:
        kth = logits.topk(sp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if sp.top_p < 1.0:
        keep = _nucleus(probs, sp.top_p)
        probs = probs.masked_fill(~keep, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _nucleus(probs: Tensor, top_p: float) -> Tensor:
    """Bool (..., V): the tokens of top-p's nucleus."""
    V = probs.shape[-1]
    for k in NUCLEUS_TOPK:
        if k >= V:
            break
        vals, order = probs.topk(k, dim=-1)  # the k most likely, most likely first
        before = vals.cumsum(-1) - vals  # the mass ranked above each
        if bool((before[..., -1] >= top_p).all()):  # the k-th is out: so is all after it
            keep = before < top_p
            keep[..., 0] = True
            return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, keep)
    vals, order = probs.sort(dim=-1, descending=True)
    keep = (vals.cumsum(-1) - vals) < top_p  # the smallest prefix reaching top_p
    keep[..., 0] = True  # ...and never less than the most likely token
    return keep.scatter(-1, order, keep)


def children_of(draft: Draft) -> list[list[int]]:
    """children[r] for block row r (0 = the current token, 1 + i = node i), in node order."""
    n = len(draft)
    children: list[list[int]] = [[] for _ in range(n + 1)]
    parents = draft.parents.tolist() if draft.parents is not None else list(range(-1, n - 1))
    for i, p in enumerate(parents):
        children[p + 1].append(i)
    return children


def _sample(p: Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=gen))


def accept(logits: Tensor, draft: Draft, sp: SamplingParams,
           gen: torch.Generator | None = None, noise: PositionNoise | None = None,
           pos: int = 0, argmax: list[int] | None = None) -> tuple[list[int], int]:
    """(accepted node indices along the path, bonus token) for one verification block.

    ``noise``: seeded sampling's per-position noise; row 0 predicts sequence position
    ``pos`` and a node at depth d position ``pos + d``. ``argmax``: each row's argmax,
    when the caller has them already (a packed pass takes them for all its rows at once);
    greedy verification reads only these."""
    if sp.greedy and logits.shape[0] == 1:  # no draft (plain decoding): the argmax
        return [], argmax[0] if argmax is not None else int(logits[0].argmax())
    tokens = draft.tokens.tolist()
    children = children_of(draft) if len(tokens) else [[]]
    path: list[int] = []
    row = 0
    if sp.greedy or noise is not None:  # walk to the child that is the target's own token
        if sp.greedy:
            target = (argmax if argmax is not None else logits.argmax(-1).tolist()).__getitem__
        else:  # rows are visited one per emitted token: their distributions only
            depth = [0, *draft.depths()] if tokens else [0]
            target = lambda r: noise.draw(target_probs(logits[r], sp), pos + depth[r])  # noqa: E731
        while True:
            want = target(row)
            nxt = next((c for c in children[row] if tokens[c] == want), None)
            if nxt is None:
                return path, want
            path.append(nxt)
            row = nxt + 1
    while True:  # each row's distribution only when the walk reaches it
        p = target_probs(logits[row], sp)
        kids = children[row]
        if not kids:
            return path, _sample(p, gen)
        if len(kids) == 1 and draft.probs is not None:  # draft distribution q: min(1, p/q)
            c = kids[0]
            x, q = tokens[c], draft.probs[c].float()
            if float(torch.rand(1, generator=gen)) * float(q[x]) < float(p[x]):
                path.append(c)
                row = c + 1
                continue
            residual = (p - q).clamp_min(0.0)
            total = float(residual.sum())
            return path, _sample(residual / total if total > 0 else p, gen)
        p_row, p = p, p.clone()
        for c in kids:  # deterministic children, the sibling rule
            x = tokens[c]
            mass = float(p.sum())
            if float(torch.rand(1, generator=gen)) * mass < float(p[x]):
                path.append(c)
                row = c + 1
                break
            p[x] = 0.0
        else:
            mass = float(p.sum())  # zero only if rounding used up the support: fall back to p
            return path, _sample(p / mass if mass > 0 else p_row, gen)
