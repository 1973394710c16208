"""``auto``: the drafter with the best expected goodput each step, figures attributed."""

import dataclasses

import pytest
import torch

from nodraft.drafters import costs
from nodraft.drafters.base import NOT_LOOKED
from nodraft.drafters.auto import POOLED_MIN, REST_MAX, WHOLE, Auto
from nodraft.drafters.goodput import MAX_ALPHA, Acceptance, best_length
from nodraft.drafters.registry import Registry, SpeculationError
from tests.conftest import tiny_model
from tests.engine.helpers import generate, drafter_env

MODEL = tiny_model()


@pytest.fixture(autouse=True)
def fixed_prices():
    """The pass prices ``auto`` finds for MODEL, fixed for every test here (the shape timed
    for it on an idle machine: eager passes of a tiny model, nearly flat in their rows):
    what these tests check follows ``auto``'s choices, which a table timed on a busy
    machine (another test worker beside) would sway. The tests of the timing itself use
    models of their own."""
    table = costs.PassCost({1: 1.2e-3, 2: 1.35e-3, 3: 1.4e-3, 5: 1.45e-3, 9: 1.5e-3,
                            17: 1.6e-3})
    costs._COSTS[MODEL] = {costs.compiled_state(MODEL): table}
    yield table
    costs._COSTS.pop(MODEL, None)


@pytest.fixture(autouse=True)
def free_asks(monkeypatch):
    """Asks priced at nothing more than a plain step: a rest after an asked step where
    nothing paid doubles from one step (``Auto._rest_floor`` is 1), so the tests of the
    rests' course do not hang on what this machine's asked and plain steps took. The
    floor's own test prices asks (``test_an_ask_is_priced_and_rests_last_long_enough``)."""
    from nodraft.drafters import auto as auto_module

    monkeypatch.setattr(auto_module, "ASK_SHARE", float("inf"))


@pytest.fixture
def priced_clock(monkeypatch, fixed_prices):
    """The clock that ``auto`` and the sequence read, moved only by passes, each by its
    price in ``fixed_prices``: what a test of a whole generation checks then follows the
    text and ``auto``'s beliefs, not what else the machine (another test worker) was doing
    while a pass, a draft or a step was timed. Drafts and a step's other work take no time
    on this clock."""
    import types

    from nodraft.drafters import auto as auto_module
    from nodraft.engine import sequence as sequence_module
    from nodraft.engine.sequence import Sequence

    now = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(auto_module, "time", clock)
    monkeypatch.setattr(sequence_module, "time", clock)
    verify = Sequence.verify

    def priced(self, draft):
        out = verify(self, draft)
        now[0] += fixed_prices.table(1 + len(draft) + draft.n_aux)
        return out

    monkeypatch.setattr(Sequence, "verify", priced)


@pytest.fixture
def no_greedy_rests(monkeypatch):
    """Greedy ``auto`` asking at every step (no rests after steps where nothing paid): for
    the tests of what an ask does, step after step."""
    from nodraft.drafters import auto as auto_module

    monkeypatch.setattr(auto_module, "GREEDY_REST_MAX", 0)


def test_expected_tokens_under_a_uniform_belief():
    # Beta(1, 1): E[alpha**j] = 1 / (j + 1), so a step of k drafts expects H(k + 1) tokens
    tokens = Acceptance(1.0, 1.0).tokens(5)
    assert tokens == pytest.approx([sum(1 / i for i in range(1, k + 2)) for k in range(6)])


def test_expected_tokens_match_the_beta_posterior():
    # E[1 + alpha + ... + alpha**k] for alpha ~ Beta(a, r), by sampling
    torch.manual_seed(0)
    for a, r in ((3.0, 1.5), (0.7, 2.2), (12.0, 2.0)):
        x = torch.distributions.Beta(torch.tensor(a, dtype=torch.float64),
                                     torch.tensor(r, dtype=torch.float64)).sample((400_000,))
        want = [float(sum((x ** j).mean() for j in range(k + 1))) for k in range(9)]
        assert Acceptance(a, r).tokens(8) == pytest.approx(want, rel=5e-3)


def test_expected_tokens_tend_to_the_geometric_sum_as_the_counts_grow():
    for mean in (0.3, 0.6, 0.9):
        est = Acceptance(mean * 1e6, (1 - mean) * 1e6)
        assert est.tokens(6) == pytest.approx([sum(mean ** j for j in range(k + 1))
                                               for k in range(7)], rel=1e-4)
    # never more sure than MAX_ALPHA, however long the run of acceptances
    sure = Acceptance(1e6, 0.0).tokens(6)
    assert sure == pytest.approx([sum(MAX_ALPHA ** j for j in range(k + 1)) for k in range(7)],
                                 rel=1e-4)


def test_a_wide_belief_expects_more_of_long_drafts_than_its_mean():
    wide, narrow = Acceptance(1.0, 1.0), Acceptance(100.0, 100.0)  # both mean 0.5
    assert wide.tokens(16)[16] > narrow.tokens(16)[16] + 1.0



def test_auto_drafts_from_a_match_and_says_which_drafter_proposed(priced_clock):
    prompt = [5, 9, 11, 3, 7, 2] * 8
    want = generate(MODEL, prompt, 40)[0]
    got, seq, steps = generate(MODEL, prompt, 40, "auto", {"candidates": "prompt_lookup,suffix"})
    assert got == want
    by = seq.stats_by_method
    assert set(by) <= {"prompt_lookup", "suffix", "none"}
    assert sum(s.accepted for s in by.values()) == seq.stats.accepted > 0
    assert {s.method for s in steps if s.draft} <= {"prompt_lookup", "suffix"}
    # every pass is attributed to exactly one drafter
    assert sum(s.target_passes for s in by.values()) == seq.stats.target_passes


def test_auto_falls_back_to_none_when_nothing_matches():
    prompt = list(range(1, 40))  # no repeated n-gram, no global history
    _, seq, steps = generate(MODEL, prompt, 2, "auto", {"candidates": "prompt_lookup"})
    assert steps[0].draft == [] and steps[0].method == "none"


def test_auto_skips_trained_drafters_without_weights_and_rejects_unknown_candidates():
    env = drafter_env(MODEL)
    env.model_name = "no-such-model"  # nothing trained for it
    reg = Registry()
    _, p = reg.parse({"method": "auto", "candidates": "prompt_lookup,eagle,medusa"})
    auto = Auto(p, env)
    assert auto.drafters == {}  # built when first asked
    assert list(auto.candidates()) == ["prompt_lookup"]
    with pytest.raises(SpeculationError):
        reg.parse({"method": "auto", "candidates": "prompt_lookup,early_exit"})


