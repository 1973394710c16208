"""The packed-attention benchmark runs end to end: every variant agrees with the engine's
padded call (it asserts so itself) and is reported, nodraft's kernel where it loads."""

import json

from benchmarks import packed_attention
from nodraft.micro import gemm


def test_packed_attention_reports_every_variant(tmp_path, capsys):
    out = tmp_path / "attention.json"
    packed_attention.main(["--slots", "5", "--min-context", "3", "--max-context", "40",
                           "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    kernel = ["kernel", "kernel, 4 KiB pages"] if gemm.load() else []
    assert [r["variant"] for r in result["rows"]] == [
        "padded", "buckets-2", "buckets-4", "compiled", "graph", "per-sequence", *kernel]
    assert len(result["contexts"]) == 5 and all(3 <= c <= 40 for c in result["contexts"])
    assert all(r["us_per_layer"] > 0 for r in result["rows"])
    assert "| per-sequence |" in capsys.readouterr().out
