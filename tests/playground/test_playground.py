"""The playground page at ``/``: served from the package's static files, and driven
in Debian's chromium with Playwright: a repeating prompt with prompt lookup shows accepted
draft tokens, the request's figures agree with the API's ``speculation`` object, side-by-side
mode fills both panes, and the server panel shows acceptance by method from /metrics.

The screenshot is kept in ``test-artifacts/playground.png``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

# A short function written twice, then its first line again: prompt lookup finds the rest.
PROMPT = ("def area(width, height):\n    return width * height\n\n"
          "def area(width, height):\n    return width * height\n\n"
          "def area(width, height):\n")
MAX_TOKENS = 40


def test_page_and_static_files_are_served(live):
    with httpx.Client(base_url=live.url, timeout=10) as http:
        page = http.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert "nodraft playground" in page.text and "/static/app.js" in page.text
        js = http.get("/static/app.js")
        assert js.status_code == 200 and "javascript" in js.headers["content-type"]
        assert "/v1/completions" in js.text
        assert http.get("/static/style.css").status_code == 200
        assert http.get("/static/missing.js").status_code == 404
        # Works offline: nothing is loaded from another host.
        for text in (page.text, js.text):
            assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
        assert "/" not in http.get("/openapi.json").json()["paths"]  # not part of the API


def figure(page, pane: str, name: str) -> tuple[str, str | None]:
    dd = page.locator(f'#pane-{pane} [data-fig="{name}"]')
    return dd.inner_text(), dd.get_attribute("data-value")


def api_completion(live, method: str) -> dict:
    body = {"model": "micro", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "speculation": {"method": method}}
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_playground_in_chromium(page, live):
    page.goto(live.url + "/")
    page.wait_for_selector("body[data-ready=true]", timeout=10_000)
    page.get_by_label("Model").select_option("micro")
    page.get_by_label("Drafter (A)").select_option("prompt_lookup")
    page.get_by_label("Prompt").fill(PROMPT)
    page.get_by_label("Max tokens").fill(str(MAX_TOKENS))
    page.get_by_label("Temperature").fill("0")
    page.get_by_role("button", name="Run").click()
    page.wait_for_selector("#pane-a[data-done=true]", timeout=20_000)

    # Every streamed token is marked by its origin; prompt lookup got drafts accepted.
    accepted = page.locator("#pane-a .completion .tok.accepted")
    assert accepted.count() > 0
    assert page.locator("#pane-a .completion .tok.bonus").count() > 0
    for title in page.locator("#pane-a .tok.had-rejection").evaluate_all(
            "els => els.map(e => e.title)"):
        assert "rejected draft" in title

    # The figures agree with what the API returns for the same (greedy) request.
    api = api_completion(live, "prompt_lookup")
    spec = api["speculation"]
    shown = "".join(page.locator("#pane-a .completion .tok").all_inner_texts())
    assert shown == api["choices"][0]["text"]
    text, value = figure(page, "a", "acceptance_rate")
    assert float(value) == pytest.approx(spec["acceptance_rate"])
    assert text == f"{100 * spec['acceptance_rate']:.1f} %"
    text, value = figure(page, "a", "tokens_per_pass")
    assert float(value) == pytest.approx(spec["tokens_per_pass"])
    assert text == f"{spec['tokens_per_pass']:.2f}"
    assert spec["tokens_per_pass"] > 1.0
    assert float(figure(page, "a", "tokens_per_second")[1]) > 0
    assert int(figure(page, "a", "target_passes")[1]) == spec["target_passes"]
    # both speed-up estimates, each the pane's own request's (the drafter's timed work
    # differs from run to run, so the measured-cost one is checked against the pane's)
    pane_spec = json.loads(page.locator("#pane-a").get_attribute("data-speculation"))
    for name in ("measured_cost_speedup", "estimated_speedup"):
        text, value = figure(page, "a", name)
        assert float(value) == pytest.approx(pane_spec[name]) and text == f"{pane_spec[name]:.2f}×"
    assert pane_spec["estimated_speedup"] == pytest.approx(spec["estimated_speedup"])
    assert pane_spec["measured_cost_speedup"] > 0

    # Side by side: one prompt, two drafters, two concurrent streams; both panes fill.
    page.get_by_label("Side by side (two drafters at once)").check()
    page.get_by_label("Drafter (B)").select_option("none")
    page.get_by_role("button", name="Run").click()
    page.wait_for_selector("#pane-a[data-done=true]", timeout=20_000)
    page.wait_for_selector("#pane-b[data-done=true]", timeout=20_000)
    # How much A drafts beside B is the batch plan's call (a packed pass's measured prices
    # may say a draft does not pay: engine/scheduler.py), so A is checked against its own
    # figures, not for a count of accepted tokens.
    pane_spec = json.loads(page.locator("#pane-a").get_attribute("data-speculation"))
    assert pane_spec["method"] == "prompt_lookup"
    assert int(figure(page, "a", "target_passes")[1]) == pane_spec["target_passes"]
    assert float(figure(page, "a", "tokens_per_pass")[1]) == pytest.approx(
        pane_spec["tokens_per_pass"])
    assert page.locator("#pane-a .tok").count() == api["usage"]["completion_tokens"]
    assert page.locator("#pane-b .tok").count() > 0
    assert page.locator("#pane-b .tok.accepted").count() == 0  # `none` drafts nothing
    assert figure(page, "b", "tokens_per_pass")[0] == "1.00"
    assert figure(page, "b", "measured_cost_speedup")[0] == "1.00×"  # a 1-row pass a token
    assert figure(page, "b", "acceptance_rate")[0] == "n/a (nothing drafted)"
    # greedy: both drafters give the target's own output, token for token
    assert (page.locator("#pane-a .tok").all_inner_texts()
            == page.locator("#pane-b .tok").all_inner_texts())

    # The server panel: acceptance by method over the window, from /metrics.
    row = page.locator('#server-table tr[data-method="prompt_lookup"]').first
    row.wait_for(timeout=10_000)
    assert float(row.locator("td").last.get_attribute("data-value")) > 0

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "playground.png"), full_page=True)
