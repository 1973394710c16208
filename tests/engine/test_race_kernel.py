"""``nodraft::argmax`` (micro/csrc/race.cpp), greedy's tokens: torch.argmax's, the first of
equal maxima. ``nodraft::race``, the race ``engine.sampling.race`` runs where
nodraft's kernels are loaded: the same noise as the numpy race (SHAKE256, bit for bit), the
same tokens but where float32 rounding ties two ratios, the target's distribution, and each
row's token independent of the rest of the call. And ``nodraft::kept``, top-k and top-p's
kept tokens by a radix select: the sort's set but where a token's mass above lies within
rounding of ``top_p``; ties kept together; inside the race, removed tokens never drawn."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from nodraft.engine import sampling, verify
from nodraft.engine.sampling import PositionNoise, kept_kernel, race
from nodraft.engine.verify import SamplingParams
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


def exact_kept(scaled: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, margin) of each token by the rule, in float64: kept iff fewer than ``top_k``
    tokens are strictly above it and those top-k keeps above it weigh under ``top_p``;
    margin, how far that mass above lies from ``top_p`` (relative)."""
    x = scaled.double()
    above = (x[:, None, :] > x[:, :, None])  # (R, V, V): u above v
    keep = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < x.shape[-1]:
        keep = above.sum(-1) < top_k
        x = x.masked_fill(~keep, float("-inf"))
    p = x.softmax(-1)
    mass = (above * p[:, None, :]).sum(-1)
    if top_p < 1.0:
        keep &= (mass < top_p) | (x == x.max(-1, keepdim=True).values)
    return keep, (mass - top_p).abs() / top_p


@pytest.mark.parametrize("top_k,top_p", [(0, 0.95), (0, 0.5), (0, 0.999), (40, 1.0),
                                         (40, 0.8), (1, 0.9), (0, 0.0)])
def test_kept_is_the_rule_but_within_rounding_of_top_p(top_k, top_p):
    """The kernel's kept set against the rule computed by brute force in float64 (every
    pair of tokens compared): equal, but for tokens whose mass above lies within 1e-5 of
    ``top_p`` -- the kernel's sums are float64 in its own order -- and there are few.
    Top-k counts, so it agrees exactly."""
    torch.manual_seed(4)
    differ = 0
    for trial in range(40):
        x = torch.randn(4, 1024) * (0.5 + trial % 8)
        if trial % 4 == 0:
            x[:, torch.randperm(1024)[:300]] = float("-inf")
        scaled = x / 0.8
        want, margin = exact_kept(scaled, top_k, top_p)
        got = kept_kernel(scaled, top_k, top_p)
        wrong = got != want
        assert bool((margin[wrong] < 1e-5).all()), margin[wrong]
        differ += int(wrong.sum())
        if top_p >= 1.0:
            assert not wrong.any()
    assert differ <= 2, differ


@pytest.mark.parametrize("implementation", ["numpy", "native"])
def test_tokens_of_equal_logits_are_kept_together(monkeypatch, implementation):
    """Ties: equal logits are kept or removed together, in both implementations -- the
    rule is the set of tokens with less than ``top_p`` above them (fewer than ``top_k``),
    whichever way a sort would order the tied."""
    if implementation == "numpy":
        monkeypatch.setenv("NODRAFT_RACE", "numpy")
    assert sampling.native() == (implementation == "native")
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0, 0.0, -1.0, -1.0]])
    for sp, want in [(SamplingParams(temperature=1.0, top_p=0.5), 4),
                     (SamplingParams(temperature=1.0, top_k=2), 4),
                     (SamplingParams(temperature=1.0, top_k=5), 6),
                     (SamplingParams(temperature=1.0, top_p=0.01), 1)]:
        keep = verify.kept(logits / sp.temperature, sp)
        assert keep[0].tolist() == [True] * want + [False] * (8 - want), sp
    flat = torch.zeros(1, 64)
    assert verify.kept(flat, SamplingParams(temperature=1.0, top_p=0.3, top_k=5)).all()


