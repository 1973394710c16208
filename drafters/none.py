"""``none``: plain decoding, the baseline. Draft cost 0; tokens per pass exactly 1.0."""

from __future__ import annotations

from dataclasses import dataclass

from nodraft.drafters.base import Draft, DraftContext, DrafterBase, DrafterEnv


class NoDraft(DrafterBase):
    name = "none"

    @dataclass(frozen=True)
    class Params:
        pass

    def __init__(self, params: Params, env: DrafterEnv):
        self.params = params

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        return Draft.empty()

    def observe(self, ctx: DraftContext, accepted: list[int]) -> None:
        pass
