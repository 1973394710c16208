"""The pass-price benchmark's replay: each pass priced before it is learnt from."""

import pytest

from benchmarks import pass_prices
from nodraft.drafters.costs import PassCost


def test_each_pass_is_priced_before_it_is_learnt_from():
    table = PassCost({1: 1e-3, 2: 1.2e-3, 3: 1.4e-3, 5: 1.8e-3, 9: 2.6e-3, 17: 4.2e-3},
                     start=32, reads={128: (0.1e-3, 0.05e-3), 512: (0.5e-3, 0.25e-3)})
    # passes that took exactly what the table with its context reads says
    passes = [(rows, table(rows, ctx), ctx) for ctx in (100, 300, 450) for rows in (1, 2, 5, 12)]
    exact = pass_prices.replay(passes, table, True)
    assert sum(v["passes"] for v in exact.values()) == len(passes)
    assert all(v["median_abs_log_error"] == pytest.approx(0, abs=1e-9) for v in exact.values())
    # priced at the table's own context, they look cheaper than they ran
    blind = pass_prices.replay(passes, table, False)
    assert blind["2-3 rows, 400+ cached"]["median_log_error"] < -0.05
    assert blind["1 row, 200-399 cached"]["median_log_error"] < 0
