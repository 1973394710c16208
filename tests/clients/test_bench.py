"""``nodraft bench``: the workload suite's prompts, its loop share, and a short run of it."""

from __future__ import annotations

import json

import pytest

from nodraft.clients import bench
from nodraft.micro.checkpoint import load_tokenizer


def test_loop_share_counts_tokens_that_complete_a_seen_ngram():
    assert bench.loop_share([]) == 0.0
    assert bench.loop_share(list(range(20))) == 0.0
    # 1 2 3 4 repeated: after the first four, every token completes a 4-gram seen before
    loop = [1, 2, 3, 4] * 5
    assert bench.loop_share(loop) == pytest.approx(13 / 20)  # 4-grams from the 5th token: 16, 3 new
    assert bench.loop_share([7] * 10) == pytest.approx(6 / 10)


def test_every_category_has_its_own_held_out_prompts():
    tok = load_tokenizer()
    prompts = bench.build_prompts(tok, 2)
    assert list(prompts) == list(bench.CATEGORIES)
    names = [p["name"] for ps in prompts.values() for p in ps]
    assert all(len(ps) == 2 for ps in prompts.values())
    assert len(set(names)) == len(names)  # no function serves two categories
    assert all(len(p["ids"]) > 10 for ps in prompts.values() for p in ps)
    edit = tok.decode(prompts["edit"][0]["ids"])
    assert "_v2(" in edit  # the opening again, renamed
    chat = prompts["chat"][0]
    assert tok.decode(chat["ids"]).endswith("<|assistant|>") and chat["stop_ids"]
    # held out: every prompt comes from a module of the held-out split, none of the train's
    from nodraft.micro.corpus import split_documents
    units = {p["name"].split(" ")[0] if c == "long" else p["name"].rsplit(".", 1)[0]
             for c, ps in prompts.items() for p in ps}
    held_out = {d.unit for d in split_documents("heldout")}
    assert units <= held_out and not units & {d.unit for d in split_documents("train")}


def test_a_short_run_reports_every_row_and_checks_the_text(tmp_path, capsys):
    out, md, png = tmp_path / "bench.json", tmp_path / "bench.md", tmp_path / "bench.png"
    bench.main(["--models", "micro", "--categories", "edit,chat", "--regimes", "greedy,t1.0",
                "--methods", "none,prompt_lookup,suffix", "--prompts", "1", "--tokens", "12",
                "--repeats", "2", "--eager", "--json-out", str(out), "--md-out", str(md),
                "--plot", str(png)])
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 2 * 2 * 3
    for row in result["rows"]:
        assert row["speedup_min"] <= row["speedup"] <= row["speedup_max"]
        assert row["tokens_per_pass"] >= 1.0 and 0.0 <= row["loop_share"] <= 1.0
        assert row["none_tokens_per_s"] > 0
    assert {(s["category"], s["regime"]) for s in result["summary"]} == {
        (c, r) for c in ("edit", "chat") for r in ("greedy", "t1.0")}
    # plain decoding against itself is a column, never the best single drafter
    assert all(s["best"] in ("prompt_lookup", "suffix") and "none" in s["speedups"]
               for s in result["summary"])
    nulls = [r for r in result["rows"] if r["method"] == "none"]
    assert len(nulls) == 4 and all(r["acceptance_rate"] is None and r["tokens_per_pass"] == 1.0
                                   for r in nulls)
    assert "| micro | greedy | edit |" in md.read_text() and png.stat().st_size > 1000
    assert "measured against itself" in md.read_text()
    with pytest.raises(SystemExit):
        bench.main(["--regimes", "t9"])


def test_a_drafters_settings_are_columns_of_their_own(tmp_path, capsys):
    out = tmp_path / "bench.json"
    items = ["lookahead:window=1:ngram=3:guesses=1", "lookahead:window=2:ngram=4:guesses=2"]
    bench.main(["--models", "micro", "--categories", "code", "--regimes", "greedy",
                "--methods", ",".join(items), "--prompts", "1", "--tokens", "12",
                "--repeats", "1", "--eager", "--json-out", str(out)])
    result = json.loads(out.read_text())
    assert result["methods"] == items
    assert [r["method"] for r in result["rows"]] == items
    assert [r["params"] for r in result["rows"]] == [
        {"window": 1, "ngram": 3, "guesses": 1}, {"window": 2, "ngram": 4, "guesses": 2}]
    assert result["summary"][0]["best"] in items
    assert "| lookahead:window=1:ngram=3:guesses=1 |" in capsys.readouterr().out
    # a bad setting, an unknown drafter or an item given twice is refused before any run
    for bad in ("lookahead:window=0", "bogus", "suffix,suffix", "lookahead:window"):
        with pytest.raises(SystemExit):
            bench.main(["--models", "micro", "--methods", bad])
    assert "window must be in 1..32" in capsys.readouterr().err


def test_trained_drafters_read_their_weights_from_the_checkpoints_given(tmp_path):
    import shutil

    from nodraft.drafters.base import SpeculationError
    from nodraft.micro.checkpoint import CHECKPOINT_DIR

    for name in ("micro.safetensors", "micro.json", "tokenizer.json"):
        shutil.copy(CHECKPOINT_DIR / name, tmp_path)  # the model without its heads
    with pytest.raises(SpeculationError, match="no Medusa heads for 'micro'"):
        bench.main(["--models", "micro", "--checkpoints", str(tmp_path), "--methods", "medusa",
                    "--categories", "code", "--regimes", "greedy", "--prompts", "1",
                    "--tokens", "4", "--repeats", "1", "--eager"])


def test_a_warm_server_run_starts_from_what_the_other_categories_taught(tmp_path, monkeypatch):
    """``--server warm``: every run starts from the state a server has after the other
    categories' prompts in the same regime -- ``auto``'s beliefs and rests, never suffix
    decoding's store of responses; the default starts each run from a fresh server."""
    seen, measure = [], bench.measure

    def spy(model, name, prompt, regime, method, params, *args):
        seen.append((prompt["name"], regime, method, args[-1]))
        return measure(model, name, prompt, regime, method, params, *args)

    monkeypatch.setattr(bench, "measure", spy)
    out = tmp_path / "bench.json"
    common = ["--models", "micro", "--categories", "code,rag", "--regimes", "t1.0",
              "--methods", "auto", "--prompts", "1", "--tokens", "24", "--repeats", "1",
              "--eager", "--json-out", str(out)]
    bench.main(common + ["--server", "warm"])
    assert json.loads(out.read_text())["server"] == "warm" and len(seen) == 2
    for _, regime, method, shared in seen:
        state = shared()
        assert state and all(k.startswith("auto_") for k in state)  # no store of responses
        assert {key[2] for key in state.get("auto_alpha", {})} <= {"t>0.85"}
        assert state is not shared()  # each run its own copy
    assert seen[0][3] is not seen[1][3]  # each category taught by the others
    seen.clear()
    bench.main(common)
    assert [s[3] for s in seen] == [None, None]
    assert json.loads(out.read_text())["server"] == "fresh"
