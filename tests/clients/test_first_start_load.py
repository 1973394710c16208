"""``benchmarks/first_start_load.py``'s windows: what counts as served while building."""

from benchmarks import first_start_load


def test_a_window_counts_the_completed_200s_inside_it_only():
    done = [(1.0, 2.0, 200, 32),  # inside
            (2.0, 4.0, 200, 32),  # inside
            (3.5, 5.5, 200, 32),  # ends past the window: not counted in it
            (0.5, 1.5, 200, 32),  # started before it
            (2.5, 3.0, 503, 0),  # not a completion
            (4.0, 4.5, "ReadTimeout", 0)]
    w = first_start_load.window(done, 1.0, 5.0)
    assert w["completions"] == 2 and w["tokens_per_s"] == 16.0
    assert w["latency_p50_s"] == 1.5
    assert first_start_load.window(done, 5.0, 6.0)["latency_p50_s"] is None
