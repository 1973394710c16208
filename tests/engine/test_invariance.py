"""The third invariant: with a seed, the sampled text is a function of (prompt, parameters,
seed, model) only -- the same under every drafter, chains and trees, alone and batched, and
the same as plain sampling with that seed (engine.sampling)."""

import pytest
import torch
import numpy as np
from scipy.stats import chisquare, expon, kstest

from nodraft.drafters.registry import Registry
from nodraft.engine.core import Engine, GenerationRequest
from nodraft.engine.sampling import PositionNoise, derive_seed, exponentials, race
from nodraft.engine.verify import SamplingParams, race_rows, scaled_logits, target_probs
from nodraft.micro import gemm
from nodraft.micro.checkpoint import load_model, load_tokenizer
from tests.engine.helpers import REGISTRY, generate, run_all

# every registered drafter with its default parameters (medusa and suffix draft trees,
# the rest chains), EAGLE's dynamic tree and a deep early exit (test_equivalence sweeps the
# parameters)
EXTRA = [("eagle", {"depth": 6, "top_k": 3, "total_tokens": 40}),
         ("early_exit", {"exit_layer": 3, "num_speculative_tokens": 5}),
         ("early_exit", {"exit_layer": 2, "draft_vocab": 256, "reuse_kv": True})]
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


@pytest.fixture(params=["numpy", "native"])
def implementation(request, monkeypatch):
    """The race run as numpy array operations, or as ``nodraft::race`` where nodraft's
    kernels load (tests/engine/test_race_kernel.py compares the two)."""
    if request.param == "numpy":
        monkeypatch.setenv("NODRAFT_RACE", "numpy")
    elif not gemm.load():
        pytest.skip(f"nodraft's kernels: {gemm.why()}")
    else:
        monkeypatch.delenv("NODRAFT_RACE", raising=False)
    from nodraft.engine import sampling as module
    assert module.native() == (request.param == "native")
    return request.param


@pytest.fixture(scope="module")
def trained(checkpoint_dir):
    return {name: load_model(name, checkpoint_dir) for name in MODELS}


@pytest.fixture(scope="module")
def prompts():
    tok = load_tokenizer()
    return [tok.encode(t) for t in TEXTS]


def test_the_noise_is_a_function_of_seed_and_position():
    a, b = PositionNoise(5, 4096), PositionNoise(5, 4096)
    assert (a.groups, a.width) == (64, 64)
    b.group_noise(9), b.member_noise(9, 3)  # the order asked in does not matter
    assert np.array_equal(a.group_noise(3), b.group_noise(3))
    assert np.array_equal(a.member_noise(9, 3), b.member_noise(9, 3))
    for t in range(1, 20):
        assert not np.array_equal(a.group_noise(t - 1), a.group_noise(t))
        assert not np.array_equal(a.member_noise(t - 1, 0), a.member_noise(t, 0))
    assert not np.array_equal(a.member_noise(3, 0), a.member_noise(3, 1))
    assert not np.array_equal(a.group_noise(3), PositionNoise(6, 4096).group_noise(3))
    # a batch's rows draw what each would alone
    batch = exponentials([a.group_stream(3), PositionNoise(6, 4096).group_stream(3),
                     a.group_stream(4)], 64)
    assert np.array_equal(batch[0], a.group_noise(3))
    assert np.array_equal(batch[2], a.group_noise(4))
    assert derive_seed(5, 0) != derive_seed(5, 1) != derive_seed(6, 0)


def test_the_noise_is_exponential():
    """The exponentials behind H and G are standard exponential, E ~ Exp(1) (H = -log E is
    then standard Gumbel: the races are exact only then)."""
    n = PositionNoise(1, 4096)
    h = np.concatenate([n.group_noise(t) for t in range(64)])
    g = np.concatenate([n.member_noise(t, t % 7) for t in range(64)])
    assert kstest(h, expon.cdf).pvalue > 1e-3
    assert kstest(g, expon.cdf).pvalue > 1e-3
    assert h.min() > 0 and g.min() > 0
    # and independent: neighbouring entries, positions and groups uncorrelated
    for x, y in [(h[:-1], h[1:]), (g[:-1], g[1:]), (h, g)]:
        assert abs(np.corrcoef(x, y)[0, 1]) < 4 / np.sqrt(len(x))


@pytest.mark.parametrize("vocab,sp", [
    (50, SamplingParams(temperature=1.0)),  # 8 groups of 7, the last one short
    (64, SamplingParams(temperature=0.7, top_k=20, top_p=0.9)),
])
def test_the_race_draws_the_target_distribution(vocab, sp, implementation):
    """The two-level race's token over many seeds follows target_probs, filters included:
    nothing outside what they keep, and chi-square agreement over what they do."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=gen) * 2
    p = target_probs(logits, sp).double().numpy()
    draws = 12000
    counts = np.bincount([race_rows(logits[None], sp, PositionNoise(s, vocab), [7])[0]
                          for s in range(draws)], minlength=vocab)
    assert counts[p == 0].sum() == 0
    keep = p * draws >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(p[keep], p[~keep].sum()) * draws
    assert chisquare(obs[exp > 0], exp[exp > 0] * obs.sum() / exp.sum()).pvalue > 1e-3


def test_a_batched_race_is_each_rows_own(implementation):
    """The packed pass races all rows of all seeded sequences in one call (temperatures and
    filters per row): each row's token is the one its race alone gives."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 64, generator=gen) * 3
    noise = [PositionNoise(s, 64) for s in range(12)]
    sps = [SamplingParams(temperature=(0.7, 1.0, 1.3)[r % 3], top_p=(1.0, 0.9)[r % 2],
                          top_k=(0, 5, 0, 0)[r % 4], seed=r) for r in range(12)]
    alone = [race_rows(logits[r:r + 1], sps[r], noise[r], [r + 20])[0] for r in range(12)]
    scaled = torch.cat([scaled_logits(logits[r:r + 1], sps[r]) for r in range(12)])
    assert race(scaled, noise, [r + 20 for r in range(12)]) == alone
    for r in range(12):  # and every pick is a token the filters kept
        assert bool(target_probs(logits[r], sps[r])[alone[r]] > 0)
    # unfiltered rows: their temperatures divide inside the race, as a packed pass sends them
    temps = [sp.temperature for sp in sps]
    unfiltered = [SamplingParams(temperature=t, seed=r) for r, t in enumerate(temps)]
    alone = [race_rows(logits[r:r + 1], unfiltered[r], noise[r], [r + 20])[0] for r in range(12)]
    assert race(logits, noise, [r + 20 for r in range(12)], temps) == alone
    assert race(logits / torch.tensor(temps)[:, None], noise, [r + 20 for r in range(12)]) == alone


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