def test_auto_keeps_up_only_the_candidates_with_per_step_state():
    """EAGLE queues the target's features every step once built; prompt lookup's and
    suffix decoding's indexes catch up when next asked. Trained candidates are checked
    and built at their first draft: until then no observe of theirs runs. A trained
    candidate is one a request could ask for with its defaults: the tiny model's Medusa
    record measured 5 ranks, fewer than Medusa's default top_k (a 400 for a ``medusa``
    request), so at its first draft it is left out."""
    reg = Registry()
    _, p = reg.parse({"method": "auto", "candidates": "prompt_lookup,suffix,eagle,medusa"})
    auto = Auto(p, drafter_env(MODEL))
    with pytest.raises(SpeculationError, match="top_k"):
        reg.check(*reg.parse("medusa"), drafter_env(MODEL))
    assert set(auto.candidates()) == {"prompt_lookup", "suffix"}
    assert auto.trained == ["eagle", "medusa"] and auto.observers == []
    assert auto._trained("eagle") is not None
    assert auto._trained("medusa") is None
    assert auto.trained == ["eagle"]
    assert set(auto.drafters) == {"prompt_lookup", "suffix", "eagle"}
    assert auto.observers == ["eagle"]


def test_eagle_built_mid_request_drafts_from_the_features_it_did_not_see(no_greedy_rests):
    """A trained candidate first drafts at a later step: EAGLE, built then, reads the
    positions it never observed, and the output is still plain decoding's."""
    from nodraft.engine.sequence import Sequence
    from nodraft.micro.model import KVCache

    prompt = list(range(3, 40))
    want, _, _ = generate(MODEL, prompt, 24)
    _, p = Registry().parse({"method": "auto", "candidates": "eagle"})
    auto = Auto(p, drafter_env(MODEL))
    key = ("eagle", 0, "greedy")
    cache = KVCache(MODEL.config, 1, dtype=MODEL.tok_embeddings.weight.dtype)
    seq = Sequence(MODEL, cache, 0, list(prompt), auto, 24)
    out, methods = [], []
    with torch.inference_mode():
        while not seq.done:
            if len(out) == 8:  # from here EAGLE looks certain to pay
                auto.est[key] = Acceptance(500.0, 0.01)
                auto.draft_seconds["eagle"] = 0.0
            elif len(out) < 8:  # until then it looks certain not to
                auto.est[key] = Acceptance(0.01, 500.0)
            r = seq.step()
            out += r.tokens
            methods.append((len(out), r.method, "eagle" in auto.drafters))
    assert out == want
    before = [m for n, m, _ in methods if n <= 8]
    assert set(before) == {"none"} and not any(built for n, _, built in methods if n < 8)
    assert "eagle" in [m for _, m, _ in methods]


def test_trained_candidates_are_looked_at_every_few_asks_while_none_is_worth_a_draft(
        no_greedy_rests):
    """A trained candidate's belief moves only when it drafts, so while none is worth a
    draft auto looks at them once every ``TRAINED_EVERY`` asks; after a look that finds
    one worth a draft, at the next ask again."""
    from nodraft.drafters.auto import TRAINED_EVERY
    from nodraft.drafters.base import Draft

    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup,eagle"})
    auto = Auto(p, drafter_env(MODEL))
    ctx = _ctx([5, 9, 11, 3, 7, 2] * 4)
    key = ("eagle", 0, "greedy")
    looked: list[int] = []
    at_mean = Acceptance.at_mean
    for i in range(2 * TRAINED_EVERY):
        est = auto.est[key] = Acceptance(0.01, 500.0)  # not worth a draft
        est.at_mean = (lambda k, est=est, i=i: (looked.append(i), at_mean(est, k))[1])
        auto.propose(ctx, 8)
        auto.observe(ctx, [])
    assert looked == [0, TRAINED_EVERY]
    # the next ask looks; one worth a draft there (its draft here comes back empty): looked
    # at again at the ask after it, and not at the one after that
    auto._trained = lambda name: object()
    auto._timed = lambda name, c, b: Draft.empty()
    auto.draft_seconds["eagle"] = 0.0
    looked.clear()
    for i in range(3):
        est = auto.est[key] = Acceptance(500.0, 0.01) if i == 0 else Acceptance(0.01, 500.0)
        est.at_mean = (lambda k, est=est, i=i: (looked.append(i), at_mean(est, k))[1])
        auto.propose(ctx, 8)
        auto.observe(ctx, [])
    assert looked[:2] == [0, 1] and 2 not in looked


def test_a_cheap_drafter_accepted_whole_keeps_the_next_step():
    """After prompt lookup's draft is accepted whole, the next step asks only prompt
    lookup (suffix decoding is not asked); at a step it does not win, both are."""
    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup,suffix"})
    auto = Auto(p, drafter_env(MODEL))
    ctx = _ctx([5, 9, 11, 3, 7, 2] * 4)
    auto.propose(ctx, 8)
    asked = []
    for name, d in auto.drafters.items():
        d.proposal = (lambda f, n: lambda c, b: (asked.append(n), f(c, b))[1])(d.proposal, name)
    auto.last = (("prompt_lookup", 3, "greedy"), 3, 3)
    ctx.tokens += [5, 9, 11, 3]
    auto.observe(ctx, [5, 9, 11])
    assert auto.winner == "prompt_lookup"
    auto.propose(ctx, 8)
    assert asked == ["prompt_lookup"]
    auto.last = (("prompt_lookup", 3, "greedy"), 3, 3)
    ctx.tokens += [5, 1]
    auto.observe(ctx, [5])  # one of three: no longer the winner
    asked.clear()
    auto.propose(ctx, 8)
    assert sorted(asked) == ["prompt_lookup", "suffix"]


