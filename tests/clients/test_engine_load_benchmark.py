"""The in-process load benchmark runs end to end and reports every (streams, method)."""

import json

from benchmarks import engine_load
from nodraft.drafters.suffix import SuffixDecoding


def test_engine_load_reports_each_concurrency_and_method(tmp_path, capsys):
    close = SuffixDecoding.close
    out = tmp_path / "load.json"
    engine_load.main(["--concurrency", "1,2", "--requests-per-stream", "1", "--max-tokens", "4",
                      "--rounds", "1", "--no-response-store", "--out", str(out)])
    assert SuffixDecoding.close is close  # the switch is undone
    rows = json.loads(out.read_text())["rows"]
    assert [(r["concurrency"], r["method"]) for r in rows] == [
        (1, "none"), (1, "auto"), (2, "none"), (2, "auto")]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert "| 2 | auto |" in capsys.readouterr().out
