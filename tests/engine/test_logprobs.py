"""Logprobs come from the target's own distribution: under every drafter the same values
as plain decoding's, and the values a full forward over the text gives."""

import msgspec
import pytest
import torch

from nodraft.engine.core import Event
from nodraft.engine.messages import Outputs, decode_outputs, encode
from nodraft.engine.sequence import Sequence, StepResult, token_logprobs
from nodraft.engine.verify import SamplingParams
from nodraft.micro.checkpoint import load_model, load_tokenizer
from nodraft.micro.model import KVCache
from tests.conftest import tiny_model
from tests.engine.helpers import REGISTRY, all_configs, drafter_env

MODEL = tiny_model()
CONFIGS = all_configs()


def run(model, prompt, max_tokens, method="none", params=None, sp=SamplingParams(), top=3,
        shared=None, model_name=None):
    meth, p = REGISTRY.parse({"method": method, **(params or {})})
    drafter = REGISTRY.build(meth, p, drafter_env(model, shared, model_name))
    seq = Sequence(model, KVCache(model.config, 1, dtype=model.tok_embeddings.weight.dtype), 0,
                   list(prompt), drafter, max_tokens, sp, method=meth, logprobs=top,
                   prompt_logprobs=True)
    tokens, lps, prompt_lps = [], [], None
    with torch.inference_mode():
        while not seq.done:
            r = seq.step()
            assert len(r.logprobs) == len(r.tokens)
            if prompt_lps is None:
                prompt_lps = r.prompt_logprobs
            else:
                assert r.prompt_logprobs is None  # the first step only
            tokens += r.tokens
            lps += r.logprobs
    return tokens, lps, prompt_lps


def full_forward(model, ids, top):
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0]
    return token_logprobs(logits[:-1], ids[1:], top)


def close(a, b, tol):
    assert len(a) == len(b)
    for (ca, ta), (cb, tb) in zip(a, b):
        assert abs(ca - cb) <= tol
        assert [i for i, _ in ta] == [i for i, _ in tb]
        assert all(abs(x - y) <= tol for (_, x), (_, y) in zip(ta, tb))


@pytest.mark.parametrize("sp", [SamplingParams(), SamplingParams(temperature=0.9, seed=4)],
                         ids=["greedy", "seeded"])
def test_every_drafter_reports_plain_decodings_logprobs(sp):
    prompt = [5, 9, 2, 5, 9, 2, 5, 9, 7, 1, 3]
    shared: dict = {}
    want, want_lp, want_prompt = run(MODEL, prompt, 20, sp=sp)
    close(want_lp, full_forward(MODEL, prompt + want, 3)[len(prompt) - 1:], 1e-9)
    close(want_prompt, full_forward(MODEL, prompt, 3), 1e-9)
    for method, params in CONFIGS:
        got, lp, prompt_lp = run(MODEL, prompt, 20, method, params, sp, shared=shared)
        assert got == want, (method, params)
        close(lp, want_lp, 1e-9)
        close(prompt_lp, want_prompt, 1e-9)


def test_logprobs_on_a_trained_checkpoint_match_a_full_forward(checkpoint_dir):
    model = load_model("micro-layerskip", checkpoint_dir)
    prompt = load_tokenizer().encode("def add(a, b):\n    return a + b\n\n\ndef add(a, b):")
    for method in ("none", "prompt_lookup", "early_exit", "eagle"):
        tokens, lps, prompt_lps = run(model, prompt, 24, method, top=5,
                                      model_name="micro-layerskip")
        ref = full_forward(model, prompt + tokens, 5)
        close(lps, ref[len(prompt) - 1:], 2e-4)
        close(prompt_lps, ref[:len(prompt) - 1], 2e-4)
        # the chosen token is greedy's: the most likely one
        assert all(top[0][0] == tok for (_, top), tok in zip(lps, tokens))


def test_top_zero_gives_the_chosen_tokens_only_and_one_token_prompts_have_none():
    tokens, lps, prompt_lps = run(MODEL, [3], 4, top=0)
    assert prompt_lps == [] and all(top == [] for _, top in lps)
    assert all(lp <= 0 for lp, _ in lps)


def test_logprobs_cross_the_process_boundary():
    step = StepResult([1, 2], 1, [1], [], "none", logprobs=[(-0.5, [(1, -0.5), (3, -1.0)]),
                                                            (-0.1, [(2, -0.1)])],
                      prompt_logprobs=[(-2.0, [])])
    out = decode_outputs(encode(Outputs([(7, Event("step", step=step))], 1, 0, "off")))
    got = out.events[0][1].step
    assert msgspec.to_builtins(got.logprobs) == msgspec.to_builtins(step.logprobs)
    assert got.prompt_logprobs == [(-2.0, [])]