def test_the_filtered_race_agrees_with_numpy(monkeypatch):
    """Top-k and top-p inside ``nodraft::race`` against the numpy race over the masked
    logits, per-row settings in one call (``verify.race_blocks``): the same tokens but at
    rounding ties, at most 1 row in 1,000."""
    torch.manual_seed(5)
    settings = [SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(temperature=1.0),
                SamplingParams(temperature=0.9, top_k=50, top_p=0.9),
                SamplingParams(temperature=1.2, top_k=20)]
    agree = total = 0
    for trial in range(150):
        x = torch.randn(10, 4096) * (1 + trial % 5)
        blocks = [(settings[(trial + b) % 4], n) for b, n in enumerate((3, 1, 4, 2))]
        noises = [PositionNoise(trial * 10 + r, 4096) for r in range(10)]
        args = (x, blocks, noises, list(range(10)))
        monkeypatch.setenv("NODRAFT_RACE", "numpy")
        want = verify.race_blocks(*args)
        monkeypatch.delenv("NODRAFT_RACE")
        got = verify.race_blocks(*args)
        agree += sum(a == b for a, b in zip(want, got))
        total += 10
    assert agree >= total * 0.999, (agree, total)


def test_the_filtered_race_samples_the_filtered_distribution():
    """Over many seeds, the race with top-k and top-p inside draws each kept token as often
    as ``target_probs`` gives it, removed tokens never (chi-square, rare cells pooled)."""
    torch.manual_seed(6)
    vocab, n = 50, 20_000
    logits = torch.randn(vocab) * 2
    sp = SamplingParams(temperature=0.9, top_k=30, top_p=0.85)
    p = verify.target_probs(logits, sp).double().numpy()
    assert (p == 0).sum() > vocab - 30  # the filters removed something
    x = logits.expand(1000, vocab).contiguous()
    counts = np.zeros(vocab)
    for block in range(n // 1000):
        noises = [PositionNoise(block * 1000 + r, vocab) for r in range(1000)]
        for tok in verify.race_blocks(x, [(sp, 1000)], noises, [5] * 1000):
            counts[tok] += 1
    assert counts[p == 0].sum() == 0
    expected = p / p.sum() * n
    keep = expected >= 5
    obs = np.append(counts[keep], counts[~keep & (p > 0)].sum())
    exp = np.append(expected[keep], expected[~keep & (p > 0)].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert chisquare(obs, exp).pvalue > 1e-3


@pytest.mark.parametrize("rows,vocab", [(1, 4096), (32, 4096), (3, 7), (5, 13), (2, 8), (0, 9)])
def test_argmax_gives_torchs_tokens(rows, vocab):
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab))
    assert torch.ops.nodraft.argmax.default(x) == x.argmax(-1).tolist()
    assert verify.greedy_tokens(x) == x.argmax(-1).tolist()


def test_argmax_ties_infinities_nans_and_views():
    x = torch.zeros(3, 4096)
    x[0, 100] = x[0, 3000] = 5.0  # equal maxima: the first
    x[1, 4090] = x[1, 4095] = 1.0  # in the last eight
    x[2] = float("-inf")  # nothing finite: the first
    assert torch.ops.nodraft.argmax.default(x) == [100, 4090, 0] == x.argmax(-1).tolist()
    y = torch.randn(2, 30, generator=torch.Generator().manual_seed(1))
    y[1, 17] = float("nan")  # torch's answer for a row with a NaN
    assert torch.ops.nodraft.argmax.default(y) == y.argmax(-1).tolist()
    z = torch.randn(4, 4096, generator=torch.Generator().manual_seed(2))[:, ::2]  # a view
    assert torch.ops.nodraft.argmax.default(z) == z.argmax(-1).tolist()
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.nodraft.argmax.default(z.double())