def test_a_copy_accepted_whole_is_drafted_at_least_twice_as_long_next(monkeypatch):
    """Where the belief would trim the chain (a fresh request's few counts), a cheap
    drafter whose draft was just accepted whole sends at least twice that draft's length
    at its next step -- as much as its match gives; without a win the trim stands."""
    from nodraft.drafters import auto as auto_module

    cost = auto_module.PassCost({1: 1.0, 2: 1.1, 3: 1.2, 5: 1.5, 9: 2.5, 17: 4.5})
    monkeypatch.setattr(auto_module, "pass_cost", lambda env, ctx=None: cost)
    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup"})
    ctx = _ctx([5, 9, 11, 3, 7, 2] * 4)
    lengths = {}
    for won in (False, True):
        auto = Auto(p, drafter_env(MODEL))
        for m in range(1, 9):  # about even odds a token: drafts of a few tokens at most
            auto.est[("prompt_lookup", m, "greedy")] = Acceptance(2.0, 2.0)
        auto.winner, auto.won = ("prompt_lookup", 3) if won else (None, 0)
        lengths[won] = len(auto.propose(ctx, 12))
    assert lengths[False] < 6 and lengths[True] == 6


def _ctx(tokens: list[int]):
    from nodraft.drafters.base import DraftContext
    from nodraft.micro.model import KVCache

    return DraftContext(list(tokens), len(tokens), MODEL, KVCache(MODEL.config, 1), 0)


def test_a_request_auto_never_asked_builds_no_candidate_but_still_stores_its_response():
    """Under load most sampled sequences are never asked to draft: they build none of
    auto's candidates, and suffix decoding's store still gets their response."""
    shared: dict = {}
    env = drafter_env(MODEL, shared)
    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup,suffix"})
    prompt = [5, 9, 11, 3, 7, 2] * 4
    from nodraft.drafters.base import DraftContext
    from nodraft.micro.model import KVCache
    cache = KVCache(MODEL.config, 1)
    ctx = DraftContext(list(prompt) + [4, 4, 4], len(prompt), MODEL, cache, 0)
    auto = Auto(p, env)
    auto.observe(ctx, [])
    assert auto.drafters == {}
    auto.close(ctx)
    assert list(auto.drafters) == ["suffix"]
    assert len(shared["suffix"]["suffix_global"]) == 1


