"""The EAGLE ceiling benchmark's arithmetic: a depth-d chain's tokens per pass from the
per-position acceptance, divided by its verification pass (and its draft levels)."""

import pytest

from benchmarks import eagle_ceiling


def test_a_chains_ceiling_is_its_tokens_over_its_pass_and_levels():
    p = [0.5, 0.25, 0.1]  # P(at least j of the chain's tokens accepted)
    rows = eagle_ceiling.ceilings(p, lambda r: 1.0 + 0.2 * (r - 1), 0.3)
    assert [r["depth"] for r in rows] == [1, 2, 3]
    assert [r["tokens_per_pass"] for r in rows] == pytest.approx([1.5, 1.75, 1.85])
    assert [r["free_draft"] for r in rows] == pytest.approx([1.5 / 1.2, 1.75 / 1.4, 1.85 / 1.6])
    assert [r["measured_draft"] for r in rows] == pytest.approx(
        [1.5 / 1.5, 1.75 / 2.0, 1.85 / 2.5])


def test_nothing_accepted_is_one_token_a_step_at_best():
    rows = eagle_ceiling.ceilings([0.0] * 4, lambda r: 1.0, 0.0)
    assert all(r["free_draft"] == pytest.approx(1.0) for r in rows)
