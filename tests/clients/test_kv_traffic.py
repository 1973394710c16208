"""The KV-traffic benchmark's arithmetic: the attention over a batch's cached rows is its
pass at the context less its pass at context 1, per cached row of one head, and the keys
and values that read a second."""

import pytest

from benchmarks import kv_traffic


def test_the_attention_is_the_difference_of_two_passes_per_row_and_head():
    heads, ctx, ns = 16, 65, {2: 10.0, 8: 25.0}  # ns a cached row of one head, by batch
    med = {}
    for n, cost in ns.items():
        med[(n, 1, False)] = 100e-6 * n
        med[(n, ctx, False)] = 100e-6 * n + n * heads * (ctx - 1) * cost * 1e-9
    med[(8, ctx, True)] = med[(8, ctx, False)] + 500e-6  # the head
    r = kv_traffic.summarise(med, [2, 8], ctx, head_dim=40, heads=heads, roof=20e9)
    assert [row["sequences"] for row in r["rows"]] == [2, 8]
    assert [row["ns_per_cached_row_head"] for row in r["rows"]] == pytest.approx([10.0, 25.0])
    # a row of one head is its key and its value, 40 float32 each: 320 bytes
    assert [row["gb_per_s"] for row in r["rows"]] == pytest.approx([32.0, 12.8])
    assert r["rows"][1]["kv_mb_read"] == pytest.approx(8 * heads * ctx * 320 / 1e6)
    assert r["rows"][1]["attention_per_sequence_us"] == pytest.approx(heads * (ctx - 1) * 25e-3)
    attention = 8 * heads * (ctx - 1) * 25e-9
    assert r["attention_share"] == pytest.approx(attention / (800e-6 + attention + 500e-6))
    assert r["whole_pass_us"] == pytest.approx((800e-6 + attention + 500e-6) * 1e6)
    assert r["streaming_read_gb_per_s"] == pytest.approx(20.0)
    # a float16 cache's row is half the bytes: the same time reads half the bytes a second
    half = kv_traffic.summarise(med, [2, 8], ctx, head_dim=40, heads=heads, roof=20e9,
                                element=2)
    assert [row["gb_per_s"] for row in half["rows"]] == pytest.approx([16.0, 6.4])
    assert half["rows"][1]["kv_mb_read"] == pytest.approx(r["rows"][1]["kv_mb_read"] / 2)