@pytest.mark.parametrize("temperature", [0.0, 0.3, 0.7, 1.0])
@pytest.mark.parametrize("fresh", [False, True])
def test_auto_rests_after_steps_where_nothing_could_pay(temperature, fresh):
    """After an asked step with nothing to send auto does not ask at the next step, nor
    at the next 2, 4, 8, ... while asked steps stay empty, up to ``REST_MAX`` sampled, and
    up to ``GREEDY_REST_MAX`` greedy. On a fresh server from temperature 0.6 it starts at
    the longest rest: the request is not asked at all, and its candidates are asked after
    it, at positions spread over its response (``_hindsight``)."""
    from nodraft.drafters.auto import GREEDY_REST_MAX
    from nodraft.engine.verify import SamplingParams

    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup"})
    # not fresh: a server where a draft paid at the last step it asked in either regime
    shared = {} if fresh else {"auto_pause": {"t<=0.85": 0, "t>0.85": 0}}
    auto = Auto(p, drafter_env(MODEL, shared))
    asked = []

    def nothing(ctx, budget):
        asked.append(len(ctx.tokens))
        return [], None, 0

    auto.candidates()["prompt_lookup"].proposal = nothing
    after = []  # the asks made before the hindsight's, when it ran
    hindsight = auto._hindsight
    auto._hindsight = lambda ctx: (after.append(len(asked)), hindsight(ctx))
    n = REST_MAX + 36  # the test model's positions hold 128
    out, seq, steps = generate(MODEL, list(range(1, 20)), n, drafter=auto,
                               sampling=SamplingParams(temperature=temperature, seed=3))
    assert len(steps) == n and not any(s.draft for s in steps)
    # the first step is the prompt's prefill (no draft), the last has no room for one
    def doubling(longest: int) -> list[int]:
        out, rest = [1], 1
        while out[-1] + rest + 1 < n - 1:
            out.append(out[-1] + rest + 1)
            rest = min(2 * rest, longest)
        return out

    assert doubling(REST_MAX)[:6] == [1, 3, 6, 11, 20, 37]
    assert doubling(GREEDY_REST_MAX)[:7] == [1, 3, 6, 11, 20, 29, 38]
    whole = fresh and temperature >= 0.6
    want = ([] if whole else doubling(REST_MAX)) if temperature > 0 \
        else doubling(GREEDY_REST_MAX)
    assert [k - 19 for k in asked[:after[0] if after else None]] == want
    assert after == ([0] if whole else [])
    if whole:  # eight positions from the response's second token to its last
        assert [k - 19 for k in asked] == [1 + i * (n - 2) // 7 for i in range(8)]


def test_sampled_rests_grow_go_on_across_requests_and_restart_when_a_draft_pays():
    shared: dict = {"auto_pause": {"t>0.85": 0}}  # a draft paid at the last step asked
    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup"})
    auto = Auto(p, drafter_env(MODEL, shared))
    ctx = _ctx([5, 9, 11, 3, 7, 2] * 4)  # its 3-gram [3 7 2] matches
    ctx.temperature = 1.0
    key = ("prompt_lookup", 3, "t>0.85")
    auto.propose(ctx, 8)
    auto.est[key] = Acceptance(0.05, 40.0)  # rarely accepted: nothing pays
    assert not len(auto.propose(ctx, 8)) and auto.rest == 1
    auto.rest = 0
    assert not len(auto.propose(ctx, 8)) and auto.rest == 2  # the rests grow
    assert shared["auto_pause"] == {"t>0.85": 2}
    # the server's next request goes on from there
    later = Auto(p, drafter_env(MODEL, shared))
    later.est[key] = Acceptance(0.05, 40.0)
    assert not len(later.propose(ctx, 8)) and later.rest == 4
    # where they reached the longest, a new request rests its whole length, unasked
    shared["auto_pause"]["t>0.85"] = REST_MAX
    rested = Auto(p, drafter_env(MODEL, shared))
    assert rested.propose(ctx, 8) is NOT_LOOKED
    # nothing to watch for: the rest's other steps are declined by the sequence for it
    assert rested.resting == WHOLE - 1 and rested.rest == 0
    assert not rested.drafters and not rested.proposals  # no candidate built, none asked
    auto.rest = 0
    auto.est[key] = Acceptance(40.0, 0.5)  # mostly accepted
    assert len(auto.propose(ctx, 8))
    auto.observe(ctx, [])  # sent and rejected: the rests are as they were
    assert auto.pause == 2
    draft = auto.propose(ctx, 8)
    auto.observe(ctx, draft.tokens.tolist()[:2])  # sent and partly accepted: they restart
    assert auto.pause == 0 and shared["auto_pause"] == {"t>0.85": 0}


def _rested_request(shared: dict, prompt: list[int], response: list[int],
                    temperature: float = 0.7, lone: bool = True) -> Auto:
    """A sampled request ``auto`` rested through (a fresh server's, from 0.6), closed
    after ``response``, its last step run alone (``lone``) or in a packed pass."""
    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup,suffix"})
    auto = Auto(p, drafter_env(MODEL, shared))
    ctx = _ctx(prompt + response[:1])
    ctx.prompt_len, ctx.temperature = len(prompt), temperature
    assert auto.propose(ctx, 8) is NOT_LOOKED and auto.resting  # the whole request
    auto.observe(ctx, [])
    ctx.tokens += response[1:]  # the steps the sequence declines for it (``resting``)
    ctx.step_seconds = 3e-4 if lone else None  # its last step ran alone, or packed
    auto.close(ctx)
    return auto


@pytest.mark.parametrize("copies", [True, False])
def test_a_request_rested_through_teaches_the_server_after_its_response(copies):
    """After a sampled request auto asked at no step, its cheap candidates are asked what
    they would have drafted at positions spread over the response and scored against the
    tokens that followed, into the server's beliefs. Where those drafts would pay now, the
    server's next requests ask from their first step; where they would not, they rest
    through too."""
    from nodraft.drafters.auto import HINDSIGHT_POINTS

    shared: dict = {}
    prompt = [5, 9, 11, 3, 7, 2, 13, 17] * 3
    # the response goes on copying the prompt's loop, or goes somewhere new
    response = (prompt * 3)[:40] if copies else list(range(40, 80))
    _rested_request(shared, prompt, response)
    beliefs = {k: g for k, g in shared["auto_alpha"].items() if k[2] == "t<=0.85"}
    if copies:
        assert {k[0] for k in beliefs} == {"prompt_lookup", "suffix"}
        counted = sum(g.accepted + g.rejected for g in beliefs.values())
        assert counted >= HINDSIGHT_POINTS  # every position drafted (tokens and rejections)
        assert all(g.alpha > 0.9 for g in beliefs.values())
        assert shared["auto_pause"]["t<=0.85"] == 0
    else:  # no n-gram of the new text occurred before it: no draft, nothing learnt
        assert not beliefs and "t<=0.85" not in shared.get("auto_pause", {})
    # the next request on this server
    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup,suffix"})
    nxt = Auto(p, drafter_env(MODEL, shared))
    ctx = _ctx(prompt)
    ctx.temperature = 0.7
    draft = nxt.propose(ctx, 8)
    assert (draft is not NOT_LOOKED) == copies
    if copies:  # a copy believed to pay: sent from the first step
        assert len(draft) and draft.tokens.tolist()[:3] == [5, 9, 11]


def test_a_drafted_position_rejected_in_hindsight_counts_as_a_rejection():
    shared: dict = {}
    prompt = [5, 9, 11, 3, 7, 2, 13, 17] * 3
    # the loop breaks off at once after each position's match: its drafts' first token
    # is right at most once
    response = [5, 9, 11, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54]
    _rested_request(shared, prompt, response)
    beliefs = [g for k, g in shared["auto_alpha"].items() if k[0] == "prompt_lookup"]
    assert beliefs and sum(g.rejected for g in beliefs) > 0
    assert all(g.alpha < 0.8 for g in beliefs)


def test_hindsight_spends_at_most_its_share_of_the_regimes_decoding_time():
    """Each response earns the regime ``HINDSIGHT_SHARE`` of its tokens' plain decoding
    time; a request after which the credit is short is not looked back on (it only earns),
    nor one whose last step ran in a packed pass."""
    from nodraft.drafters.auto import HINDSIGHT_SHARE

    prompt = [5, 9, 11, 3, 7, 2, 13, 17] * 3
    response = (prompt * 3)[:40]
    shared: dict = {"auto_hindsight": {"t<=0.85": -1.0}}  # spent more than earned
    _rested_request(shared, prompt, response)
    assert "auto_alpha" not in shared or not shared["auto_alpha"]
    one = costs.current(MODEL)(1)
    assert shared["auto_hindsight"]["t<=0.85"] == pytest.approx(
        -1.0 + HINDSIGHT_SHARE * (len(response)) * one)
    shared["auto_hindsight"]["t<=0.85"] = 0.0  # earned again: the next one is
    _rested_request(shared, prompt, response)
    assert shared["auto_alpha"]
    assert shared["auto_hindsight"]["t<=0.85"] < 0.0  # what it took, spent
    # nor one whose last step ran in a packed pass: other requests' steps would wait
    shared = {}
    _rested_request(shared, prompt, response, lone=False)
    assert not shared["auto_alpha"] and not shared["auto_hindsight"]
    # a greedy request, and one auto asked at, are never looked back on
    for temperature, pause in ((0.0, None), (0.7, 0)):
        shared = {} if pause is None else {"auto_pause": {"t<=0.85": pause}}
        _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup"})
        auto = Auto(p, drafter_env(MODEL, shared))
        ctx = _ctx(prompt + response)
        ctx.temperature = temperature
        auto.propose(ctx, 8)
        assert auto.asks == 1
        ctx.step_seconds = 3e-4  # a lone step
        auto.close(ctx)
        assert "auto_hindsight" not in shared or not shared["auto_hindsight"]


def test_a_rest_ends_at_the_step_a_copy_believed_to_pay_starts():
    from nodraft.drafters.auto import COPIES_PAY

    # (2-token matches drafted from: ``min_match`` 1)
    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup", "min_match": 1})
    auto = Auto(p, drafter_env(MODEL, {"auto_pause": {"greedy": 0}}))  # not a fresh server
    ctx = _ctx([5, 9, 11, 3, 7, 2] * 4 + [40, 41])  # nothing matches its last tokens
    ctx.temperature = 0.0  # greedy: sampled, rests are not watched
    assert not len(auto.propose(ctx, 8)) and auto.rest == 1
    # 2-token matches are believed to copy well (a copy is met at its first step) ...
    copy = ("prompt_lookup", 2, "greedy")
    auto.est[copy] = Acceptance(30.0, 1.0)
    auto._observe(copy, 2, 2)
    assert auto.est[copy].alpha >= COPIES_PAY and copy in auto.copies_pay
    # ... but the rests go on while no 2 tokens at the context's end occurred before
    auto.rest = 8
    # watching for that copy, auto keeps counting its rest itself (asked every step)
    assert auto.propose(ctx, 8) is NOT_LOOKED and auto.rest == 7 and auto.resting == 0
    ctx.tokens += [9, 11]  # [9 11] occurred before: the copy's first step is asked at
    draft = auto.propose(ctx, 8)
    assert draft is not NOT_LOOKED and auto.rest == 0
    assert draft.method == "prompt_lookup" and draft.tokens.tolist()[:2] == [3, 7]
    # its belief falls below: it no longer ends rests
    for _ in range(12):
        auto._observe(copy, 2, 0)
    assert copy not in auto.copies_pay


def test_a_match_shorter_than_min_match_is_not_drafted_from():
    """A cheap candidate's match shorter than ``min_match`` tokens is neither sent nor
    judged, however well believed; at ``min_match`` it is."""
    ctx = _ctx([5, 9, 11, 3, 7, 2] * 4 + [40, 41, 9, 11])  # [9 11] matches, [41 9 11] not
    ctx.temperature = 0.0
    for min_match, sent in ((3, False), (2, True)):
        _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup",
                                 "min_match": min_match})
        shared = {"auto_pause": {"greedy": 0},
                  "auto_alpha": {("prompt_lookup", 2, "greedy"): Acceptance(30.0, 1.0)}}
        auto = Auto(p, drafter_env(MODEL, shared))
        draft = auto.propose(ctx, 8)
        assert bool(len(draft)) == sent and bool(auto.proposals) == sent
        if sent:
            assert draft.tokens.tolist()[:2] == [3, 7]
    with pytest.raises(ValueError):
        Registry().parse({"method": "auto", "min_match": 0})


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_only_greedy_rests_are_watched_for_copies(temperature):
    """A copy believed to pay ends a greedy rest at its first step; a sampled rest is not
    watched -- the sequence declines its steps without calling auto -- however strongly
    the copy is believed in."""
    from nodraft.drafters.goodput import regime

    reg = regime(temperature)
    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup", "min_match": 1})
    copy = ("prompt_lookup", 2, reg)
    shared = {"auto_pause": {reg: 0}, "auto_alpha": {copy: Acceptance(30.0, 1.0)}}
    auto = Auto(p, drafter_env(MODEL, shared))
    ctx = _ctx([5, 9, 11, 3, 7, 2] * 4 + [40, 41])  # nothing matches its last tokens
    ctx.temperature = temperature
    auto.est[("prompt_lookup", 1, reg)] = Acceptance(0.05, 40.0)
    assert not len(auto.propose(ctx, 8)) and auto.rest == 1
    auto.rest = 8
    ctx.tokens += [9, 11]  # [9 11] occurred before: a copy believed to pay starts here
    got = auto.propose(ctx, 8)
    if temperature == 0.0:
        assert got is not NOT_LOOKED and got.tokens.tolist()[:2] == [3, 7]
    else:
        assert got is NOT_LOOKED and auto.resting == 7 and auto.rest == 0


