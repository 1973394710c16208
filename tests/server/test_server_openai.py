"""The official ``openai`` client against a live server: completions and chat, streamed
and not, with every registered speculation method."""

from __future__ import annotations

import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from nodraft.drafters.registry import Registry

METHODS = Registry().names()
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


@pytest.fixture()
def client(live) -> OpenAI:
    return OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def check_figures(spec: dict, completion_tokens: int, finish_reason: str) -> None:
    """The speculation object obeys the formulas of docs/ARCHITECTURE.md."""
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
        client.completions.create(model="micro", prompt="x", max_tokens=1, best_of=2)
    assert e.value.body["param"] == "best_of"  # not supported: named, never ignored


def test_retrieve_model(client):
    card = client.models.retrieve("micro")
    assert card.id == "micro" and card.object == "model"
    assert card.model_extra["max_model_len"] == 1024
    with pytest.raises(NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_message_name(client):
    """``name`` on a message is accepted (and not rendered: server.chat)."""
    r = client.chat.completions.create(
        model="micro", max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": "Be brief.", "name": "rules"},
                  {"role": "user", "content": "hello", "name": "alice"}])
    plain = client.chat.completions.create(
        model="micro", max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "hello"}])
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens


def tokens_of(client, **kw) -> list[str]:
    """The texts of a greedy streamed completion's tokens (nodraft's ``tokens`` extension)."""
    chunks = client.completions.create(model="micro", prompt=PROMPT, temperature=0,
                                       stream=True, **kw)
    return [t["text"] for c in chunks for t in (c.model_extra.get("nodraft") or {}).get(
        "tokens", [])]


def test_six_stop_strings(client):
    """lm-eval's code tasks send 6 stop strings (OpenAI allows 4, nodraft 16)."""
    stops = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "\n\n\n"]
    r = client.completions.create(model="micro", prompt=PROMPT, max_tokens=24, temperature=0,
                                  stop=stops)
    text = r.choices[0].text
    assert not any(s in text for s in stops)
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model="micro", prompt=PROMPT, max_tokens=2,
                                  stop=[str(i) for i in range(17)])
    assert e.value.body["param"] == "stop" and "16" in e.value.body["message"]


@pytest.mark.parametrize("method", ["none", "auto", "prompt_lookup", "suffix"])
def test_usage_counts_the_tokens_returned(client, method):
    """With a stop string, completion_tokens counts the tokens whose text was returned (the
    one the stop string begins inside included), not those generated past the stop --
    the same under every drafter, streamed or not (``auto`` once counted 25 where ``none``
    counted 1)."""
    texts = tokens_of(client, max_tokens=24)
    full = "".join(texts)
    assert len(texts) == 24 and len(full) > 12
    stop = full[10:13]  # begins inside the text, perhaps inside a token
    hit = full.index(stop)
    starts = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    want = sum(1 for s in starts if s < hit)
    extra = {"speculation": method}
    r = client.completions.create(model="micro", prompt=PROMPT, max_tokens=24, temperature=0,
                                  stop=[stop], extra_body=extra)
    assert r.choices[0].text == full[:hit] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == want
    chunks = list(client.completions.create(
        model="micro", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True,
        stream_options={"include_usage": True}, extra_body=extra))
    assert chunks[-1].usage.completion_tokens == want
    shown = [t for c in chunks for t in (c.model_extra.get("nodraft") or {}).get("tokens", [])]
    assert len(shown) == want and "".join(t["text"] for t in shown) == full[:hit]
    # a stop string at the very start: nothing returned, nothing counted
    r = client.completions.create(model="micro", prompt=PROMPT, max_tokens=24, temperature=0,
                                  stop=[full[:2]], extra_body=extra)
    assert (r.choices[0].text, r.usage.completion_tokens) == ("", 0)


# -- logprobs and echo -------------------------------------------------------------------------
LP_METHODS = ["prompt_lookup", "suffix", "early_exit", "eagle", "medusa", "auto"]


def _completion_logprobs(client, method, **kw):
    r = client.completions.create(model="micro", prompt=PROMPT, max_tokens=12, temperature=0,
                                  logprobs=3, extra_body={"speculation": method}, **kw)
    return r.choices[0]


def test_completion_logprobs_are_the_targets_under_every_drafter(client):
    want = _completion_logprobs(client, "none")
    lp = want.logprobs
    assert "".join(lp.tokens) == want.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and tok in top and len(top) <= 4  # 3 alternatives + the token
        assert max(top.values()) == pytest.approx(chosen, abs=1e-6)  # greedy: the best one
    for method in LP_METHODS:
        got = _completion_logprobs(client, method)
        assert got.text == want.text and got.logprobs.tokens == lp.tokens, method
        assert got.logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=2e-4), method
        for a, b in zip(got.logprobs.top_logprobs, lp.top_logprobs):
            assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()),
                                                                              abs=2e-4)


