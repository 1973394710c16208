"""``early_exit``: LayerSkip self-speculation (Elhoushi et al., 2024).

Draft: run the target's layers [0, E) on the current token, read a prediction through the
final norm and the shared LM head, feed it back, k times. Each draft pass writes layers < E
of the next cache row, exactly as the full model would, so verification reuses them: it
runs layers < E only for the last draft token, then layers [E, L) for the whole block
(``Draft.reuse`` carries the layer-E residual stream of the first k rows).

Draft cost model (FLOPs, per draft token, in target-pass units):
``(E * layer_flops + head_flops) / (L * layer_flops + head_flops)`` -- the first E of L
layers plus the 4096-way head. For micro (width 160, SwiGLU 384, vocabulary 4096) a layer
is ~287k multiply-adds and the head ~655k, so E = 1, 2, 3 cost 0.52, 0.68 and 0.84.

With sampling, draft token x is drawn from the exit's own distribution q (at the request's
temperature), and q travels with the draft for the min(1, p/q) rule. With a seed, x is drawn
by the request's noise at its position (``DraftContext.draw``), coupled with the target's
own draw there; no q travels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nodraft.drafters.base import Draft, DraftContext, DrafterBase, DrafterEnv, Reuse
from nodraft.micro.model import MicroConfig, layer_macs


def exit_cost(c: MicroConfig, exit_layer: int) -> float:
    head = c.vocab_size * c.dim
    return (exit_layer * layer_macs(c) + head) / (c.n_layers * layer_macs(c) + head)


class EarlyExit(DrafterBase):
    name = "early_exit"

    @dataclass(frozen=True)
    class Params:
        exit_layer: int = 2
        num_speculative_tokens: int = 3

        def __post_init__(self):
            if not 1 <= self.exit_layer <= 3:
                raise ValueError("exit_layer must be 1, 2 or 3 (micro has 4 layers)")
            if not 1 <= self.num_speculative_tokens <= 16:
                raise ValueError("num_speculative_tokens must be in 1..16")

    def __init__(self, params: Params, env: DrafterEnv):
        self.params = params
        if params.exit_layer >= env.model.config.n_layers:
            raise ValueError(f"exit_layer must be below {env.model.config.n_layers}")
        self.cost_per_token = exit_cost(env.model.config, params.exit_layer)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        E = self.params.exit_layer
        k = min(self.params.num_speculative_tokens, budget)
        m, n = ctx.model, ctx.n_cached
        tok = ctx.tokens[-1]
        tokens, hiddens, probs = [], [], []
        for i in range(k):
            logits, h = m.exit_pass(torch.tensor([tok]), ctx.cache, ctx.slot, n + i, E)
            hiddens.append(h)
            logits = logits[-1]
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
        return Draft(torch.tensor(tokens), None, torch.stack(probs) if probs else None,
                     cost=k * self.cost_per_token, reuse=Reuse(E, torch.cat(hiddens, dim=0)))

    def observe(self, ctx: DraftContext, accepted: list[int]) -> None:
        pass
