"""``nodraft::race`` (micro/csrc/race.cpp), the race ``engine.sampling.race`` runs where
nodraft's kernels are loaded: the same noise as the numpy race (SHAKE256, bit for bit), the
same tokens but where float32 rounding ties two ratios, the target's distribution, and each
row's token independent of the rest of the call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from nodraft.engine import sampling
from nodraft.engine.sampling import PositionNoise, race
from nodraft.micro import gemm

pytestmark = pytest.mark.skipif(not gemm.load(), reason=f"nodraft's kernels: {gemm.why()}")


def both(monkeypatch, *args, **kwargs) -> tuple[list[int], list[int]]:
    monkeypatch.setenv("NODRAFT_RACE", "numpy")
    assert not sampling.native()
    want = race(*args, **kwargs)
    monkeypatch.delenv("NODRAFT_RACE")
    assert sampling.native()
    return want, race(*args, **kwargs)


@pytest.mark.parametrize("vocab", [4096, 50, 8])
def test_equal_weights_make_the_noise_alone_decide(monkeypatch, vocab):
    """Every weight exactly 1 (equal logits): the token is the noise's alone, so the
    kernel's SHAKE256 streams and exponentials must equal numpy's exactly -- including
    seeds above 2**63 and padded groups (50 = 7 groups of 8, the last short)."""
    rows = 64
    x = torch.zeros(rows, vocab)
    for trial in range(20):
        seeds = [trial * rows + r for r in range(rows // 2)]
        seeds += [2**64 - 1 - s for s in seeds]
        noises = [PositionNoise(s, vocab) for s in seeds]
        positions = [trial * 1000 + r for r in range(rows)]
        want, got = both(monkeypatch, x, noises, positions)
        assert got == want


def test_the_kernel_agrees_with_numpy_on_logits(monkeypatch):
    """Random logits at several scales and temperatures, a third with tokens removed (-inf):
    the tokens agree but where two ratios tie to float32 rounding (the two races compute
    the weights' exponentials differently) -- at most 1 row in 1,000."""
    torch.manual_seed(0)
    vocab, agree, total = 4096, 0, 0
    for trial in range(300):
        x = torch.randn(8, vocab) * (1 + trial % 5)
        if trial % 3 == 0:
            x[:, torch.randperm(vocab)[:1000]] = float("-inf")
        noises = [PositionNoise(trial * 8 + r, vocab) for r in range(8)]
        temps = [0.5 + 0.1 * r for r in range(8)]
        want, got = both(monkeypatch, x, noises, list(range(8)), temps)
        agree += sum(a == b for a, b in zip(want, got))
        total += 8
    assert agree >= total * 0.999, (agree, total)


def test_a_temperature_divides_as_the_scaled_logits_do():
    """``race(logits, temperatures=T)`` is ``race(logits / T)``: the kernel takes the largest
    logit over T as the largest scaled one (the division keeps the order)."""
    torch.manual_seed(1)
    x = torch.randn(16, 4096) * 4
    temps = [0.3 + 0.05 * r for r in range(16)]
    noises = [PositionNoise(7 + r, 4096) for r in range(16)]
    positions = list(range(100, 116))
    assert race(x, noises, positions, temps) == race(x / torch.tensor(temps)[:, None], noises,
                                                     positions)


def test_rows_do_not_depend_on_each_other():
    torch.manual_seed(2)
    x = torch.randn(12, 4096) * 3
    noises = [PositionNoise(s, 4096) for s in range(12)]
    positions = list(range(12))
    batch = race(x, noises, positions, [0.8] * 12)
    alone = [race(x[r:r + 1], noises[r:r + 1], positions[r:r + 1], [0.8])[0] for r in range(12)]
    assert batch == alone


@pytest.mark.parametrize("vocab", [8, 50])
def test_the_kernel_samples_the_target_distribution(vocab):
    """Over many seeds the kernel's tokens follow softmax(logits / T), removed tokens never
    drawn (chi-square, rare cells pooled)."""
    torch.manual_seed(3)
    logits = torch.randn(vocab) * 2
    logits[vocab // 2] = float("-inf")
    T, n = 0.9, 20_000
    p = torch.softmax(logits.double() / T, -1).numpy()
    p /= p.sum()
    x = logits.expand(1000, vocab).contiguous()
    counts = np.zeros(vocab)
    for block in range(n // 1000):
        noises = [PositionNoise(block * 1000 + r, vocab) for r in range(1000)]
        for tok in race(x, noises, [5] * 1000, [T] * 1000):
            counts[tok] += 1
    assert counts[vocab // 2] == 0
    expected = p * n
    keep = expected >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert chisquare(obs, exp).pvalue > 1e-3
