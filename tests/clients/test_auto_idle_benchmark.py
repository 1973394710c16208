"""``benchmarks/auto_idle.py``: its pairs are ``none`` against ``auto`` on the same text
(seeded where sampled), and it refuses a regime the suite does not have."""

import pytest

from benchmarks import auto_idle
from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_model


@pytest.mark.parametrize("name,regime", [("micro", "t1.0"), ("micro-layerskip", "greedy")])
def test_pairs_time_none_against_auto_on_the_same_text(name, regime):
    model = load_model(name, CHECKPOINT_DIR)
    prompts = [{"ids": [10, 11, 12, 13]}, {"ids": [40, 41, 42], "stop_ids": [0]}]
    ratios = auto_idle.pairs(model, prompts, regime, repeats=2, tokens=6, name=name)
    assert len(ratios) == 4 and all(r > 0 for r in ratios)


def test_workers_price_passes_with_the_table_they_are_given():
    from nodraft.clients.measure import decode
    from nodraft.drafters import costs

    model = load_model("micro", CHECKPOINT_DIR)  # a model object of its own: none timed yet
    table = {1: 1e-3, 2: 1.1e-3, 3: 1.2e-3, 5: 1.5e-3, 9: 2.5e-3, 17: 4.5e-3}
    auto_idle.use_costs(model, table)
    decode(model, [10, 11, 12, 13], 8, "auto")  # its steps price, and learn, with it
    assert [costs.current(model).table(r) for r in table] == list(table.values())


def test_an_unknown_regime_is_refused():
    with pytest.raises(SystemExit):
        auto_idle.main(["--regime", "t0.3"])