def test_a_rest_ends_where_the_servers_stored_responses_hold_a_copy():
    """Suffix decoding's keys also wake a rest where the context's tail is in its store of
    previous responses (and only theirs: prompt lookup reads the request alone)."""
    shared: dict = {"auto_pause": {"greedy": 0}}  # not a fresh server: asked at once
    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup,suffix",
                             "min_match": 1})  # (2-token matches drafted from)
    auto = Auto(p, drafter_env(MODEL, shared))
    ctx = _ctx([5, 9, 11, 3, 7, 2, 40])
    ctx.temperature = 0.0  # greedy: sampled, rests are not watched
    auto.propose(ctx, 8)
    auto.drafters["suffix"].global_index.add([60, 61, 62, 63, 64])
    for name, tail in (("prompt_lookup", [60, 61]), ("suffix", [62, 63])):
        key = (name, 2, "greedy")
        auto.est[key] = Acceptance(30.0, 1.0)
        auto._observe(key, 2, 2)
        auto.rest = 8
        ctx.tokens += tail  # in the store, not earlier in the request
        woken = auto.propose(ctx, 8) is not NOT_LOOKED
        assert woken == (name == "suffix")
        auto.copies_pay.clear()


def test_sampled_drafts_that_pay_are_sent(priced_clock):
    from nodraft.engine.verify import SamplingParams

    prompt = [4, 8, 15, 16, 23, 42] * 8  # prompt lookup matches at every step
    # sampled, at a temperature where this tiny model keeps the loop, so drafts do pay (at
    # 0.7 whether they do depends on the seed's text; its sampled text matches its context
    # by a token or two as often as by three: ``min_match`` 1)
    _, seq, steps = generate(MODEL, prompt, 40, "auto",
                             {"candidates": "prompt_lookup", "min_match": 1},
                             SamplingParams(temperature=0.3, seed=1))
    assert sum(1 for s in steps if s.draft) > 5
    assert len(steps) < 40  # drafts were accepted: fewer steps than tokens


def test_acceptance_learned_by_one_request_informs_the_next(priced_clock):
    shared: dict = {}
    prompt = [4, 8, 15, 16, 23, 42] * 6
    generate(MODEL, prompt, 30, "auto", {"candidates": "prompt_lookup"}, shared=shared)
    # kept per (drafter, match length): the 3-gram matches of a repeated prompt
    learned = shared["auto_alpha"][("prompt_lookup", 3, "greedy")]
    assert learned.accepted > 1.0
    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup"})
    auto = Auto(p, drafter_env(MODEL, shared))
    assert auto._estimate(("prompt_lookup", 3, "greedy")).alpha == pytest.approx(learned.alpha)
    # a match length the server has not seen starts from a weight-2 belief centred on what
    # it counted of this drafter's shorter matches in this regime
    seen = [b for (n, m, r), b in shared["auto_alpha"].items()
            if n == "prompt_lookup" and m <= 7 and r == "greedy"]
    a, r = sum(b.accepted for b in seen), sum(b.rejected for b in seen)
    assert a + r >= POOLED_MIN
    new = auto._estimate(("prompt_lookup", 7, "greedy"))
    assert new.accepted + new.rejected == pytest.approx(2.0)
    assert new.alpha == pytest.approx(min(MAX_ALPHA, a / (a + r)))
    # another regime, or another drafter, learned nothing: uniform
    assert auto._estimate(("prompt_lookup", 7, "t>0.85")).alpha == 0.5
    assert auto._estimate(("suffix", 7, "greedy")).alpha == 0.5


