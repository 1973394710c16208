"""The third invariant: with a seed, the sampled text is a function of (prompt, parameters,
seed, model) only -- the same under every drafter, chains and trees, alone and batched, and
the same as plain sampling with that seed (engine.sampling)."""

import pytest
import torch

from nodraft.drafters.registry import Registry
from nodraft.engine.core import Engine, GenerationRequest
from nodraft.engine.sampling import PositionNoise, derive_seed
from nodraft.engine.verify import SamplingParams
from nodraft.micro.checkpoint import load_model, load_tokenizer
from tests.engine.helpers import REGISTRY, generate, run_all

# every registered drafter with its default parameters (medusa and suffix draft trees,
# the rest chains), EAGLE's dynamic tree and a deep early exit (test_equivalence sweeps the
# parameters)
EXTRA = [("eagle", {"depth": 6, "top_k": 3, "total_tokens": 40}),
         ("early_exit", {"exit_layer": 3, "num_speculative_tokens": 5})]
CONFIGS = [(name, {}) for name in REGISTRY.names()] + EXTRA
MODELS = ["micro", "micro-layerskip"]
TEXTS = ["def fibonacci(n):\n    ", "The quick brown fox. The quick brown fox. The quick",
         "import os\nimport sys\nimport os\nimport", "class Queue:\n    \"\"\"A",
         "Once upon a time", "for i in range(10):\n    for j in range(10):\n        "]
SEEDS = range(20)
TOKENS = 24


def sampling(seed: int) -> SamplingParams:
    # temperatures and filters vary with the seed: each is part of the request's parameters
    return SamplingParams(temperature=(0.7, 0.8, 1.0)[seed % 3], top_p=(1.0, 0.95)[seed % 2],
                          top_k=(0, 0, 0, 50)[seed % 4], seed=seed)


@pytest.fixture(scope="module")
def trained(checkpoint_dir):
    return {name: load_model(name, checkpoint_dir) for name in MODELS}


@pytest.fixture(scope="module")
def prompts():
    tok = load_tokenizer()
    return [tok.encode(t) for t in TEXTS]


def test_the_noise_is_a_function_of_seed_and_position():
    a, b = PositionNoise(5, 64), PositionNoise(5, 64)
    b.exponentials(9)  # the order positions are visited in does not matter
    assert torch.equal(a.exponentials(3), b.exponentials(3))
    assert not torch.equal(a.exponentials(3), a.exponentials(4))
    assert not torch.equal(a.exponentials(3), PositionNoise(6, 64).exponentials(3))
    assert (a.exponentials(3) > 0).all()
    assert derive_seed(5, 0) != derive_seed(5, 1) != derive_seed(6, 0)


@pytest.mark.parametrize("name", MODELS)
def test_every_drafter_samples_the_text_plain_sampling_samples(trained, prompts, name):
    model = trained[name]
    shared: dict = {}
    methods_that_accepted = set()
    for seed in SEEDS:
        prompt = prompts[seed % len(prompts)]
        sp = sampling(seed)
        want, _, _ = generate(model, prompt, TOKENS, sampling=sp, model_name=name)
        assert len(want) >= 1
        for method, params in CONFIGS:
            got, seq, _ = generate(model, prompt, TOKENS, method, params, sp, shared=shared,
                                   model_name=name)
            assert got == want, (name, seed, method, params)
            assert seq.stats.drafter_errors == 0
            if seq.stats.accepted:
                methods_that_accepted.add(method)
    # the comparison means something only if drafts were accepted (and trees among them)
    assert {"prompt_lookup", "suffix", "early_exit", "medusa", "eagle"} <= methods_that_accepted


def outputs(engine, requests) -> list[list[int]]:
    return [[t for e in evs if e.kind == "step" for t in e.step.tokens]
            for evs in run_all(engine, requests, timeout=300.0)]


@pytest.mark.parametrize("name", MODELS)
def test_in_a_batch_of_eight_mixed_requests_too(trained, prompts, name):
    """Each batch holds 8 requests, each its own drafter (chains and trees), prompt and seed;
    every output equals plain sampling's alone."""
    model = trained[name]
    reg = Registry()
    engine = Engine({name: model}, reg, eot_id=None, max_running=8, max_waiting=8)
    engine.start()
    try:
        for batch in range(0, len(SEEDS), 8):
            requests, want = [], []
            for j, seed in enumerate(list(SEEDS)[batch:batch + 8]):
                method, params = CONFIGS[(seed * 7 + j) % len(CONFIGS)]
                prompt = prompts[seed % len(prompts)]
                sp = sampling(seed)
                m, p = reg.parse({"method": method, **params})
                requests.append(GenerationRequest(name, prompt, TOKENS, sp, m, p))
                want.append(generate(model, prompt, TOKENS, sampling=sp, model_name=name)[0])
            got = outputs(engine, requests)
            for w, g, r in zip(want, got, requests):
                assert g == w, (name, r.method, r.params, r.sampling)
    finally:
        engine.stop()
    assert engine.passes > 0

