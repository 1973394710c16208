"""``benchmarks/auto_idle.py``: its pairs are ``none`` against ``auto`` on the same seeded
text, and it refuses a regime where the comparison means nothing."""

import pytest

from benchmarks import auto_idle
from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_model


def test_pairs_time_none_against_auto_on_the_same_seeded_text():
    model = load_model("micro", CHECKPOINT_DIR)
    prompts = [{"ids": [10, 11, 12, 13]}, {"ids": [40, 41, 42], "stop_ids": [0]}]
    ratios = auto_idle.pairs(model, prompts, "t1.0", repeats=2, tokens=6)
    assert len(ratios) == 4 and all(r > 0 for r in ratios)


def test_a_greedy_regime_is_refused():
    with pytest.raises(SystemExit):
        auto_idle.main(["--regime", "greedy"])
