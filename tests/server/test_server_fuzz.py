"""Bad input never gets a 5xx, and every error is an OpenAI error body.

- schemathesis over /openapi.json: requests that fit the schema (positive) and requests
  that break it (negative).
- hostile mutations of valid requests (``test_hostile_mutations``): hypothesis replaces any
  value at any depth, renames any key or adds one, with lone surrogates, odd keys
  (``foo-bar``, ``""``, ``\\x00``, ...) and values of the wrong JSON type; a lone surrogate
  anywhere must be a 400 ``invalid_unicode``, a wrong JSON type for a top-level field a
  400 naming it.

The budget is small (``MAX_EXAMPLES`` per operation and mode) so the run stays well under
a minute, and generated lengths are clamped so a case costs milliseconds of decoding.
(schemathesis' pytest plugin does not load under pytest 9, so the operations' hypothesis
strategies are driven directly.)
"""

from __future__ import annotations

import copy
import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

MAX_EXAMPLES = 40
MODELS = ("micro", "micro-layerskip")


def clamp(body, mode: GenerationMode) -> None:
    """Keep generated requests cheap (few tokens, few choices); in positive mode, name a
    served model, so that the cases reach the engine (unknown models: test_server_http)."""
    if isinstance(body, dict):
        model = body.get("model")
        if mode is GenerationMode.POSITIVE and isinstance(model, str):
            body["model"] = MODELS[len(model) % 2]
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body[key], bool):
                body[key] = min(body[key], 4)
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 4
        if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
            body["n"] = min(body["n"], 2)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors(live, mode):
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions",
                                               "POST /v1/chat/completions", "GET /v1/models"}
    seen = {}
    for op in operations:
        if mode is GenerationMode.NEGATIVE and not op.body and not op.query:
            continue  # nothing to break

        @given(case=op.as_strategy(mode))
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck),
                  phases=[Phase.explicit, Phase.generate])
        def check(case):
            clamp(case.body, mode)
            response = case.call(base_url=live.url, timeout=60)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.path, case.body, response.text[:300])
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}

        check()
    if mode is GenerationMode.POSITIVE:
        assert any(200 <= s < 300 for s in seen), seen  # cases did reach the engine


# -- hostile mutations of valid requests ------------------------------------------------------
HOSTILE_EXAMPLES = 250
BASES = {
    "/v1/completions": {
        "model": "micro", "prompt": ["import os\n", "x = 1"], "max_tokens": 2, "n": 1,
        "temperature": 0.5, "top_p": 1.0, "top_k": 0, "seed": 1, "stop": ["\n\n", "#"],
        "stream": False, "speculation": {"method": "prompt_lookup"}, "user": "u"},
    "/v1/chat/completions": {
        "model": "micro", "max_tokens": 2, "n": 1, "seed": 1, "stop": "\n",
        "speculation": "suffix", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": "Be brief.", "name": "sys"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
}
SURROGATES = ["\ud800", "\udfff", "a\udc00b", "\ud83d", "x\ude00"]
ODD_KEYS = ["foo-bar", "", "\x00", " ", "a.b", "0", "None", "null", "__proto__", "$ref",
            "é", "日本", "<|end|>", "\u2028", "max_tokens ", "Model", "\ufeffmodel"]
# a top-level field -> the JSON types it takes (strict, as OpenAI's)
JSON_TYPES = {"max_tokens": (int, type(None)), "n": (int,), "seed": (int, type(None)),
              "top_k": (int,), "temperature": (int, float), "top_p": (int, float),
              "stream": (bool,), "model": (str,), "user": (str, type(None))}
values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
              st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(SURROGATES),
              st.sampled_from(ODD_KEYS), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from(ODD_KEYS + SURROGATES), inner,
                                            max_size=3)),
    max_leaves=6)


def paths(node, here=()):
    """Every location in a JSON document: the root, each dict value and list item."""
    yield here
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, (*here, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, (*here, i))


def has_surrogate(node) -> bool:
    """Whether a key or string anywhere in ``node`` holds a lone surrogate."""
    if isinstance(node, str):
        try:
            node.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(node, dict):
        return any(has_surrogate(k) or has_surrogate(v) for k, v in node.items())
    if isinstance(node, list):
        return any(has_surrogate(v) for v in node)
    return False


@st.composite
def mutated(draw):
    """(endpoint, body, top-level fields given a wrong JSON type, mutations): a valid
    request with one to three mutations, each at any location: replace a string with odd
    text (often still valid), replace the value with anything, rename the key that holds
    it, or (at a dict) add a key."""
    endpoint = draw(st.sampled_from(sorted(BASES)))
    body = copy.deepcopy(BASES[endpoint])
    wrong = set()
    count = draw(st.integers(1, 3))
    for _ in range(count):
        locations = list(paths(body))
        where = draw(st.sampled_from(locations[1:] + locations[:1]))  # the root: rarely
        parent = body
        for step in where[:-1]:
            parent = parent[step]
        node = parent[where[-1]] if where else body
        action = draw(st.sampled_from(["text", "replace", "rename", "add"]))
        if action in ("rename", "add") and not where:  # the root: a key added to it
            action, node = "add", body
        if action == "text" and isinstance(node, str) and where:  # odd, often valid
            parent[where[-1]] = draw(st.one_of(st.sampled_from(ODD_KEYS), st.text(max_size=8)))
        elif action == "add" and isinstance(node, dict):
            node[draw(st.sampled_from(ODD_KEYS + SURROGATES))] = draw(values)
        elif action == "rename" and isinstance(parent, dict):
            parent[draw(st.sampled_from(ODD_KEYS + SURROGATES))] = parent.pop(where[-1])
            wrong.discard(where[-1])
        elif where:
            parent[where[-1]] = value = draw(values)
            if len(where) == 1 and where[0] in JSON_TYPES:
                if type(value) in JSON_TYPES[where[0]]:
                    wrong.discard(where[0])
                else:
                    wrong.add(where[0])
        elif action == "replace" and not where:
            body = draw(values)
            wrong.clear()
    if isinstance(body, dict):  # keep the cases cheap: few tokens, few choices
        for key in ("max_tokens", "n"):
            v = body.get(key)
            if type(v) is int and 4 < v < 10**6:
                body[key] = 4 if key == "max_tokens" else 2
    return endpoint, body, wrong, count


def test_hostile_mutations(live):
    """No 5xx; every error an OpenAI error body that encodes as UTF-8; a lone surrogate
    anywhere a 400 invalid_unicode; a top-level field of the wrong JSON type a 400 (naming
    it, when it is the only mutation); and some mutated requests are still served."""
    seen = {}
    with httpx.Client(base_url=live.url, timeout=60) as http:
        @given(case=mutated())
        @settings(max_examples=HOSTILE_EXAMPLES, deadline=None, derandomize=True,
                  database=None, suppress_health_check=list(HealthCheck),
                  phases=[Phase.explicit, Phase.generate])
        def check(case):
            endpoint, body, wrong, count = case
            r = http.post(endpoint, content=json.dumps(body).encode(),
                          headers={"content-type": "application/json"})
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (endpoint, body, r.text[:300])
            if r.status_code >= 400:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]
                json.dumps(err, ensure_ascii=False).encode("utf-8")  # renders as UTF-8
            if has_surrogate(body):
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", (
                    body, r.text[:300])
            elif wrong:  # strict JSON types: never coerced
                assert r.status_code == 400, (body, r.text[:300])
                if count == 1:
                    assert r.json()["error"]["param"] in wrong, (body, r.text[:300])

        check()
    assert seen.get(200, 0) > 0 and sum(n for s, n in seen.items() if s >= 400) > 0, seen
