"""``prompt_lookup`` (alias ``ngram``): propose what followed the context's last n-gram
earlier in the context (Saxena, 2023). Draft cost 0: it runs no model.

For n = ngram_max down to ngram_min, find an earlier occurrence of the last n tokens and
propose the tokens that followed it: at most ``2**n`` of them (a longer match is better
evidence; a lone repeated token is weak), and never more than ``num_speculative_tokens``.
Worked example, with ngram_max = 3 and tokens ``[a b c d a b]`` (current token ``b``,
index 5): the 3-gram ``[d a b]`` never occurred before; the 2-gram ``[a b]`` ends at
index 1, so the draft is ``tokens[2:2 + 4] = [c d a b]``.

Matches are found in O(1) from a per-sequence index of every n-gram's end positions,
updated as tokens arrive. Defaults chosen by measurement (``benchmarks/prompt_lookup.py``,
results in docs/BENCHMARKS.md): the **most recent** match (``match="recent"``) and
**8** tokens. On repeating text most recent and first agree; when the text has moved on
(an edited copy, a loop that changed), the most recent occurrence is the better guess, and
on micro's CPU cost curve a draft of 8 costs ~1.5x a 1-token pass, repaid by one accepted
token in two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafters.base import Draft, DraftContext
from drafters.registry import DrafterEnv


class PromptLookup:
    name = "prompt_lookup"

    @dataclass(frozen=True)
    class Params:
        num_speculative_tokens: int = 8
        ngram_max: int = 3
        ngram_min: int = 1
        match: str = "recent"  # "recent" | "first"

        def __post_init__(self):
            if not 1 <= self.num_speculative_tokens <= 64:
                raise ValueError("num_speculative_tokens must be in 1..64")
            if not 1 <= self.ngram_min <= self.ngram_max <= 16:
                raise ValueError("need 1 <= ngram_min <= ngram_max <= 16")
            if self.match not in ("recent", "first"):
                raise ValueError("match must be 'recent' or 'first'")

    def __init__(self, params: Params, env: DrafterEnv | None = None):
        self.params = params

    def _index(self, ctx: DraftContext) -> dict[tuple, list[int]]:
        """n-gram -> end positions, for every n-gram ending before the current token."""
        st = ctx.state
        index = st.setdefault("ngram_index", {})
        done = st.get("ngram_indexed", -1)  # last end position indexed
        toks = ctx.tokens
        lo, hi = self.params.ngram_min, self.params.ngram_max
        for end in range(done + 1, len(toks) - 1):
            for n in range(lo, min(hi, end + 1) + 1):
                index.setdefault(tuple(toks[end - n + 1:end + 1]), []).append(end)
        st["ngram_indexed"] = len(toks) - 2
        return index

    def find(self, tokens: list[int], index: dict[tuple, list[int]], budget: int) -> list[int]:
        p = self.params
        for n in range(min(p.ngram_max, len(tokens)), p.ngram_min - 1, -1):
            ends = index.get(tuple(tokens[-n:]))
            if ends:
                end = ends[-1] if p.match == "recent" else ends[0]
                k = min(p.num_speculative_tokens, budget, 2 ** n)
                return tokens[end + 1:end + 1 + k]
        return []

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        draft = self.find(ctx.tokens, self._index(ctx), budget)
        return Draft(torch.tensor(draft, dtype=torch.long))

    def observe(self, ctx: DraftContext, accepted: list[int]) -> None:
        pass  # the index catches up on the next propose