def test_echo_returns_the_prompt_and_its_logprobs(client):
    c = client.completions.create(model="micro", prompt=PROMPT, max_tokens=4, temperature=0,
                                  logprobs=1, echo=True)
    assert c.choices[0].text.startswith(PROMPT)
    lp = c.choices[0].logprobs
    n_prompt = c.usage.prompt_tokens
    assert "".join(lp.tokens) == c.choices[0].text
    assert len(lp.tokens) == n_prompt + c.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    # the same prompt scored from the first token on by a second request agrees
    again = client.completions.create(model="micro", prompt=PROMPT, max_tokens=1, temperature=0,
                                      logprobs=0, echo=True, extra_body={"speculation": "auto"})
    assert again.choices[0].logprobs.token_logprobs[:n_prompt] == pytest.approx(
        lp.token_logprobs[:n_prompt], abs=2e-4)
    plain = client.completions.create(model="micro", prompt=PROMPT, max_tokens=2, echo=True)
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None


def test_streamed_logprobs_equal_the_response_logprobs(client):
    want = _completion_logprobs(client, "prompt_lookup", echo=True)
    tokens, chosen, offsets = [], [], []
    for chunk in client.completions.create(model="micro", prompt=PROMPT, max_tokens=12,
                                           temperature=0, logprobs=3, echo=True, stream=True,
                                           extra_body={"speculation": "prompt_lookup"}):
        for ch in chunk.choices:
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                chosen += ch.logprobs.token_logprobs
                offsets += ch.logprobs.text_offset
    assert tokens == want.logprobs.tokens and offsets == want.logprobs.text_offset
    assert chosen[1:] == pytest.approx(want.logprobs.token_logprobs[1:], abs=1e-6)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="micro", max_tokens=6, temperature=0,
                                       messages=[{"role": "user", "content": "def add(a, b):"}],
                                       logprobs=True, top_logprobs=2,
                                       extra_body={"speculation": "auto"})
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-6)  # greedy
        assert bytes(t.bytes).decode("utf-8", "replace")
    plain = client.chat.completions.create(model="micro", max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
    assert plain.choices[0].logprobs is None
    with pytest.raises(BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="micro", max_tokens=2, top_logprobs=2,
                                       messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(BadRequestError, match="logprobs"):
        client.completions.create(model="micro", prompt="x", max_tokens=2, logprobs=21)


# -- seeded sampling -----------------------------------------------------------------------
def test_a_seed_fixes_the_text_whatever_the_drafter(client):
    def text(method):
        r = client.completions.create(model="micro", prompt=PROMPT, max_tokens=32,
                                      temperature=0.8, seed=11, extra_body={"speculation": method})
        return r.choices[0].text
    plain = text("none")
    assert [text("auto") for _ in range(5)] == [plain] * 5
    assert text("suffix") == text("prompt_lookup") == plain
    r = client.completions.create(model="micro", prompt=PROMPT, max_tokens=32, temperature=0.8,
                                  seed=11, n=2)
    assert r.choices[0].text == plain and r.choices[1].text != plain  # choice 1: its own stream


# -- LangChain -----------------------------------------------------------------------------
def test_langchain_logprobs(live):
    from langchain_openai import ChatOpenAI, OpenAI as LangChainOpenAI

    chat = ChatOpenAI(base_url=live.url + "/v1", api_key="unused", model="micro", max_tokens=6,
                      temperature=0, logprobs=True)
    msg = chat.invoke("def add(a, b):")
    content = msg.response_metadata["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == msg.content
    assert all(t["logprob"] <= 0 for t in content)
    llm = LangChainOpenAI(base_url=live.url + "/v1", api_key="unused", model="micro",
                          max_tokens=6, temperature=0, logprobs=2)
    result = llm.generate([PROMPT])
    info = result.generations[0][0].generation_info
    assert "".join(info["logprobs"]["tokens"]) == result.generations[0][0].text


def test_a_repeated_prompt_reads_its_prefix_from_the_cache(client):
    """``usage.prompt_tokens_details.cached_tokens``: none the first time a prompt is seen,
    its whole blocks after (never its last token); the text is the same. Streamed too."""
    import uuid

    prompt = f"# {uuid.uuid4().hex}\n" + PROMPT * 4  # a prompt no other test sent
    first = client.completions.create(model="micro", prompt=prompt, max_tokens=8,
                                      temperature=0, extra_body={"speculation": "none"})
    again = client.completions.create(model="micro", prompt=prompt, max_tokens=8,
                                      temperature=0, extra_body={"speculation": "none"})
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert n - 16 <= cached < n and cached % 16 == 0
    assert again.choices[0].text == first.choices[0].text
    stream = client.completions.create(model="micro", prompt=prompt, max_tokens=8,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"speculation": "none"})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
