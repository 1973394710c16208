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
    model = tiny_model(dtype=torch.float32)
    cache = KVCache(model.config, 2)
    prompts = {"x": [{"ids": [4, 8, 15, 16, 23, 42] * 3}, {"ids": [5, 6, 7]}]}
    a, steps = bound.acceptance(model, cache, "tiny", prompts, "greedy", 1, 24, 1)
    assert len(a) == bound.K and steps > 0
    assert all(0.0 <= x <= 1.0 for x in a)
