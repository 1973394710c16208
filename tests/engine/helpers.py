"""Run one sequence to the end with any drafter, in process (no engine thread)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from importlib import import_module
from pathlib import Path

import torch

from nodraft.drafters.registry import DrafterEnv, Registry
from nodraft.micro.model import KVCache, Micro
from nodraft.engine.sequence import Sequence
from nodraft.engine.verify import SamplingParams

REGISTRY = Registry()

# Every registered method, with the parameter sets the tests exercise.
METHOD_PARAMS: dict[str, list[dict]] = {
    "none": [{}],
    "prompt_lookup": [{}, {"num_speculative_tokens": 3, "ngram_max": 2, "match": "first"}],
    "early_exit": [{"exit_layer": 1},
                   {"exit_layer": 2, "num_speculative_tokens": 5, "reuse_kv": True},
                   {"exit_layer": 3}, {"exit_layer": 3, "reuse_kv": True},
                   {"exit_layer": 1, "num_speculative_tokens": 4, "draft_vocab": 16,
                    "reuse_kv": True}],
    "suffix": [{}, {"min_token_prob": 0.01, "max_spec_factor": 4.0}],
    "lookahead": [{}, {"window": 2, "ngram": 5, "guesses": 4},
                  {"window": 5, "ngram": 4, "guesses": 8, "seed_from_prompt": False}],
    "medusa": [{}, {"num_heads": 1, "total_tokens": 3}, {"total_tokens": 40, "top_k": 3},
               {"num_heads": 2, "total_tokens": 4, "draft_vocab": 16}],
    "eagle": [{}, {"depth": 1, "top_k": 1, "total_tokens": 2},
              {"depth": 6, "top_k": 3, "total_tokens": 40}],
    "auto": [{}, {"candidates": "prompt_lookup,suffix", "num_speculative_tokens": 4}],
}


# Drafters with trained weights, and the function of their module that writes untrained
# (random, non-zero) weights for a model: ``fn(model, model_name, directory)``. The tiny
# test models get those, so the generic tests exercise real drafting with real trees; the
# committed checkpoints use their committed weights.
TRAINED: dict[str, str] = {"medusa": "nodraft.drafters.medusa:write_untrained"}
TRAINED["eagle"] = "nodraft.drafters.eagle:write_untrained"
TRAINED["draft-vocab"] = "nodraft.drafters.draft_vocab:write_untrained"  # early exit's
HEADS_DIR = Path(tempfile.mkdtemp(prefix="nodraft-test-heads-"))
atexit.register(shutil.rmtree, HEADS_DIR, ignore_errors=True)


def drafter_env(model: Micro, shared: dict | None = None, model_name: str | None = None) -> DrafterEnv:
    """The drafter environment for a test model: a committed checkpoint's name finds its
    committed weights; any other model gets untrained weights in a temporary folder."""
    shared = {} if shared is None else shared
    if model_name is not None:
        return DrafterEnv(model_name, model, shared)
    c = model.config
    name = f"tiny-{c.dim}-{c.n_layers}-{c.vocab_size}"
    for method, target in TRAINED.items():
        if not (HEADS_DIR / f"{name}-{method}.safetensors").exists():
            module, _, fn = target.partition(":")
            getattr(import_module(module), fn)(model, name, HEADS_DIR)
    return DrafterEnv(name, model, shared, checkpoint_dir=HEADS_DIR)


def all_configs() -> list[tuple[str, dict]]:
    out = []
    for name in REGISTRY.names():
        for params in METHOD_PARAMS.get(name, [{}]):
            out.append((name, params))
    return out


def generate(model: Micro, prompt: list[int], max_tokens: int, method: str = "none",
             params: dict | None = None, sampling: SamplingParams = SamplingParams(),
             shared: dict | None = None, stop_ids: frozenset[int] = frozenset(),
             drafter=None, dtype=None, model_name: str | None = None):
    cache = KVCache(model.config, 1, dtype=dtype or model.tok_embeddings.weight.dtype)
    if drafter is None:
        meth, p = REGISTRY.parse({"method": method, **(params or {})})
        drafter = REGISTRY.build(meth, p, drafter_env(model, shared, model_name))
    seq = Sequence(model, cache, 0, list(prompt), drafter, max_tokens, sampling, stop_ids, method)
    out, steps = [], []
    with torch.inference_mode():
        while not seq.done:
            r = seq.step()
            out += r.tokens
            steps.append(r)
    return out, seq, steps


def run_all(engine, requests, timeout: float = 120.0) -> list[list]:
    """Submit ``requests`` to a started engine; each one's events, once all have ended."""
    events = [[] for _ in requests]
    dones = [threading.Event() for _ in requests]
    for i, r in enumerate(requests):
        def cb(ev, i=i):
            events[i].append(ev)
            if ev.kind in ("finish", "error"):
                dones[i].set()
        engine.submit(r, cb)
    assert all(d.wait(timeout) for d in dones)
    return events
