"""``benchmarks/batching.py``'s table: every figure a row has, and a dash for one it lacks."""

from benchmarks import batching


def test_render_shows_the_sustained_figures_and_dashes_for_missing_ones():
    row = {"server": "after", "temperature": 0.8, "concurrency": 32, "method": "auto",
           "tokens_per_s": 6000.0, "x_single_stream": 3.1, "x_none": 0.97,
           "sustained_tokens_per_s": 6200.0, "sustained_x_single_stream": 3.2,
           "sustained_x_none": 1.01, "ttft_p50_ms": 70.0, "ttft_p99_ms": 95.0,
           "itl_p50_ms": 3.0, "itl_p99_ms": 11.0, "cpu_us_per_token_api": 70.0,
           "cpu_us_per_token_engine": 130.0, "cpu_us_per_token_client": 65.0, "errors": 0}
    table = batching.render({"rows": [row, {**row, "sustained_tokens_per_s": None,
                                            "sustained_x_single_stream": None,
                                            "sustained_x_none": None, "itl_p50_ms": None}]})
    lines = table.splitlines()
    assert len(lines) == 4 and all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| 6000 | 3.10 | 0.97 | 6200 | 3.20 | 1.01 |" in lines[2]
    assert "| 6000 | 3.10 | 0.97 | - | - | - |" in lines[3]
    assert "| - / 11.00 |" in lines[3]