def test_a_new_match_length_starts_uniform_until_the_server_counted_a_few_shorter():
    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup"})
    shared: dict = {"auto_alpha": {("prompt_lookup", 2, "t>0.85"): Acceptance(1.0, 2.0)}}
    auto = Auto(p, drafter_env(MODEL, shared))
    assert auto._estimate(("prompt_lookup", 5, "t>0.85")).alpha == 0.5  # 3 pseudo-counts
    shared["auto_alpha"][("prompt_lookup", 1, "t>0.85")] = Acceptance(0.5, 6.0)
    assert auto._estimate(("prompt_lookup", 6, "t>0.85")).alpha == pytest.approx(1.5 / 9.5)
    # longer matches than the key's do not count towards its prior
    shared["auto_alpha"][("prompt_lookup", 8, "t>0.85")] = Acceptance(90.0, 1.0)
    assert auto._estimate(("prompt_lookup", 7, "t>0.85")).alpha == pytest.approx(1.5 / 9.5)


def test_beliefs_are_kept_per_sampling_regime(priced_clock):
    """A greedy request's acceptance does not inform a sampled one's (nor one regime's
    another's): each (drafter, match length) has a belief per regime."""
    from nodraft.engine.verify import SamplingParams

    shared: dict = {}
    prompt = [4, 8, 15, 16, 23, 42] * 6
    # (this tiny model's sampled text matches its context by a token or two: ``min_match``
    # 1, in both regimes, so that they draft from matches of the same lengths)
    params = {"candidates": "prompt_lookup", "min_match": 1}
    generate(MODEL, prompt, 30, "auto", params, shared=shared)
    assert {k[2] for k in shared["auto_alpha"]} == {"greedy"}
    greedy = {k: (b.accepted, b.rejected) for k, b in shared["auto_alpha"].items()}
    generate(MODEL, prompt, 30, "auto", params,
             SamplingParams(temperature=0.5, seed=0), shared=shared)
    assert {k[2] for k in shared["auto_alpha"]} == {"greedy", "t<=0.85"}
    # the sampled request counted into its own regime's beliefs, and left greedy's as they were
    assert {k: (b.accepted, b.rejected) for k, b in shared["auto_alpha"].items()
            if k[2] == "greedy"} == greedy
    # a (drafter, match length) both regimes drafted with keeps a belief in each
    both = ({k[:2] for k in shared["auto_alpha"] if k[2] == "greedy"}
            & {k[:2] for k in shared["auto_alpha"] if k[2] == "t<=0.85"})
    assert both
    for key in both:
        assert shared["auto_alpha"][(*key, "greedy")] is not shared["auto_alpha"][(*key, "t<=0.85")]


def test_a_cheap_drafter_not_sent_is_still_measured_against_what_the_pass_emitted():
    from nodraft.drafters.base import DraftContext
    from nodraft.micro.model import KVCache

    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup,suffix"})
    auto = Auto(p, drafter_env(MODEL))
    tokens = [5, 9, 11, 3, 7, 2] * 4
    ctx = DraftContext(list(tokens), len(tokens), MODEL, KVCache(MODEL.config, 1), 0)
    auto.propose(ctx, 16)
    key = ("prompt_lookup", 3, "greedy")  # its 3-gram [3 7 2] matched
    proposal = auto.proposals[key]
    assert proposal[:3] == [5, 9, 11]
    before = (auto.est[key].accepted, auto.est[key].rejected)
    auto.last = (("suffix", 8, "greedy"), 3, 3)  # as if suffix's draft had been sent instead
    ctx.tokens += [5, 9, 63]  # two draft tokens accepted, then a bonus token
    auto.observe(ctx, [5, 9])
    after = auto.est[key]
    # prompt lookup's chain would have had 2 accepted, then a rejection
    assert after.accepted == pytest.approx(before[0] * 0.85 + 2)
    assert after.rejected == pytest.approx(before[1] * 0.85 + 1)
    assert auto.proposals == {}


def test_an_estimate_not_updated_drifts_back_to_the_servers_figure():
    shared: dict = {}
    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup"})
    auto = Auto(p, drafter_env(MODEL, shared))
    key = ("prompt_lookup", 2, "greedy")
    est = auto._estimate(key)
    est.accepted, est.rejected = 1.0, 9.0  # this request: rarely accepted
    shared["auto_alpha"][key] = Acceptance(9.0, 1.0)  # the server: mostly accepted
    auto.step += 10
    drifted = auto._estimate(key)
    w = 0.95 ** 10
    assert drifted.accepted == pytest.approx(w * 1.0 + (1 - w) * 9.0)
    assert drifted.rejected == pytest.approx(w * 9.0 + (1 - w) * 1.0)
    assert auto._estimate(key).accepted == drifted.accepted  # applied once


def test_auto_trims_a_chain_where_one_more_token_stops_paying():
    from nodraft.drafters.auto import PassCost

    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup"})
    auto = Auto(p, drafter_env(MODEL))
    auto.cost = PassCost({1: 1.0, 2: 1.0, 3: 1.0, 5: 1.0, 9: 2.0, 17: 4.0})
    for a, r, n in ((1, 1, 16), (9, 1, 16), (97, 3, 16), (9, 1, 3), (2, 6, 16)):
        est = Acceptance(a, r)
        g, k = best_length(est, n, auto.cost)
        brute = max((est.tokens(j)[j] / auto.cost(j + 1), -j) for j in range(1, n + 1))
        assert (g, k) == (pytest.approx(brute[0]), -brute[1])


def test_pass_cost_interpolates_its_measured_table():
    from nodraft.drafters.auto import PassCost

    cost = PassCost({1: 1.0, 2: 3.0, 5: 6.0})
    assert [cost(r) for r in (1, 2, 4, 5)] == pytest.approx([1.0, 3.0, 5.0, 6.0])
    assert cost(0) == 1.0 and cost(8) == pytest.approx(9.0)  # the last slope goes on


def test_pass_cost_is_timed_in_the_requests_slot_without_committing_anything():
    from nodraft.drafters.auto import ROWS, _COSTS, pass_cost
    from nodraft.drafters.base import DraftContext
    from nodraft.micro.model import KVCache

    model = tiny_model(seed=3)  # a fresh model object: nothing measured for it yet
    cache = KVCache(model.config, 2, dtype=torch.float64)
    cache.set_length(1, 20)
    before = cache.k[:, 1, :, :20].clone()
    ctx = DraftContext([1] * 21, 21, model, cache, 1)
    cost = pass_cost(drafter_env(model), ctx)
    assert cost.rows == list(ROWS) and all(s > 0 for s in cost.secs)
    assert cost.secs == sorted(cost.secs)  # more rows never cost less
    assert cache.lengths == [0, 20] and torch.equal(cache.k[:, 1, :, :20], before)
    assert cache.k[:, 1, :, 20:20 + ROWS[-1]].abs().sum() > 0  # the scratch rows it used
    assert pass_cost(drafter_env(model), ctx) is cost  # measured once per model
    assert model in _COSTS



