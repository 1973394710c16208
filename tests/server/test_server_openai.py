"""The official ``openai`` client against a live server: completions and chat, streamed
and not, with every registered speculation method."""

from __future__ import annotations

import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from drafters.registry import Registry

METHODS = Registry().names()
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


@pytest.fixture()
def client(live) -> OpenAI:
    return OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def check_figures(spec: dict, completion_tokens: int, finish_reason: str) -> None:
    """The speculation object obeys DESIGN.md's formulas."""
    assert spec["target_passes"] >= 1
    assert spec["tokens_per_pass"] == pytest.approx(
        (spec["accepted"] + spec["target_passes"]) / spec["target_passes"], abs=1e-3)
    if spec["drafted"]:
        assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["drafted"],
                                                        abs=1e-3)
    else:
        assert spec["acceptance_rate"] is None
    assert sum(spec["accepted_by_position"]) == spec["accepted"]
    if finish_reason == "length":  # each pass emits its accepted tokens plus a bonus token
        assert completion_tokens == spec["accepted"] + spec["target_passes"]


def test_models(client):
    ids = {m.id for m in client.models.list().data}
    assert ids == {"micro", "micro-layerskip"}


@pytest.mark.parametrize("method", METHODS)
def test_completion_every_method(client, method):
    r = client.completions.create(model="micro", prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"speculation": method})
    spec = r.model_extra["speculation"]
    assert spec["method"] == method
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 0
    check_figures(spec, r.usage.completion_tokens, r.choices[0].finish_reason)


@pytest.mark.parametrize("method", METHODS)
def test_chat_stream_every_method(client, method):
    stream = client.chat.completions.create(
        model="micro-layerskip", messages=[{"role": "user", "content": PROMPT}], max_tokens=10,
        temperature=0.8, seed=1, stream=True, stream_options={"include_usage": True},
        extra_body={"speculation": {"method": method}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    assert len(finish) == 1
    spec = final.model_extra["speculation"]
    assert spec["method"] == method
    check_figures(spec, final.usage.completion_tokens, finish[0])
    assert isinstance(text, str)


def test_greedy_stream_equals_non_stream(client):
    """Same prompt, greedy: the streamed text and the plain response agree, for a drafter
    too (speculative greedy decoding is token-for-token plain greedy decoding)."""
    plain = client.completions.create(model="micro", prompt=PROMPT, max_tokens=16,
                                      temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="micro", prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
        extra_body={"speculation": "prompt_lookup"}) if c.choices)
    assert streamed == plain.choices[0].text


def test_chat_non_stream_and_n(client):
    r = client.chat.completions.create(
        model="micro", messages=[{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "hello"}],
        max_tokens=6, n=2, seed=3, temperature=1.0, extra_body={"speculation": "ngram"})
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in r.choices)
    assert r.model_extra["speculation"]["method"] == "prompt_lookup"  # the alias, resolved
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stop_string(client):
    """The text ends before the first stop string, streamed or not; finish reason stop."""
    full = client.completions.create(model="micro", prompt=PROMPT, max_tokens=24,
                                     temperature=0).choices[0].text
    assert len(full) > 8
    stop = full[6:9]
    want = full[:full.index(stop)]
    r = client.completions.create(model="micro", prompt=PROMPT, max_tokens=24, temperature=0,
                                  stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    chunks = [c for c in client.completions.create(
        model="micro", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True)
        if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_client_errors(client):
    with pytest.raises(NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model="micro", prompt="x", max_tokens=1,
                                  extra_body={"speculation": "medusa-of-doom"})
    assert "prompt_lookup" in str(e.value)  # lists what exists
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model="micro", prompt="x", max_tokens=1, logprobs=2)
    assert e.value.body["param"] == "logprobs"
