"""The second invariant: with sampling on, every drafter leaves the target's distribution
exactly as it is -- under both rules: seeded requests (the Gumbel-max race over per-position
noise, drafter-invariant) and unseeded ones (the race over the request's own noise for drafts
without q; Leviathan/Chen rejection for drafts with q)."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from nodraft.drafters.base import Draft
from nodraft.micro.model import MicroConfig
from nodraft.engine.verify import SamplingParams, target_probs
from tests.conftest import tiny_model
from tests.engine.helpers import REGISTRY, drafter_env, generate

SMALL = MicroConfig(vocab_size=8, dim=16, n_layers=4, n_heads=2, ffn_dim=32, max_positions=64)
MODEL = tiny_model(seed=3, config=SMALL)
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
N = 1200


class FixedTree:
    """Proposes the same 6-node tree every step (two branches, a sub-branch)."""

    name = "fixed_tree"

    def propose(self, ctx, budget):
        return Draft(torch.tensor([3, 1, 4, 2, 0, 5])[:budget],
                     torch.tensor([-1, -1, 0, 0, 1, 2])[:budget])

    def observe(self, ctx, accepted):
        pass


@dataclass
class RandomChainWithQ:
    """Samples a 3-token chain from a fixed, wrong distribution q and sends q along."""

    name = "random_chain_q"

    def propose(self, ctx, budget):
        q = torch.tensor([0.3, 0.05, 0.05, 0.3, 0.1, 0.1, 0.05, 0.05], dtype=torch.float64)
        toks = torch.multinomial(q, min(3, budget), replacement=True, generator=ctx.generator)
        return Draft(toks, None, q.expand(len(toks), -1))

    def observe(self, ctx, accepted):
        pass


def exact_joint(sp: SamplingParams) -> np.ndarray:
    """P(first two generated tokens = a, b) under the target alone."""
    with torch.no_grad():
        p1 = target_probs(MODEL(torch.tensor([PROMPT]))[0, -1], sp)
        joint = np.zeros((8, 8))
        for a in range(8):
            p2 = target_probs(MODEL(torch.tensor([PROMPT + [a]]))[0, -1], sp)
            joint[a] = (p1[a].double() * p2.double()).numpy()
    return joint / joint.sum()  # float32 probabilities sum to 1 only to ~1e-7


def sample_joint(sp_args: dict, method=None, params=None, drafter_cls=None,
                 seeded: bool = True) -> np.ndarray:
    counts = np.zeros((8, 8))
    shared: dict = {}
    for i in range(N):
        if not seeded:
            torch.manual_seed(i)  # an unseeded request's stream comes from torch's global one
        sp = SamplingParams(seed=i if seeded else None, **sp_args)
        drafter = drafter_cls() if drafter_cls else None
        # 4 tokens so a step's draft can be 3 deep; the first two are compared
        out, _, _ = generate(MODEL, PROMPT, 4, method or "none", params, sp, shared=shared,
                             drafter=drafter)
        counts[out[0], out[1]] += 1
    return counts


CASES = [("none", {}, None), ("prompt_lookup", {}, None), ("early_exit", {"exit_layer": 1}, None),
         ("early_exit", {"exit_layer": 3}, None),
         ("early_exit", {"exit_layer": 2, "draft_vocab": 4, "reuse_kv": True}, None),
         ("suffix", {"min_token_prob": 0.01}, None),
         ("lookahead", {"window": 3, "ngram": 3}, None),
         ("medusa", {}, None),
         ("eagle", {}, None),
         ("auto", {}, None),
         ("fixed_tree", None, FixedTree), ("random_chain_q", None, RandomChainWithQ)]
T1 = {"temperature": 1.0}
FILTERED = {"temperature": 0.7, "top_k": 5, "top_p": 0.9}
BOTH = [(*c, T1) for c in CASES] + [(*c, FILTERED) for c in CASES if c[0] in
                                     ("early_exit", "fixed_tree", "random_chain_q", "eagle")]
# Unseeded (the race for point masses, the rejection rule for drafts with q): every case. Seeded: plain sampling only -- with a seed every
# drafter's text IS plain sampling's, which test_every_case_samples_plain_samplings_text
# checks here, seed by seed, and tests/engine/test_invariance.py on the checkpoints.
PARAMS = [(*c, False) for c in BOTH] + [(*c, True) for c in BOTH if c[0] == "none"]


def test_every_registered_method_is_covered():
    assert {c[0] for c in CASES} >= set(REGISTRY.names())


@pytest.mark.parametrize("method,params,cls,sp_args,seeded", PARAMS,
                         ids=[f"{c[0]}{c[1] or ''}-{c[3]}-{'seeded' if c[4] else 'unseeded'}"
                              for c in PARAMS])
def test_sampled_tokens_follow_the_target_distribution(method, params, cls, sp_args, seeded):
    expected = exact_joint(SamplingParams(**sp_args)).flatten() * N
    observed = sample_joint(sp_args, None if cls else method, params, cls, seeded).flatten()
    assert observed[expected == 0].sum() == 0  # nothing outside the support (top-k/top-p)
    keep = expected >= 5  # pool rare cells so the chi-square approximation holds
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert chisquare(obs, exp).pvalue > 1e-3


@pytest.mark.parametrize("method,params,cls,sp_args", BOTH,
                         ids=[f"{c[0]}{c[1] or ''}-{c[3]}" for c in BOTH])
def test_every_case_samples_plain_samplings_text(method, params, cls, sp_args):
    """Seeded, each case's first tokens are plain sampling's with the same seed (so their
    distribution is the one the seeded chi-square test checks for ``none``)."""
    shared: dict = {}
    for i in range(100):
        sp = SamplingParams(seed=i, **sp_args)
        want, _, _ = generate(MODEL, PROMPT, 4, "none", None, sp)
        got, _, _ = generate(MODEL, PROMPT, 4, None if cls else method, params, sp,
                             shared=shared, drafter=cls() if cls else None)
        assert got == want, (method, params, i)


POINT_MASS = [("prompt_lookup", {}, None), ("suffix", {"min_token_prob": 0.01}, None),
              ("lookahead", {"window": 3, "ngram": 3}, None), ("fixed_tree", None, FixedTree)]


@pytest.mark.parametrize("method,params,cls", POINT_MASS, ids=[c[0] for c in POINT_MASS])
def test_unseeded_point_mass_drafts_are_verified_by_the_race(method, params, cls):
    """Unseeded, a draft without q is verified by the race over the request's own noise
    (``Sequence.race_noise``): from the same global torch seed, such a drafter's text is
    plain sampling's, token for token (the rejection rule would give another text)."""
    shared: dict = {}
    sp = SamplingParams(temperature=1.0)
    accepted = 0
    for i in range(40):
        # drafters built before the seed is set: building may draw from torch's global stream
        plain = REGISTRY.build(*REGISTRY.parse({"method": "none"}), drafter_env(MODEL, shared))
        drafter = cls() if cls else REGISTRY.build(
            *REGISTRY.parse({"method": method, **params}), drafter_env(MODEL, shared))
        torch.manual_seed(i)
        want, _, _ = generate(MODEL, PROMPT, 8, "none", None, sp, drafter=plain)
        torch.manual_seed(i)
        got, seq, steps = generate(MODEL, PROMPT, 8, method, params, sp, drafter=drafter)
        assert got == want, (method, i)
        accepted += sum(s.n_accepted for s in steps)
    assert accepted > 0 and seq.noise is None  # drafts were verified (and kept) unseeded


def test_unseeded_drafts_with_q_keep_the_rejection_rule():
    torch.manual_seed(0)
    _, seq, _ = generate(MODEL, PROMPT, 2, "none", None, SamplingParams(temperature=1.0))
    q = torch.full((1, 8), 1 / 8)
    assert seq.race_noise(Draft(torch.tensor([3]), None, q)) is None
    assert seq.race_noise(Draft(torch.tensor([3]), None)) is not None
    _, seeded, _ = generate(MODEL, PROMPT, 2, "none", None,
                            SamplingParams(temperature=1.0, seed=1))
    assert seeded.race_noise(Draft(torch.tensor([3]), None, q)) is seeded.noise
