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
either. They differ only for drafts with a distribution q. So unseeded sampling races too,
over noise drawn for the request, wherever a step's draft carries no q (or there is no
draft: most sampled tokens): one race costs fewer operations than a softmax and a
multinomial draw; a draft with its q keeps the rejection rule, which accepts more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nodraft.drafters.base import Draft
from nodraft.engine.sampling import PositionNoise, kept_kernel, native, race, race_kernel, race_numpy
from nodraft.micro import gemm


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

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p may remove tokens (each row's kept set costs a ranking)."""
        return bool(self.top_k) or self.top_p < 1.0


NUCLEUS_TOPK = (256, 1024)  # top-k sizes tried for top-p's nucleus before a full sort
# seeded verification races every row of a block up to this size in one call (each row
# costs little batched); bigger trees, and blocks whose rows top-k or top-p filter, race
# the rows the walk visits, one per emitted token
RACE_ROWS = 16


def races_whole(n_draft: int, sp: SamplingParams, packed: bool = False) -> bool:
    """Whether verification with the race races every row of a block of ``n_draft`` nodes
    at once (``RACE_ROWS``) rather than the rows its walk visits. A filtered row (top-k,
    top-p) costs more to race than the call around it, and a sampled walk seldom visits
    more than a row or two, so a lone block whose rows are filtered is walked; a ``packed``
    pass races all its sequences' rows in one call, which shares that call's cost, so there
    filtered blocks race whole too where ``nodraft::race`` filters inside
    (``engine.sampling.native``)."""
    if not n_draft:
        return True
    return n_draft < RACE_ROWS and (not sp.filters or packed and native())


def target_probs(logits: Tensor, sp: SamplingParams) -> Tensor:
    """The target's sampling distribution, rows (..., V): temperature, then top-k, then top-p
    (the tokens ``kept`` keeps, renormalised)."""
    return scaled_logits(logits, sp).softmax(-1)


def kept(scaled: Tensor, sp: SamplingParams) -> Tensor | None:
    """Bool (..., V): the tokens top-k, then top-p, keep of the rows ``scaled`` (logits
    over the temperature, float32); None when both keep every token.

    Top-p keeps the smallest prefix of the tokens, most likely first, whose probabilities
    reach ``top_p`` (never less than the most likely token); tokens as likely as its last
    are kept with it. Put another way, a token is kept iff the tokens more likely than it
    weigh less than ``top_p``; top-k, iff fewer than ``top_k`` are more likely.

    Where nodraft's kernels are loaded (``engine.sampling.native``), ``nodraft::kept``
    finds the set by a radix select (``engine.sampling.kept_kernel``). Elsewhere the prefix
    is looked for in the ``NUCLEUS_TOPK`` most likely tokens first (``topk``, cheaper than
    ranking the whole vocabulary): where it ends inside them in every row, the rest of the
    ranking cannot matter, and the result is the full sort's."""
    if sp.top_p >= 1.0 and not 0 < sp.top_k < scaled.shape[-1]:
        return None
    if native():
        return kept_kernel(scaled, sp.top_k, sp.top_p)
    keep = None
    if sp.top_k and sp.top_k < scaled.shape[-1]:
        kth = scaled.topk(sp.top_k, dim=-1).values[..., -1:]
        keep = scaled >= kth
        scaled = scaled.masked_fill(~keep, float("-inf"))
    if sp.top_p < 1.0:
        nucleus = _nucleus(scaled.softmax(-1), sp.top_p)
        keep = nucleus if keep is None else keep & nucleus
    return keep


def scaled_logits(logits: Tensor, sp: SamplingParams) -> Tensor:
    """Rows (..., V) of logits over the temperature (float32), -inf where top-k or top-p
    removed the token: what seeded sampling's race reads (``engine.sampling.race``)."""
    scaled = logits.float() / sp.temperature
    if sp.filters:
        keep = kept(scaled, sp)
        if keep is not None:
            scaled = scaled.masked_fill(~keep, float("-inf"))
    return scaled


def greedy_tokens(logits: Tensor) -> list[int]:
    """Each row's argmax of ``logits`` (R, V): ``nodraft::argmax`` where nodraft's kernels
    are loaded (the same tokens as ``torch.argmax``, the first of equal maxima, without its
    scalar reduction), else torch's."""
    if gemm.unit() is not None and logits.dtype == torch.float32:
        return torch.ops.nodraft.argmax.default(logits)
    return logits.argmax(-1).tolist()


def race_rows(logits: Tensor, sp: SamplingParams, noise: PositionNoise,
              positions: list[int]) -> list[int]:
    """The race's token at each row of ``logits`` (R, V), row r predicting sequence
    position ``positions[r]``, in one call (``race_blocks``)."""
    return race_blocks(logits, [(sp, len(positions))], [noise] * len(positions), positions)


def race_blocks(logits: Tensor, blocks: list[tuple[SamplingParams, int]],
                noises: list[PositionNoise], positions: list[int]) -> list[int]:
    """The race's token at each row of ``logits`` (R, V): consecutive blocks of rows, each
    ``(sampling, rows)``, row r racing with ``noises[r]`` at sequence position
    ``positions[r]``. One call for every row: with ``nodraft::race`` the temperature, top-k
    and top-p apply inside it; otherwise each block's logits are scaled and masked first
    (``scaled_logits``)."""
    if len(blocks) == 1:  # a lone sequence's rows: its settings repeated
        (sp, n), = blocks
        temps, top_ks, top_ps = [sp.temperature] * n, [sp.top_k] * n, [sp.top_p] * n
        filters = sp.filters
    else:
        temps = [sp.temperature for sp, n in blocks for _ in range(n)]
        top_ks = [sp.top_k for sp, n in blocks for _ in range(n)]
        top_ps = [sp.top_p for sp, n in blocks for _ in range(n)]
        filters = any(sp.filters for sp, _ in blocks)
    if not filters:
        return race(logits, noises, positions, temps)
    if native():
        return race_kernel(logits, noises, positions, temps, top_ks, top_ps)
    logits = logits.float()
    scaled, o = [], 0
    for sp, n in blocks:
        scaled.append(scaled_logits(logits[o:o + n], sp))
        o += n
    return race_numpy(torch.cat(scaled), noises, positions)


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
            return _with_ties(probs, vals, keep)
    vals, order = probs.sort(dim=-1, descending=True)
    keep = (vals.cumsum(-1) - vals) < top_p  # the smallest prefix reaching top_p
    keep[..., 0] = True  # ...and never less than the most likely token
    return _with_ties(probs, vals, keep)


def _with_ties(probs: Tensor, vals: Tensor, keep: Tensor) -> Tensor:
    """Bool (..., V): every token at least as likely as the last of ``keep``, a prefix of
    ``vals`` (probabilities, most likely first)."""
    least = vals.masked_fill(~keep, float("inf")).amin(-1, keepdim=True)
    return probs >= least


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
           pos: int = 0, targets: list[int] | None = None) -> tuple[list[int], int]:
    """(accepted node indices along the path, bonus token) for one verification block.

    ``noise``: the race's per-position noise (seeded sampling's, or an unseeded request's
    for a draft without q: ``Sequence.race_noise``), None for the rejection rule; row 0
    predicts sequence position ``pos`` and a node at depth d position ``pos + d``.
    ``targets``: each row's own token -- greedy, its argmax; racing, its race
    (``race_rows``) -- when the caller has them already (a packed pass takes them for all
    its rows at once); the walk then reads only these."""
    if logits.shape[0] == 1 and (sp.greedy or noise is not None):  # no draft: the target's
        if targets is not None:                                     # own token
            return [], targets[0]
        if sp.greedy:
            return [], greedy_tokens(logits)[0]
        return [], race_rows(logits, sp, noise, [pos])[0]
    tokens = draft.token_list
    children = children_of(draft) if len(tokens) else [[]]
    path: list[int] = []
    row = 0
    if sp.greedy or noise is not None:  # walk to the child that is the target's own token
        if targets is None and sp.greedy:
            targets = greedy_tokens(logits)
        elif targets is None and races_whole(len(tokens), sp):  # every row's race in one call
            depth = [0, *draft.depths()] if tokens else [0]
            targets = race_rows(logits, sp, noise, [pos + d for d in depth])
        if targets is not None:
            target = targets.__getitem__
        else:  # rows are visited one per emitted token, their races only
            depth = [0, *draft.depths()]
            target = lambda r: race_rows(logits[r:r + 1], sp, noise, [pos + depth[r]])[0]  # noqa: E731
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
