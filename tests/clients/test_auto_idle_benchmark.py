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


def test_an_unknown_regime_is_refused():
    with pytest.raises(SystemExit):
        auto_idle.main(["--regime", "t0.3"])
