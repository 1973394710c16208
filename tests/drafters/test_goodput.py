"""The one goodput model: the belief's expectations, and the two ways drafts are sized."""

import pytest

from nodraft.drafters.costs import PassCost
from nodraft.drafters.goodput import (Acceptance, PassFit, best_length, marginal_length,
                                      regime)
from nodraft.engine.scheduler import SeqDraftState


def test_marginal_length_is_the_longest_draft_whose_last_token_pays():
    for a, r in ((1, 1), (6, 4), (95, 5), (1, 9), (30, 2)):
        tokens = Acceptance(a, r).tokens(16)
        for b, t, G in ((5e-5, 0.0, 600.0), (5e-5, 0.0, 6000.0), (1e-4, 2e-3, 900.0),
                        (5e-5, 0.0, 19000.0)):
            k = marginal_length(tokens, b, t, G)
            paying = [j for j in range(1, 17) if (tokens[j] - tokens[j - 1]) / b > G]
            longest = max(paying, default=0)
            # the marginal gains fall with j, so the paying tokens are a prefix
            assert paying == list(range(1, longest + 1))
            repays = longest and (tokens[longest] - 1) / (t + longest * b) > G
            assert k == (longest if repays else 0), (a, r, b, t, G)


def test_best_length_is_the_brute_force_best():
    cost = PassCost({1: 1.0, 2: 1.1, 3: 1.2, 5: 1.5, 9: 2.5, 17: 4.5})
    for a, r in ((1, 1), (9, 1), (2, 6), (97, 3)):
        belief = Acceptance(a, r)
        for draft_s in (0.0, 0.5):
            g, k = best_length(belief, 16, cost, draft_s)
            want = max(range(1, 17), key=lambda j: (belief.tokens(j)[j] / (draft_s + cost(j + 1)), -j))
            assert k == want
            assert g == pytest.approx(belief.tokens(k)[k] / (draft_s + cost(k + 1)))


def test_a_cost_tables_prices_are_its_calls_and_price_drafts_alike():
    """``PassCost.prices`` lists what calling the table gives, scales applied; ``best_length``
    gives the same (goodput, k) from it as from any callable, to the bit."""
    cost = PassCost({1: 2.3e-4, 2: 3.3e-4, 3: 3.4e-4, 5: 4.5e-4, 9: 9e-4, 17: 1.5e-3})
    assert cost.prices(20) == [cost(r) for r in range(21)]
    cost.observe(1, 2.6e-4)
    cost.observe(4, 6e-4)  # several rows: a scale of their own
    assert cost.prices(80) == [cost(r) for r in range(81)]  # past the table's sizes too
    for a, r in ((1, 1), (9, 1), (2, 6), (97, 3), (14.39, 3.25)):
        for n in (0, 1, 7, 16, 40):
            for draft_s in (0.0, 1e-4):
                got = best_length(Acceptance(a, r), n, cost, draft_s)
                assert got == best_length(Acceptance(a, r), n, lambda x: cost(x), draft_s)
                tokens = Acceptance(a, r).tokens(n)
                want = max(((tokens[k] / (draft_s + cost(k + 1)), k) for k in range(1, n + 1)),
                           key=lambda t: (t[0], -t[1]), default=(0.0, 0))
                assert got == want


def test_the_scheduler_and_auto_count_with_the_same_belief():
    seq, auto = SeqDraftState(), Acceptance()
    for depth, accepted in ((4, 4), (4, 1), (6, 0), (3, 3)):
        seq.observe(depth, accepted)
        auto.observe(depth, accepted)
    assert (seq.accepted, seq.rejected) == (auto.accepted, auto.rejected)
    assert seq.tokens(8) == auto.tokens(8)
    seq.observe(0, 0)  # a step without a draft is not evidence: it only counts as idle
    assert (seq.accepted, seq.idle) == (auto.accepted, 1)


def test_the_belief_at_its_mean_and_in_expectation():
    wide = Acceptance(1.0, 1.0)
    assert wide.at_mean(3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert wide.tokens(3)[3] == pytest.approx(1 + 1 / 2 + 1 / 3 + 1 / 4)  # E[alpha^j] = 1/(j+1)


def test_the_pass_fit_and_the_regimes():
    fit = PassFit()
    assert fit.coefficients == fit.prior  # too few passes seen
    for rows in range(1, 20):
        fit.observe(rows, 0.003 + 0.0002 * rows)
    a, b, *_ = fit.coefficients
    assert (a, b) == (pytest.approx(0.003, rel=1e-2), pytest.approx(0.0002, rel=1e-2))
    assert [regime(t) for t in (0.0, 0.01, 0.7, 0.85, 0.9, 1.3)] == [
        "greedy", "greedy", "t<=0.85", "t<=0.85", "t>0.85", "t>0.85"]
