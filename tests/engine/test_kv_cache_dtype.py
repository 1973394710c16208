"""A float16 KV cache (``nodraft serve --kv-cache-dtype float16``): the target as served is
micro with every cached key and value rounded to half precision, and against that target
every drafter is lossless -- speculative greedy decoding gives plain greedy decoding's
tokens, seeded sampling plain sampling's -- and a batched sequence gets its lone output."""

import pytest
import torch

from nodraft.drafters.registry import Registry
from nodraft.engine.core import Engine, GenerationRequest
from nodraft.engine.verify import SamplingParams
from nodraft.micro import gemm
from nodraft.micro.checkpoint import load_model, load_tokenizer
from tests.engine.helpers import all_configs, generate, run_all

pytestmark = pytest.mark.skipif(not gemm.load(), reason=f"nodraft's kernels unavailable: {gemm.why()}")

HALF = torch.float16
TEXTS = ["def fibonacci(n):\n    ", "import os\nimport sys\nimport os\nimport sys\nimport"]


@pytest.fixture(scope="module")
def served(checkpoint_dir):
    """micro as the engine serves it: its passes through nodraft's one-call kernels."""
    model = load_model("micro", checkpoint_dir).compile()
    assert model.compiled.block_serves()
    return model


@pytest.mark.parametrize("text", TEXTS)
def test_every_drafter_decodes_what_plain_decoding_does_over_a_float16_cache(served, text):
    prompt = load_tokenizer().encode(text)
    want, seq, _ = generate(served, prompt, 40, dtype=HALF, model_name="micro")
    assert seq.cache.k.dtype == HALF
    shared: dict = {}
    for method, params in all_configs():
        got, seq, _ = generate(served, prompt, 40, method, params, shared=shared, dtype=HALF,
                               model_name="micro")
        assert got == want, (method, params)
        assert seq.stats.drafter_errors == 0, (method, params)


def test_seeded_sampling_draws_the_same_text_with_any_drafter_over_a_float16_cache(served):
    prompt = load_tokenizer().encode(TEXTS[1])
    sp = SamplingParams(temperature=0.8, seed=5)
    want, _, _ = generate(served, prompt, 40, sampling=sp, dtype=HALF, model_name="micro")
    for method in ("prompt_lookup", "suffix", "eagle", "auto"):
        got, _, _ = generate(served, prompt, 40, method, sampling=sp, dtype=HALF,
                             model_name="micro")
        assert got == want, method


def test_an_engine_with_a_float16_cache_gives_each_batched_request_its_lone_output(
        served, checkpoint_dir):
    tok = load_tokenizer()
    reg = Registry()
    cases = [("none", SamplingParams()), ("prompt_lookup", SamplingParams()),
             ("suffix", SamplingParams(temperature=0.8, seed=3)), ("eagle", SamplingParams()),
             ("auto", SamplingParams(temperature=0.7, seed=9)), ("none", SamplingParams())]
    requests, solo = [], []
    for i, (method, sp) in enumerate(cases):
        prompt = tok.encode(TEXTS[i % 2])[: 6 + i]
        m, p = reg.parse(method)
        requests.append(GenerationRequest("micro", prompt, 30, sp, m, p))
        solo.append(generate(served, prompt, 30, method, sampling=sp, dtype=HALF,
                             model_name="micro")[0])
    engine = Engine({"micro": served}, reg, None, max_running=4, max_waiting=8,
                    kv_cache_dtype="float16")
    engine.checkpoint_dir = checkpoint_dir
    assert engine.caches["micro"].k.dtype == HALF
    engine.start()
    try:
        events = run_all(engine, requests)
    finally:
        engine.stop()
    for (method, _), want, evs in zip(cases, solo, events):
        assert evs[-1].kind == "finish", evs[-1]
        assert [t for e in evs if e.kind == "step" for t in e.step.tokens] == want, method
    assert engine.passes > 0  # some steps ran batched


def test_an_unknown_kv_cache_dtype_and_a_float16_cache_for_another_model_are_refused(
        served, checkpoint_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        Engine({"micro": served}, Registry(), None, kv_cache_dtype="bfloat16")
    wide = load_model("micro", checkpoint_dir).double()
    with pytest.raises(ValueError, match="float32 models only"):
        Engine({"micro": wide}, Registry(), None, kv_cache_dtype="float16")


def test_a_prompt_from_a_float16_prefix_cache_gets_its_lone_output(served, checkpoint_dir):
    tok = load_tokenizer()
    prompt = tok.encode(TEXTS[1] * 4)[:50]  # three whole 16-token blocks to keep
    reg = Registry()
    engine = Engine({"micro": served}, reg, None, max_running=2, max_waiting=4,
                    kv_cache_dtype="float16")
    engine.checkpoint_dir = checkpoint_dir
    engine.start()
    try:
        outs = []
        for method in ("none", "suffix"):  # the second prompt starts from the kept blocks
            m, p = reg.parse(method)
            (evs,) = run_all(engine, [GenerationRequest("micro", prompt, 20, method=m, params=p)])
            outs.append(evs)
    finally:
        engine.stop()
    want = generate(served, prompt, 20, dtype=HALF, model_name="micro")[0]
    steps = [[e.step for e in evs if e.kind == "step"] for evs in outs]
    assert steps[1][0].cached_tokens == 48
    assert [[t for s in st for t in s.tokens] for st in steps] == [want, want]
