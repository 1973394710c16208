"""Run one sequence to the end with any drafter, in process (no engine thread)."""

from __future__ import annotations

import torch

from drafters.registry import DrafterEnv, Registry
from micro.model import KVCache, Micro
from server.sequence import Sequence
from server.verify import SamplingParams

REGISTRY = Registry()

# Every registered method, with the parameter sets the tests exercise.
METHOD_PARAMS: dict[str, list[dict]] = {
    "none": [{}],
    "prompt_lookup": [{}, {"num_speculative_tokens": 3, "ngram_max": 2, "match": "first"}],
    "early_exit": [{"exit_layer": 1}, {"exit_layer": 2, "num_speculative_tokens": 5},
                   {"exit_layer": 3}],
    "suffix": [{}, {"min_token_prob": 0.01, "max_spec_factor": 4.0}],
}


def all_configs() -> list[tuple[str, dict]]:
    out = []
    for name in REGISTRY.names():
        for params in METHOD_PARAMS.get(name, [{}]):
            out.append((name, params))
    return out


def generate(model: Micro, prompt: list[int], max_tokens: int, method: str = "none",
             params: dict | None = None, sampling: SamplingParams = SamplingParams(),
             shared: dict | None = None, stop_ids: frozenset[int] = frozenset(),
             drafter=None, dtype=None):
    cache = KVCache(model.config, 1, dtype=dtype or model.tok_embeddings.weight.dtype)
    if drafter is None:
        meth, p = REGISTRY.parse({"method": method, **(params or {})})
        drafter = REGISTRY.build(meth, p, DrafterEnv("test", model, {} if shared is None else shared))
    seq = Sequence(model, cache, 0, list(prompt), drafter, max_tokens, sampling, stop_ids, method)
    out, steps = [], []
    with torch.inference_mode():
        while not seq.done:
            r = seq.step()
            out += r.tokens
            steps.append(r)
    return out, seq, steps
