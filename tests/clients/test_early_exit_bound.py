"""The early-exit ceiling benchmark's arithmetic and its acceptance count."""

import pytest
import torch

from benchmarks import early_exit_bound as bound
from nodraft.micro.model import KVCache
from tests.conftest import tiny_model


def test_the_ceiling_divides_expected_tokens_by_a_steps_cost():
    K = bound.K
    # every draft token accepted, a draft step half a pass, passes linear in their rows;
    # verification reuses the layers below the exit (E = 1 of L = 4)
    ceil = bound.ceilings([1.0] * K, 0.5, lambda n: float(n), 1, 4)
    for k, got in enumerate(ceil, start=1):
        assert got == pytest.approx((k + 1) / (k * 0.5 + 0.75 * (k + 1) + 0.25))
    # nothing accepted: one token a step, whatever is drafted
    none = bound.ceilings([0.0] * K, 0.5, lambda n: 1.0, 2, 4)
    assert none == pytest.approx([1 / (k * 0.5 + 1.0) for k in range(1, K + 1)])
    # acceptance conditional on the position: a(2) counts only where a(1) held
    half = bound.ceilings([1.0, 0.5] + [0.0] * (K - 2), 0.0, lambda n: 1.0, 1, 4)
    assert half[0] == pytest.approx(2.0) and half[1] == pytest.approx(2.5)


def test_acceptance_is_counted_per_position_of_the_drafts():
    """a(1) is the share of drafting steps whose first draft token was accepted, a(2) the
    share of those whose second was too, ... -- checked against the same greedy decode's
    own per-position counts (``SpecStats.accepted_by_position``)."""
    from tests.engine.helpers import generate

    model = tiny_model(dtype=torch.float32)
    cache = KVCache(model.config, 2)
    prompt = [4, 8, 15, 16, 23, 42] * 3
    a, steps = bound.acceptance(model, cache, "tiny", {"x": [{"ids": prompt}]}, "greedy", 1,
                                24, 1)
    assert len(a) == bound.K and steps > 0
    _, seq, results = generate(model, prompt, 24, "early_exit",
                               {"exit_layer": 1, "num_speculative_tokens": bound.K})
    drafting = [r for r in results if r.draft]
    assert len(drafting) == steps
    by_position = seq.stats.accepted_by_position + [0] * bound.K
    for i in range(1, bound.K + 1):  # drafted at i with the i - 1 before it accepted
        reached = sum(1 for r in drafting if len(r.draft) >= i and r.accepted >= i - 1)
        want = by_position[i - 1] / reached if reached else 0.0
        assert a[i - 1] == pytest.approx(want)
