"""``nodraft workshop``: in process on the checkpoints, through a live server, the plot,
and the rows it chooses."""

from __future__ import annotations

import json

import pytest

from nodraft.clients import workshop
from nodraft.clients.workshop import KEYS, Unavailable

BUILTIN_ROWS = {("micro", "none", None), ("micro", "prompt_lookup", None),
                ("micro", "suffix", None)} | {
    (m, "early_exit", e) for m in ("micro", "micro-layerskip") for e in (1, 2, 3)}


def check_rows(result: dict, prompts=("fresh", "repeating")) -> None:
    """Every row has the keys and obeys the formulas of docs/ARCHITECTURE.md."""
    assert result["rows"]
    for r in result["rows"]:
        assert set(KEYS) <= set(r)
        assert r["prompt"] in prompts
        assert r["measured_speedup"] > 0
        passes = r["target_passes"]
        assert passes >= 1
        assert r["tokens_per_pass"] == pytest.approx((r["accepted"] + passes) / passes, abs=1e-3)
        assert r["estimated_speedup"] == pytest.approx(
            r["tokens_per_pass"] / (1 + r["draft_cost"]), abs=2e-3)
        if r["drafted"] == 0:  # none, or a drafter that found nothing: plain decoding
            assert r["acceptance_rate"] is None and r["tokens_per_pass"] == 1.0
        else:
            assert r["acceptance_rate"] == pytest.approx(r["accepted"] / r["drafted"], abs=1e-3)
        if r["method"] == "none":
            assert r["draft_cost"] == 0.0 and r["estimated_speedup"] == 1.0


def test_in_process_json_and_plot(serve_checkpoints, tmp_path, capsys):
    png = tmp_path / "workshop.png"
    workshop.main(["--json", "--tokens", "12", "--repeats", "5", "--threads", "1",
                   "--checkpoints", str(serve_checkpoints), "--plot", str(png)])
    result = json.loads(capsys.readouterr().out)
    assert (result["tokens"], result["repeats"], result["mode"]) == (12, 5, "in process")
    check_rows(result)
    for prompt in ("fresh", "repeating"):
        shown = {(r["model"], r["method"], r["params"].get("exit_layer"))
                 for r in result["rows"] if r["prompt"] == prompt}
        assert BUILTIN_ROWS <= shown
    assert not [s for s in result["skipped"] if s["method"] in ("prompt_lookup", "suffix")]
    # the course page's figures stand beside the matching rows (micro only)
    course = {(r["model"], r["prompt"], r["method"], r["params"].get("exit_layer")): r["course"]
              for r in result["rows"]}
    assert course[("micro", "fresh", "early_exit", 1)] == {"acceptance_rate": 0.12}
    assert course[("micro", "repeating", "prompt_lookup", None)]["tokens_per_pass"] == 1.54
    assert course[("micro-layerskip", "fresh", "early_exit", 1)] is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_over_http(live, tmp_path, capsys):
    prompts = tmp_path / "prompts.json"
    passage = "def double(x):\n    return 2 * x\n"
    prompts.write_text(json.dumps({"fresh": "import os\n\n\ndef main(",
                                   "repeating": passage + "\n\n" + passage[:12]}))
    workshop.main(["--url", live.url + "/v1", "--json", "--tokens", "8", "--prompt-file",
                   str(prompts), "--methods", "none,prompt_lookup,early_exit"])
    result = json.loads(capsys.readouterr().out)
    assert result["mode"] == "over HTTP"
    check_rows(result)
    assert {r["method"] for r in result["rows"]} == {"none", "prompt_lookup", "early_exit"}
    assert {r["model"] for r in result["rows"]} == {"micro", "micro-layerskip"}
    assert len(result["rows"]) == 2 * (1 + 6 + 1)


def test_prompt_file_is_checked(tmp_path):
    bad = tmp_path / "prompts.json"
    bad.write_text(json.dumps({"fresh": "x"}))
    with pytest.raises(SystemExit, match="fresh.*repeating"):
        workshop.load_prompts(str(bad))


def test_repeats_at_least_five():
    with pytest.raises(SystemExit):
        workshop.parse_args(["--repeats", "3"])


def test_plan_orders_rows_and_includes_what_is_registered():
    rows = workshop.plan(["micro", "micro-layerskip"],
                         ["auto", "early_exit", "my_plugin", "medusa", "none", "suffix"])
    assert rows[0] == ("micro", "none", {})
    assert rows[1:7] == [(m, "early_exit", {"exit_layer": e})
                         for m in ("micro", "micro-layerskip") for e in (1, 2, 3)]
    assert [r[1] for r in rows[7:]] == ["suffix", "medusa", "auto", "my_plugin"]
    assert workshop.plan(["micro"], ["none", "suffix"], only=["suffix"]) == [
        ("micro", "suffix", {})]


class FakeBackend:
    """Measures nothing: medusa 'has no weights', the rest return fixed figures."""

    mode = "fake"

    def models(self):
        return ["micro"]

    def methods(self):
        return ["none", "medusa", "prompt_lookup"]

    def measure(self, model, prompt, method, params, tokens, repeats):
        if method == "medusa":
            raise Unavailable("no Medusa heads for micro")
        drafted, accepted = (0, 0) if method == "none" else (10, 5)
        spec = {"drafted": drafted, "accepted": accepted,
                "acceptance_rate": accepted / drafted if drafted else None,
                "target_passes": 10, "tokens_per_pass": (accepted + 10) / 10,
                "draft_cost": 0.0, "estimated_speedup": (accepted + 10) / 10}
        return spec, 1.0


def test_a_drafter_that_cannot_run_is_skipped_with_a_note():
    notes = []
    result = workshop.run(FakeBackend(), {"fresh": "a", "repeating": "b"}, 8, 5,
                          log=notes.append)
    assert [r["method"] for r in result["rows"]] == ["none", "prompt_lookup"] * 2
    assert result["skipped"] == [{"model": "micro", "method": "medusa", "params": {},
                                  "reason": "no Medusa heads for micro"}]
    table = workshop.render(result)
    assert "skipped: medusa on micro: no Medusa heads for micro" in table
    assert "0 drafted" in table and "[1.54]" in table  # course figure beside prompt lookup
