"""schemathesis over /openapi.json: requests that fit the schema (positive) and requests
that break it (negative) never get a 5xx, and every error is an OpenAI error body.

The budget is small (``MAX_EXAMPLES`` per operation and mode) so the run stays well under
a minute, and generated lengths are clamped so a case costs milliseconds of decoding.
(schemathesis' pytest plugin does not load under pytest 9, so the operations' hypothesis
strategies are driven directly.)
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
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
