"""``suffix``: suffix decoding (Oliaro et al., 2024). Draft cost 0: no model runs.

Two suffix structures, both read as depth-limited suffix trees (every substring of up
to ``max_depth`` tokens, with occurrence counts), both kept as a ``SuffixIndex``:

- the request's own, over its prompt and output, extended as tokens arrive;
- a global one over previous responses, shared by all requests on this server and model,
  bounded to ``max_cached_responses`` (the oldest response leaves first) and indexed when
  it is read (``ResponseStore``: a server that never drafts from it pays little for it).

To draft, match the longest suffix of the context (up to ``max_depth // 2`` tokens, so a
match leaves at least as many levels of the depth-limited tree below it to draft from),
then grow a *tree* best-first from the matched node: a child's estimated probability is
its parent's times count(child) / the sum of its siblings' counts, nodes are added while
that stays at or above ``min_token_prob``, and the tree holds at most
``max_spec_factor * match_length`` nodes (the draft grows with the match length), within
the step's budget. Of the two structures' trees the one with the larger expected accepted
length (the sum of its node probabilities) is proposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodraft.drafters.base import Draft, DraftContext, DrafterBase, DrafterEnv
from nodraft.drafters.ngrams import ResponseStore, SuffixIndex, request_index


class SuffixDecoding(DrafterBase):
    name = "suffix"

    @dataclass(frozen=True)
    class Params:
        max_depth: int = 32
        max_spec_factor: float = 1.0
        min_token_prob: float = 0.1
        max_cached_responses: int = 256
        num_speculative_tokens: int = 16

        def __post_init__(self):
            if not 2 <= self.max_depth <= 64:
                raise ValueError("max_depth must be in 2..64")
            if not 0.0 < self.min_token_prob <= 1.0:
                raise ValueError("min_token_prob must be in (0, 1]")
            if not 0.0 < self.max_spec_factor <= 16.0:
                raise ValueError("max_spec_factor must be in (0, 16]")
            if not 0 <= self.max_cached_responses <= 100_000:
                raise ValueError("max_cached_responses must be in 0..100000")
            if not 1 <= self.num_speculative_tokens <= 64:
                raise ValueError("num_speculative_tokens must be in 1..64")

    def __init__(self, params: Params, env: DrafterEnv):
        self.params = params
        # The store is shared by every request of this model; the server's engine thread is
        # its only user, so it needs no lock.
        self.store: ResponseStore = env.shared.setdefault("suffix_global", ResponseStore())

    @property
    def global_index(self) -> SuffixIndex:
        """The store of previous responses, indexed (``ResponseStore.index``)."""
        return self.store.index

    def proposal(self, ctx: DraftContext, budget: int
                 ) -> tuple[list[int], list[int] | None, int]:
        """The draft as lists: (tokens, parents -- None for a chain, the match length; no
        tokens without a match). ``auto`` reads this, and builds a ``Draft`` only of the
        proposal it sends."""
        p = self.params
        tokens, max_len = ctx.tokens, p.max_depth // 2

        def limit(m: int) -> int:  # the draft grows with the match length
            return min(budget, p.num_speculative_tokens, max(1, int(p.max_spec_factor * m)))

        best = None
        for index in (request_index(ctx), self.global_index):
            cand = index.draft(tokens, max_len, limit, p.min_token_prob, p.max_depth)
            if cand is not None and (best is None or cand[2] > best[2]):
                best = cand
        if best is None:
            return [], None, 0
        tokens, parents, _, m = best
        chain = parents == list(range(-1, len(parents) - 1))
        return tokens, None if chain else parents, m

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        return Draft.of(*self.proposal(ctx, budget))

    def close(self, ctx: DraftContext) -> None:
        """Keep the finished response in the store, evicting the oldest beyond the cap;
        it is indexed when the store is next read (``ResponseStore``)."""
        self.store.keep(ctx.tokens[ctx.prompt_len:], self.params.max_cached_responses)
