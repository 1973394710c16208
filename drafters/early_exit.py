"""``early_exit``: LayerSkip self-speculation (Elhoushi et al., 2024).

Draft: run the target's layers [0, E) on the current token, read a prediction through the
final norm and the shared LM head, feed it back, k times. Each draft pass writes layers < E
of the next cache row, exactly as the full model would. With ``reuse_kv`` verification
reuses them (LayerSkip's cache reuse): it runs layers < E for the last draft token, then
layers [E, L) and the head for the whole block (``Draft.reuse`` carries the layer-E
residual stream of the first k rows) -- two compiled passes. Without it (the default),
verification is one pass over the whole block, which writes the same rows again: on micro
a pass of k + 1 rows costs little more than one of a single row, and measured faster than
the two passes of the reuse (docs/BENCHMARKS.md, "Early exit's settings").

With ``draft_vocab`` N the exit's head reads a **draft vocabulary** (FR-Spec, Zhao et al.,
2025): the first N ids of the target's tokens ranked by their frequency in the train split
(``drafters.draft_vocab``), i.e. N rows of the tied LM head, not all 4096. A draft token
is always one of them; verification scores every token with the full head, so the
output is what it would be with any head (a token outside the subset is never proposed,
and is rejected like any other miss). ``draft_vocab`` 0 reads the full head.

Draft cost model (FLOPs, per draft token, in target-pass units):
``(E * layer_flops + N * dim) / (L * layer_flops + V * dim)`` -- the first E of L layers
plus N rows of the head. For micro (width 160, SwiGLU 384, vocabulary 4096) a layer is
~287k multiply-adds and the full head ~655k, so with the full head E = 1, 2, 3 cost 0.52,
0.68 and 0.84; with 512 rows 0.20, 0.36 and 0.52.

With sampling, draft token x is drawn from the exit's own distribution q (at the request's
temperature), and q travels with the draft for the min(1, p/q) rule. With a seed, x is drawn
by the request's noise at its position (``DraftContext.draw``), coupled with the target's
own draw there; no q travels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from nodraft.drafters.base import Draft, DraftContext, DrafterBase, DrafterEnv, Reuse
from nodraft.drafters.draft_vocab import check as check_vocab, head_rows
from nodraft.micro.model import MicroConfig, layer_macs


def exit_cost(c: MicroConfig, exit_layer: int, draft_vocab: int = 0) -> float:
    """A draft token's FLOPs over a one-row target pass's; ``draft_vocab`` 0: the full head."""
    head = c.vocab_size * c.dim
    rows = (draft_vocab or c.vocab_size) * c.dim
    return (exit_layer * layer_macs(c) + rows) / (c.n_layers * layer_macs(c) + head)


class EarlyExit(DrafterBase):
    name = "early_exit"

    @dataclass(frozen=True)
    class Params:
        # chosen on the workload suite (docs/BENCHMARKS.md, "Medusa's, EAGLE's and early
        # exit's settings on the workload suite"; before: "Early exit's settings")
        exit_layer: int = 3
        num_speculative_tokens: int = 1
        draft_vocab: int = 0  # the exit head's rows: the most frequent ids; 0: all of them
        reuse_kv: bool = False  # verification reuses the draft's layers below exit_layer

        def __post_init__(self):
            if not 1 <= self.exit_layer <= 3:
                raise ValueError("exit_layer must be 1, 2 or 3 (micro has 4 layers)")
            if not 1 <= self.num_speculative_tokens <= 16:
                raise ValueError("num_speculative_tokens must be in 1..16")
            if self.draft_vocab < 0:
                raise ValueError("draft_vocab must be 0 (the full head) or a number of ids")

    @staticmethod
    def check(params: Params, env: DrafterEnv) -> None:
        """Before the request is queued: a draft vocabulary of that size exists for the
        model."""
        if params.draft_vocab:
            check_vocab(env, params.draft_vocab)

    def __init__(self, params: Params, env: DrafterEnv):
        self.params = params
        c = env.model.config
        if params.exit_layer >= c.n_layers:
            raise ValueError(f"exit_layer must be below {c.n_layers}")
        if params.draft_vocab > c.vocab_size:
            raise ValueError(f"draft_vocab must be at most the model's vocabulary, {c.vocab_size}")
        n = 0 if params.draft_vocab == c.vocab_size else params.draft_vocab
        # the subset's ids (n,) and head rows (n, dim); None: the full head
        self.subset = head_rows(env, n) if n else None
        self.cost_per_token = exit_cost(c, params.exit_layer, n)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        E = self.params.exit_layer
        k = min(self.params.num_speculative_tokens, budget)
        m, n = ctx.model, ctx.n_cached
        tok = ctx.tokens[-1]
        tokens, hiddens, probs = [], [], []
        for i in range(k):
            if self.subset is None:
                logits, h = m.exit_pass(torch.tensor([tok]), ctx.cache, ctx.slot, n + i, E)
                logits = logits[-1]
            else:
                h = m.exit_residual(torch.tensor([tok]), ctx.cache, ctx.slot, n + i, E)
                logits = self._subset_logits(m, h[-1])
            hiddens.append(h)
            if ctx.draw is not None:  # seeded: the request's noise at this token's position
                tok = ctx.draw(logits, len(ctx.tokens) + i)
            elif ctx.temperature > 0:
                q = (logits.float() / ctx.temperature).softmax(-1)
                tok = int(torch.multinomial(q, 1, generator=ctx.generator))
                probs.append(q)
            else:
                tok = int(logits.argmax())
            tokens.append(tok)
        if not tokens:
            return Draft.empty()
        return Draft.of(tokens, probs=torch.stack(probs) if probs else None,
                        cost=k * self.cost_per_token,
                        reuse=Reuse(E, torch.cat(hiddens, dim=0)) if self.params.reuse_kv else None)

    def _subset_logits(self, m, h: Tensor) -> Tensor:
        """The full vocabulary's logits (V,) from the exit's residual h (dim,) through the
        final norm and the subset's head rows: -inf outside the subset, so every rule that
        picks or samples a token from them (greedy, the seeded draw, q) stays inside it."""
        ids, rows = self.subset
        sub = F.linear(m.norm(h), rows)
        return torch.full((m.config.vocab_size,), float("-inf"), dtype=sub.dtype).index_copy_(
            0, ids, sub)

    def observe(self, ctx: DraftContext, accepted: list[int]) -> None:
        pass
