"""The in-process load benchmark runs end to end and reports every (streams, method,
temperature)."""

import json

from benchmarks import engine_load
from nodraft.drafters.suffix import SuffixDecoding


def test_engine_load_reports_each_concurrency_method_and_temperature(tmp_path, capsys):
    close = SuffixDecoding.close
    out = tmp_path / "load.json"
    engine_load.main(["--concurrency", "1,2", "--requests-per-stream", "1", "--max-tokens", "4",
                      "--rounds", "1", "--sampling", "0,0.8", "--seed", "3",
                      "--no-response-store", "--prefix-cache-mb", "64,0", "--out", str(out)])
    assert SuffixDecoding.close is close  # the switch is undone
    rows = json.loads(out.read_text())["rows"]
    assert [(r["concurrency"], r["temperature"], r["prefix_cache_mb"], r["method"])
            for r in rows] == [(c, t, pc, m) for c in (1, 2) for t in (0.0, 0.8)
                               for pc in (64, 0) for m in ("none", "auto")]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    # one request a stream: no request waited, so no sustained figure
    assert all(r["sustained_tokens_per_s"] is None for r in rows)
    assert all(r["x_first_prefix_cache"] == 1 for r in rows if r["prefix_cache_mb"] == 64)
    assert "| 2 | 0.8 | auto | 0 |" in capsys.readouterr().out


def test_sustained_rate_counts_the_steps_until_the_last_request_started():
    steps = [(1.0, 1), (1.5, 3), (2.0, 2), (2.5, 1), (3.0, 4)]
    assert engine_load.sustained_rate(steps, 0.5, 2.0) == 6 / 1.5
    assert engine_load.sustained_rate(steps, 0.0, 3.0) == 11 / 3.0


def test_a_queued_run_reports_its_sustained_rate(tmp_path):
    out = tmp_path / "load.json"
    engine_load.main(["--concurrency", "2", "--requests-per-stream", "3", "--max-tokens", "4",
                      "--rounds", "1", "--methods", "none", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["sustained_tokens_per_s"] > 0 and row["sustained_x_first_method"] == 1