def test_a_request_on_a_server_whose_copies_pay_meets_them_from_its_start():
    """Where the server's belief in some match length is at least ``COPIES_PAY`` (in this
    regime), a new request's rests end at any step where a match that long is there."""
    shared: dict = {}
    env = drafter_env(MODEL, shared)
    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup"})
    ctx = _ctx([5, 9, 11, 3, 7, 2] * 4)  # its last 8 tokens occurred before
    ctx.temperature = 0.0  # greedy: sampled, rests are not watched
    key = ("prompt_lookup", 3, "greedy")
    for server, woken in ((Acceptance(30.0, 1.0), True), (Acceptance(3.0, 3.0), False)):
        shared["auto_alpha"] = {("prompt_lookup", 8, "greedy"): server}
        shared["auto_pause"] = {"greedy": 0}  # no rest yet, not a fresh server
        auto = Auto(p, env)
        auto.candidates()
        auto.est[key] = Acceptance(0.05, 40.0)  # this request: its 3-gram matches do not pay
        assert not len(auto.propose(ctx, 8)) and auto.rest == 1
        assert (auto.propose(ctx, 8) is not NOT_LOOKED) == woken


def test_a_drafted_steps_own_overhead_is_measured_and_prices_drafts(no_greedy_rests):
    """Drafts are priced with what a drafted step costs beyond its pass, more than an
    asked step without one: ``DRAFT_OVERHEAD_PRIOR`` one-row passes until enough steps of
    each kind are timed (``ctx.step_seconds`` beside ``ctx.pass_seconds``), then the
    difference of their medians -- each beyond the pass the step ran, not its price: a
    pass that ran dearer than the table says is no draft's own work."""
    from nodraft.drafters.auto import DRAFT_OVERHEAD_PRIOR, OVERHEAD_MIN_STEPS

    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup"})
    shared: dict = {}
    auto = Auto(p, drafter_env(MODEL, shared))
    ctx = _ctx([5, 9, 11, 3, 7, 2] * 4)  # its 3-gram [3 7 2] matches
    auto.propose(ctx, 8)
    one = auto.cost(1)
    assert auto._draft_overhead() == pytest.approx(DRAFT_OVERHEAD_PRIOR * one)
    auto.observe(ctx, [])
    assert auto._timing is None  # the first asked step indexed the prompt: not timed
    auto.est[("prompt_lookup", 3, "greedy")] = Acceptance(0.05, 40.0)  # nothing pays
    assert not len(auto.propose(ctx, 8))
    auto.observe(ctx, [])
    assert auto._timing == (1, False)  # an asked step without a draft: timed
    auto._timing = None

    def timed(kind_rows: int, drafted: bool, extra: float, slow: float = 1.0) -> None:
        auto._timing = (kind_rows, drafted)
        ctx.pass_seconds = slow * auto.cost(kind_rows)  # the pass, as it ran
        ctx.step_seconds = ctx.pass_seconds + extra
        auto._learn_overhead(ctx)

    for i in range(OVERHEAD_MIN_STEPS):
        timed(1, False, 0.0)  # asked, nothing sent: nothing besides the pass (as the
        # table's passes; an asked step's own work is priced apart: the test below)
        # drafted: three passes more (one stalled), beside a pass that ran at twice its price
        timed(3, True, 3 * one if i else 500 * one, slow=2.0)
    assert auto._draft_overhead() == pytest.approx(3 * one)  # medians: the stall is ignored
    assert shared["auto_step_overhead"]["asked"]  # kept server-wide
    # a belief that pays for a draft priced at the prior does not pay for one three passes
    # dearer: nothing is sent
    key, belief = ("prompt_lookup", 3, "greedy"), Acceptance(2.0, 1.0)
    plain = 1.0 / auto.cost(1)
    assert best_length(belief, 8, auto.cost, 0.0)[0] > plain > \
        best_length(belief, 8, auto.cost, 3 * one)[0]
    auto.est[key] = dataclasses.replace(belief)
    auto._overhead = 0.0
    assert len(auto.propose(ctx, 8))
    auto._overhead = None
    auto.est[key] = dataclasses.replace(belief)
    assert not len(auto.propose(ctx, 8))


def test_an_asked_steps_own_work_is_priced_on_both_sides_of_a_choice(no_greedy_rests):
    """What an asked step takes beyond its pass whether it sends a draft or not -- the
    median over the server's asked steps without one, once ``OVERHEAD_MIN_STEPS`` are
    timed -- is added to plain decoding's step and to each draft's alike: a draft that
    does not pay against the pass alone pays against the whole step."""
    from nodraft.drafters.auto import OVERHEAD_MIN_STEPS

    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup"})
    shared: dict = {}
    auto = Auto(p, drafter_env(MODEL, shared))
    ctx = _ctx([5, 9, 11, 3, 7, 2] * 4)  # its 3-gram [3 7 2] matches
    auto.propose(ctx, 8)
    auto.observe(ctx, [])
    one, key = auto.cost(1), ("prompt_lookup", 3, "greedy")
    belief = Acceptance(0.05, 1.0)  # a draft token accepted ~5% of the time
    assert best_length(belief, 8, auto.cost, 0.0)[0] < 1.0 / one  # not against the pass
    assert best_length(belief, 8, auto.cost, 3 * one)[0] > 1.0 / (4 * one)  # against a step
    auto._overhead = 0.0  # a draft's own extra work apart
    auto.est[key] = dataclasses.replace(belief)
    assert auto._step_overhead() == 0.0 and not len(auto.propose(ctx, 8))  # none timed yet
    auto.observe(ctx, [])
    auto._timing = None
    for _ in range(OVERHEAD_MIN_STEPS):  # asked steps that took three passes' worth more
        auto._timing = (1, False)
        ctx.step_seconds = auto.cost(1) + 3 * one
        auto._learn_overhead(ctx)
    auto._overhead = 0.0
    assert auto._step_overhead() == pytest.approx(3 * one)
    auto.est[key] = dataclasses.replace(belief)
    assert len(auto.propose(ctx, 8))


