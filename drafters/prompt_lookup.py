"""``prompt_lookup`` (alias ``ngram``): propose what followed the context's last n-gram
earlier in the context (Saxena, 2023). Draft cost 0: it runs no model.

For n = ngram_max down to ngram_min, find an earlier occurrence of the last n tokens and
propose the tokens that followed it: up to ``num_speculative_tokens`` for a full-length
(``ngram_max``) match, at most ``2**n`` for a shorter one (weaker evidence: a lone repeated
token is weak). Worked example, with ngram_max = 3 and tokens ``[a b c d a b]`` (current
token ``b``, index 5): the 3-gram ``[d a b]`` never occurred before; the 2-gram ``[a b]``
ends at index 1, so the draft is ``tokens[2:2 + 4] = [c d a b]``.

Matches are searched for in the request's tokens, kept as bytes (``request_index``, shared
with suffix decoding): one C search per n-gram length tried. Defaults
chosen by measurement (``benchmarks/prompt_lookup.py``, results in docs/BENCHMARKS.md):
the **first** match (``match="first"``) and **16** tokens. On micro's repeating prompt
the first occurrence is the passage being copied, where the most recent one is often a
repeated phrase inside it (6.40 tokens per pass against 3.05); where micro's own output
falls into a short loop, the first occurrence also leaves the longest run to copy; on an
edited copy the two tie. Longer drafts pay wherever a match holds (fresh prompt: 5.82
tokens per pass at 8, 8.00 at 16); a full-length miss costs a pass over 17 rows instead
of 9. Following the previous draft's source (continue the copy where the last draft
ended) was measured too and changed nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodraft.drafters.base import Draft, DraftContext, DrafterBase, DrafterEnv
from nodraft.drafters.ngrams import SuffixIndex, request_index


class PromptLookup(DrafterBase):
    name = "prompt_lookup"

    @dataclass(frozen=True)
    class Params:
        num_speculative_tokens: int = 16
        ngram_max: int = 3
        ngram_min: int = 1
        match: str = "first"  # "first" | "recent"

        def __post_init__(self):
            if not 1 <= self.num_speculative_tokens <= 64:
                raise ValueError("num_speculative_tokens must be in 1..64")
            if not 1 <= self.ngram_min <= self.ngram_max <= 16:
                raise ValueError("need 1 <= ngram_min <= ngram_max <= 16")
            if self.match not in ("recent", "first"):
                raise ValueError("match must be 'recent' or 'first'")

    def __init__(self, params: Params, env: DrafterEnv | None = None):
        self.params = params

    def find(self, tokens: list[int], index: SuffixIndex, budget: int
             ) -> tuple[list[int], int]:
        """(the draft, the length of the n-gram it matched; 0 without a match), from
        ``index`` over ``tokens``."""
        p = self.params
        recent = p.match == "recent"
        for n in range(min(p.ngram_max, len(tokens)), p.ngram_min - 1, -1):
            end = index.first_end(tokens[-n:], recent)
            if end is not None:
                # a full-length match proposes all it may; a shorter one, weaker evidence,
                # at most 2**n tokens
                k = min(p.num_speculative_tokens, budget,
                        p.num_speculative_tokens if n == p.ngram_max else 2 ** n)
                return tokens[end + 1:end + 1 + k], n
        return [], 0

    def proposal(self, ctx: DraftContext, budget: int) -> tuple[list[int], None, int]:
        """The draft as lists: (tokens, parents -- None: a chain, the match length).
        ``auto`` reads this, and builds a ``Draft`` only of the proposal it sends."""
        draft, n = self.find(ctx.tokens, request_index(ctx, self.params.ngram_max), budget)
        return draft, None, n

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        return Draft.of(*self.proposal(ctx, budget))

