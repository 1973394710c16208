"""The first invariant: speculative greedy decoding equals plain greedy, token for token,
for every registered drafter."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodraft.micro.checkpoint import load_model, load_tokenizer
from tests.conftest import TINY, tiny_model
from tests.engine.helpers import all_configs, generate

CONFIGS = all_configs()


@st.composite
def prompts(draw, vocab: int, max_len: int):
    """Fresh prompts, prompts that repeat themselves, and prompts near the context limit."""
    kind = draw(st.sampled_from(["fresh", "repeat", "near_limit"]))
    if kind == "fresh":
        return draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40))
    if kind == "repeat":
        unit = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12))
        return (unit * draw(st.integers(2, 8)))[: max_len - 2]
    n = draw(st.integers(max_len - 12, max_len - 1))
    seed = draw(st.integers(0, 2**16))
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


TINY_MODEL = tiny_model()


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(prompt=prompts(TINY.vocab_size, TINY.max_positions), max_tokens=st.integers(1, 24))
def test_greedy_equivalence_on_a_tiny_model(prompt, max_tokens):
    shared: dict = {}
    want, _, _ = generate(TINY_MODEL, prompt, max_tokens)
    assert 1 <= len(want) <= max_tokens
    for method, params in CONFIGS:
        got, seq, _ = generate(TINY_MODEL, prompt, max_tokens, method, params, shared=shared)
        assert got == want, (method, params)
        assert seq.stats.drafter_errors == 0


@pytest.fixture(scope="module")
def trained(checkpoint_dir):
    return {name: load_model(name, checkpoint_dir) for name in ("micro", "micro-layerskip")}


@pytest.mark.parametrize("name", ["micro", "micro-layerskip"])
def test_greedy_equivalence_on_the_trained_checkpoints(trained, name):
    model = trained[name]
    tok = load_tokenizer()
    texts = ["def fibonacci(n):\n    ", "The quick brown fox. The quick brown fox. The quick",
             "import os\nimport sys\nimport os\nimport sys\nimport", "class Queue:\n    \"\"\"A"]

    @settings(max_examples=15, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(text=st.sampled_from(texts), cut=st.integers(0, 8), max_tokens=st.integers(1, 48),
           near_limit=st.booleans())
    def check(text, cut, max_tokens, near_limit):
        prompt = tok.encode(text)
        prompt = prompt[: max(1, len(prompt) - cut)]
        if near_limit:
            prompt = (prompt * 200)[: 1024 - 5]
        shared: dict = {}
        want, _, _ = generate(model, prompt, max_tokens)
        for method, params in CONFIGS:
            got, _, _ = generate(model, prompt, max_tokens, method, params, shared=shared,
                                model_name=name)
            assert got == want, (name, method, params)

    check()


def test_max_tokens_one_and_the_context_limit():
    model = TINY_MODEL
    for method, params in CONFIGS:
        out, seq, _ = generate(model, [1, 2, 3, 1, 2, 3], 1, method, params)
        assert len(out) == 1 and seq.finish_reason == "length"
        full = [i % TINY.vocab_size for i in range(TINY.max_positions - 3)]
        out, seq, _ = generate(model, full, 50, method, params)
        assert len(out) == 3 and seq.finish_reason == "length"  # the context filled up