def test_an_ask_is_priced_and_rests_last_long_enough(monkeypatch):
    """After an asked step where nothing paid, the rest is at least the steps over which
    the ask's cost beyond a plain step is ``ASK_SHARE`` of their time:
    ``ASK_OVERHEAD_PRIOR`` one-row passes until asked and rested steps are timed
    (``ctx.step_seconds``; a rested step's time is read at the next ask), then the
    difference of their medians; the rests double from there, up to ``REST_MAX``."""
    import math

    from nodraft.drafters import auto as auto_module
    from nodraft.drafters.auto import ASK_OVERHEAD_PRIOR, OVERHEAD_MIN_STEPS

    monkeypatch.setattr(auto_module, "ASK_SHARE", 0.03)
    shared: dict = {"auto_pause": {"t>0.85": 0}}  # a draft paid at the last step asked
    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup"})
    auto = Auto(p, drafter_env(MODEL, shared))
    ctx = _ctx([5, 9, 11, 3, 7, 2] * 4)  # its 3-gram [3 7 2] matches
    ctx.temperature = 1.0
    auto.candidates()
    auto.est[("prompt_lookup", 3, "t>0.85")] = Acceptance(0.05, 40.0)  # nothing pays
    assert not len(auto.propose(ctx, 8))
    floor = math.ceil(ASK_OVERHEAD_PRIOR / 0.03)  # 17: the prior's
    assert auto.rest == floor and shared["auto_pause"] == {"t>0.85": floor}
    auto.observe(ctx, [])
    one = auto.cost(1)
    # the rest's steps are plain decoding's; the step before the next ask is timed as one
    auto.rest = 2
    assert auto.propose(ctx, 8) is NOT_LOOKED and auto.resting == 1
    ctx.step_seconds = one + 0.1 * one
    assert not len(auto.propose(ctx, 8))
    assert len(shared["auto_step_overhead"]["plain"]) == 1
    auto.observe(ctx, [])
    for _ in range(OVERHEAD_MIN_STEPS):  # asked steps 0.3 passes dearer than plain ones
        auto._timing = (1, False)
        ctx.step_seconds = one + 0.4 * one
        auto._learn_overhead(ctx)
        ctx.step_seconds = one + 0.1 * one
        auto._learn_plain(ctx)
    assert auto._rest_floor() == math.ceil(0.3 / (0.03 * 1.1))  # 10
    auto.pause = auto.rest = 0  # as after a draft that paid
    assert not len(auto.propose(ctx, 8)) and auto.rest == 10
    auto.observe(ctx, [])
    auto.rest = 0
    assert not len(auto.propose(ctx, 8)) and auto.rest == 20  # doubling from the floor
    auto.observe(ctx, [])
    auto.rest = 0
    assert not len(auto.propose(ctx, 8)) and auto.rest == min(40, REST_MAX)
    auto.observe(ctx, [])
    auto.rest = 0
    assert not len(auto.propose(ctx, 8)) and auto.rest == REST_MAX


def test_a_lone_step_is_timed_for_the_drafter_and_a_packed_one_is_not():
    from nodraft.engine.sequence import Sequence
    from nodraft.engine.verify import SamplingParams
    from nodraft.micro.model import KVCache

    cache = KVCache(MODEL.config, 2, dtype=MODEL.tok_embeddings.weight.dtype)
    reg = Registry()
    drafter = reg.build(*reg.parse("none"), drafter_env(MODEL))
    seq = Sequence(MODEL, cache, 0, [1, 2, 3, 4], drafter, 8, SamplingParams(), frozenset())
    seq.step()  # the prefill and first token
    assert seq.ctx.step_seconds is None
    seq.step()
    assert seq.ctx.step_seconds > seq.ctx.pass_seconds > 0  # the step, and its pass in it
    draft = seq.propose()
    segment = seq.verify_segment(draft)
    logits, hidden = MODEL.verify_pass(torch.tensor(segment.ids), cache, 0, cache.lengths[0])
    seq.finish_step(draft, logits, hidden)
    assert seq.ctx.step_seconds is None and seq.ctx.pass_seconds is None


def test_a_request_starts_from_the_servers_belief_at_a_few_pseudo_counts():
    """The server's belief, however many counts it holds, starts a request at
    ``PRIOR_STRENGTH`` pseudo-counts with its mean (so the request's own steps move it
    soon), and a key left alone drifts towards the server's mean at its own weight."""
    from nodraft.drafters.goodput import PRIOR_STRENGTH

    shared: dict = {}
    key = ("prompt_lookup", 3, "greedy")
    shared["auto_alpha"] = {key: Acceptance(172.0, 28.0)}  # 0.86 over 200 counts
    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup"})
    auto = Auto(p, drafter_env(MODEL, shared))
    est = auto._estimate(key)
    assert est.accepted + est.rejected == pytest.approx(PRIOR_STRENGTH)
    assert est.alpha == pytest.approx(0.86)
    for _ in range(3):  # a loop: drafts of 16 accepted whole
        auto._observe(key, 16, 16)
        auto.step += 1
    assert auto.est[key].alpha > 0.95
    weight = auto.est[key].accepted + auto.est[key].rejected
    auto.step += 20  # not updated for 20 steps: back towards 0.86, its weight kept
    drifted = auto._estimate(key)
    assert drifted.accepted + drifted.rejected == pytest.approx(weight)
    assert 0.86 < drifted.alpha < 0.95


def test_only_this_requests_candidates_beliefs_end_or_prevent_its_rests():
    """The server's beliefs come from every request's candidates; a request whose
    candidates leave suffix decoding (or a trained drafter) out rests as if it had none
    of theirs -- no lookup in a store it never built, no drafter error."""
    shared: dict = {"auto_alpha": {("suffix", 2, "greedy"): Acceptance(30.0, 1.0),
                                   ("eagle", 0, "greedy"): Acceptance(30.0, 1.0)},
                    "auto_pause": {"greedy": 0}}
    _, p = Registry().parse({"method": "auto", "candidates": "prompt_lookup"})
    auto = Auto(p, drafter_env(MODEL, shared))
    ctx = _ctx([5, 9, 11, 3, 7, 2] * 4 + [40, 41])
    ctx.temperature = 0.0  # greedy: sampled, rests are not watched
    assert not len(auto.propose(ctx, 8)) and auto.rest == 1
    ctx.tokens += [9, 11]  # a 2-token match: suffix decoding's, which this request lacks
    assert auto.propose(ctx, 8) is NOT_LOOKED
