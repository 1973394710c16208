"""Continuous batching: packed passes give every sequence exactly what it gets alone."""

import statistics
import threading

import pytest
import torch

from nodraft.drafters.registry import Registry
from nodraft.micro.model import KVCache
from nodraft.micro.compiled import PACKED_DRAFTED_ROWS
from nodraft.micro.packed import (NARROW, Segment, _offsets, _packed_attention_plan,
                                  forward_packed, packed_draft_cap)
from nodraft.engine.core import Engine, GenerationRequest
from nodraft.drafters.goodput import PassFit
from nodraft.engine.scheduler import (MAX_EVIDENCE, PRIOR_STRENGTH, PROBE_EVERY, DraftScheduler,
                                     SeqDraftState, probe_after)
from nodraft.engine.sequence import tree_attention_mask
from nodraft.engine.verify import SamplingParams
from tests.conftest import TINY, tiny_model
from tests.engine.helpers import generate, run_all

MODEL = tiny_model()


@pytest.mark.parametrize("slots", [[0, 3, 1, 2, 6, 7],  # drafted slots fill their range
                                   [0, 9, 15, 4, 12, 19]])  # sparse: their rows are gathered
def test_a_packed_pass_equals_each_sequence_alone(slots):
    """Prefill chunks (wide), chains and trees (narrow), different slots and lengths."""
    g = torch.Generator().manual_seed(0)
    V = TINY.vocab_size
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (5, 40, 1, 17, 3, 60)]
    drafts = [torch.randint(0, V, (k,), generator=g) for k in (3, 0, 6, 1, 2, 4)]
    trees = [None, None, torch.tensor([-1, -1, 0, 1, 1, 2]), None, torch.tensor([-1, -1]), None]
    want = []
    for p, d, parents in zip(prompts, drafts, trees):
        c = KVCache(TINY, 1, dtype=torch.float64)
        if len(p) > 1:
            MODEL(p[None, :-1], cache=c)
            c.advance(0, len(p) - 1)
        n = len(p) - 1
        block = torch.cat([p[-1:], d])[None]
        if parents is None:
            want.append(MODEL(block, cache=c)[0])
        else:
            depth = [0] + [1 if q < 0 else None for q in parents.tolist()]
            for i, q in enumerate(parents.tolist()):
                depth[i + 1] = 1 if q < 0 else depth[q + 1] + 1
            pos = (n + torch.tensor(depth))[None]
            want.append(MODEL(block, pos, cache=c, tree_mask=tree_attention_mask(parents))[0])
    cache = KVCache(TINY, max(slots) + 1, dtype=torch.float64)
    forward_packed(MODEL, [Segment(s, 0, p[:-1], torch.arange(len(p) - 1), logits=False)
                           for s, p in zip(slots, prompts) if len(p) > 1], cache)
    segs = []
    for s, p, d, parents in zip(slots, prompts, drafts, trees):
        n = len(p) - 1
        cache.lengths[s] = n
        ids = torch.cat([p[-1:], d])
        if parents is None:
            segs.append(Segment(s, n, ids, torch.arange(n, n + len(ids))))
        else:
            mask = tree_attention_mask(parents)
            depth = mask.sum(1) - 1  # ancestors seen = depth
            segs.append(Segment(s, n, ids, n + depth, mask))
    groups = _packed_attention_plan(segs, _offsets(segs), sum(len(g) for g in segs))["narrow"]
    assert [g[0] is not None for g in groups] == [False, max(slots) > 10]  # gathered or not
    out = forward_packed(MODEL, segs, cache)
    for w, (logits, hidden) in zip(want, out):
        assert logits.shape == w.shape and hidden.shape[0] == w.shape[0]
        torch.testing.assert_close(logits, w, rtol=0, atol=1e-9)
    assert cache.lengths[0] == 4  # a pass never moves committed lengths


class DraftEverything(DraftScheduler):
    """Every sequence drafts its full budget every pass (exercises packed drafts)."""

    def limits(self, states, rows, prefill_rows=0):
        return [kmax for _, _, kmax in states]


def float64_engine(**kw) -> Engine:
    engine = Engine({"micro": MODEL}, Registry(), eot_id=None, **kw)
    for c in engine.caches.values():
        c.k, c.v = c.k.double(), c.v.double()
    return engine


METHODS = [("none", {}), ("prompt_lookup", {}), ("suffix", {}), ("early_exit", {"exit_layer": 2}),
           ("prompt_lookup", {"num_speculative_tokens": 3})]


@pytest.mark.parametrize("scheduler", [DraftEverything, DraftScheduler])
def test_each_sequence_gets_its_solo_output_whatever_shares_the_batch(scheduler):
    reg = Registry()
    g = torch.Generator().manual_seed(1)
    requests, solo = [], []
    for i in range(14):
        method, params = METHODS[i % len(METHODS)]
        n = int(torch.randint(1, 70, (1,), generator=g))
        unit = torch.randint(0, TINY.vocab_size, (int(torch.randint(1, 9, (1,), generator=g)),),
                             generator=g).tolist()
        prompt = (unit * 80)[:n] if i % 2 else torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist()
        max_tokens = int(torch.randint(1, 40, (1,), generator=g))
        m, p = reg.parse({"method": method, **params})
        requests.append(GenerationRequest("micro", prompt, max_tokens, method=m, params=p))
        solo.append(generate(MODEL, prompt, max_tokens, method, params)[0])
    engine = float64_engine(max_running=6, max_waiting=20)
    engine.scheduler = scheduler()
    engine.prefill_tokens = 24  # prompts up to 70 tokens prefill over several passes
    engine.start()
    try:
        events = run_all(engine, requests)
    finally:
        engine.stop()
    for want, evs in zip(solo, events):
        assert evs[-1].kind == "finish", evs[-1]
        assert [t for e in evs if e.kind == "step" for t in e.step.tokens] == want
    assert engine.passes > 0
    if scheduler is DraftEverything:
        assert sum(evs[-1].stats.accepted for evs in events) > 0
    assert sorted(engine.free_slots["micro"]) == list(range(6))


def test_sampled_requests_run_in_packed_passes_with_their_seeds():
    reg = Registry()
    sp = SamplingParams(temperature=0.8, seed=7)
    m, p = reg.parse("prompt_lookup")
    reqs = [GenerationRequest("micro", [1, 2, 3, 1, 2, 3], 20, sp, m, p) for _ in range(4)]
    engine = float64_engine(max_running=4, max_waiting=4)
    engine.scheduler = DraftEverything()
    engine.start()
    try:
        events = run_all(engine, reqs)
    finally:
        engine.stop()
    outs = [[t for e in evs if e.kind == "step" for t in e.step.tokens] for evs in events]
    assert all(len(o) == 20 for o in outs)
    assert outs[0] == outs[1] == outs[2] == outs[3]  # same seed, same stream, any batch


def test_the_pass_timer_fits_a_line():
    t = PassFit()
    for rows in range(1, 40):
        t.observe(rows, 0.002 + 0.0001 * rows)
    a, b, drafted, prefill, draft = t.coefficients
    assert a == pytest.approx(0.002, rel=1e-2) and b == pytest.approx(0.0001, rel=1e-2)
    # never seen varying: their priors
    assert (drafted, prefill, draft) == pytest.approx(
        (t.prior.drafted, t.prior.prefill, t.prior.draft), rel=1e-2)


def test_the_pass_timer_prices_drafting_sequences_draft_tokens_and_prompt_rows_apart():
    t = PassFit()
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        rows, drafted, prefill, k = (int(x) for x in torch.randint(0, 40, (4,), generator=gen))
        drafted = min(drafted, rows) // 4
        draft = drafted * (k % 8 + 1) if drafted else 0  # each drafting sequence: 1..8
        t.observe(rows, 0.001 + 8e-5 * rows + 4e-4 * drafted + 3e-5 * prefill + 1e-4 * draft,
                  drafted=drafted, prefill=prefill, draft=draft)
    co = t.coefficients
    assert co == pytest.approx((0.001, 8e-5, 4e-4, 3e-5, 1e-4), rel=2e-2)


def test_the_pass_timer_refits_soon_then_every_32_passes():
    """A fresh timer's first fits come after 8 and 16 passes; from then on a refit (a
    least-squares solve over the window) comes at most every ``REFIT_EVERY`` passes, read
    every pass as the plan reads it."""
    t = PassFit()
    solve, at = t._solve, []

    def counted():
        at.append(t._seen)
        return solve()

    t._solve = counted
    for i in range(200):
        t.observe(8 + i % 5, 1e-3 + 1e-4 * (8 + i % 5))
        t.coefficients
    assert at == [8, 16, 32, 64, 96, 128, 160, 192]
    assert t.coefficients.b == pytest.approx(1e-4, rel=1e-2)


def test_a_pass_of_plain_decoding_alone_is_not_planned():
    """Where no sequence has a draft budget (plain decoding's, or drafters resting), the
    plan returns at once: no fit of the pass timer read, no probes counted."""
    s = DraftScheduler()

    class Unread(PassFit):
        @property
        def coefficients(self):
            raise AssertionError("read")

    s.timer = Unread()
    states = [(s.state_for("none", 0.8), "none", 0) for _ in range(4)]
    assert s.limits(states, 4) == [0, 0, 0, 0] and not s.pooled_idle
    with pytest.raises(AssertionError, match="read"):
        s.limits(states[:3] + [(s.state_for("x", 0.8), "x", 4)], 4)


def test_the_pass_timer_never_trades_a_negative_cost_for_a_huge_one():
    """Passes whose time falls as their sequences grow (the end of a load, noise): an
    unconstrained fit gives a negative per-sequence cost; held at its floor, the others
    refitted, the fitted line still predicts a typical pass (clamping it after the fit
    kept a pass cost 5x the real one)."""
    t = PassFit()
    gen = torch.Generator().manual_seed(2)
    for _ in range(200):
        rows = 24 + int(torch.randint(0, 9, (1,), generator=gen))
        t.observe(rows, 0.009 - 0.00015 * rows + 1e-4 * float(torch.rand(1, generator=gen)))
    co = t.coefficients
    assert co.b == pytest.approx(1e-6)
    mean = statistics.mean(s[-1] for s in t.samples)
    assert co.a + co.b * 28 == pytest.approx(mean, rel=0.1)


def test_a_full_batchs_passes_still_price_draft_tokens():
    """Every pass ~32 sequences (their per-row cost confounded with the pass's own): the
    draft tokens' cost is still fitted from the passes that carry some, not taken as ~0."""
    t = PassFit()
    gen = torch.Generator().manual_seed(1)
    for i in range(200):
        rows = 30 + int(torch.randint(0, 3, (1,), generator=gen))
        drafted = int(torch.randint(0, 4, (1,), generator=gen))
        draft = drafted * int(torch.randint(1, 16, (1,), generator=gen))
        t.observe(rows, 0.004 + 5e-4 * drafted + 1e-4 * draft, drafted=drafted, draft=draft)
    co = t.coefficients
    assert co.draft == pytest.approx(1e-4, rel=5e-2)
    assert co.drafted == pytest.approx(5e-4, rel=5e-2)


def scheduler_timed(drafted_cost: float) -> DraftScheduler:
    s = DraftScheduler()
    for rows in range(1, 64):
        for d in (0, 1, 3):  # a row 50 us, a draft token's the same
            s.timer.observe(rows, 0.001 + 0.00005 * (rows + 4 * d) + drafted_cost * d,
                            drafted=d, draft=4 * d)
    return s


def test_drafting_shrinks_then_stops_as_the_batch_grows():
    s = scheduler_timed(1e-5)
    s.observe_propose("prompt_lookup", 0.0)
    mid = SeqDraftState(accepted=6, rejected=4)  # alpha 0.6
    one = s.limits([(mid, "prompt_lookup", 16)], 1)[0]
    eight = s.limits([(mid, "prompt_lookup", 16)] * 8, 8)
    many = s.limits([(mid, "prompt_lookup", 16)] * 32, 32)
    assert one > eight[0] > many[0] == 0
    sure = SeqDraftState(accepted=190, rejected=2)  # alpha 0.99 still pays at 32
    assert s.limits([(sure, "prompt_lookup", 16)] + [(mid, "prompt_lookup", 16)] * 31, 32)[0] > 0
    # a slow drafter must repay its own time
    s.observe_propose("slow", 0.01)
    assert s.limits([(mid, "slow", 16)], 1)[0] == 0


def test_a_drafted_blocks_own_cost_is_repaid_too():
    """The same belief drafts where a drafting sequence costs little beside its rows, and
    not where reading its block apart costs a pass's worth."""
    mid = SeqDraftState(accepted=6, rejected=4)
    assert scheduler_timed(1e-5).limits([(mid, "prompt_lookup", 16)] * 8, 8)[0] > 0
    assert scheduler_timed(2e-3).limits([(mid, "prompt_lookup", 16)] * 8, 8)[0] == 0


def test_a_sequence_that_stopped_drafting_probes_again():
    """Less often the more a probe costs: at 32 streams a probe's drafted block costs the
    batch more tokens than at 2."""
    s = DraftScheduler()
    co = s.timer.coefficients
    for n, rows in ((2, 2), (32, 32)):
        G = n / (co.a + co.b * rows)
        wait = probe_after(G, co)
        assert wait >= PROBE_EVERY
        st = SeqDraftState(accepted=1, rejected=9)
        assert s.limits([(st, "x", 8)] * n, rows)[0] == 0
        for _ in range(wait):
            st.observe(0, 0)
        assert s.limits([(st, "x", 8)] * n, rows)[0] == 1
    assert probe_after(32 / (co.a + co.b * 32), co) > probe_after(2 / (co.a + co.b * 2), co)


def test_a_kind_that_stopped_drafting_probes_as_a_pool():
    """Short requests never wait long enough to probe alone; their kind probes as a whole,
    about once per ``probe_after`` sequence-steps without a draft."""
    s = DraftScheduler()
    co = s.timer.coefficients
    n = 32
    wait = probe_after(n / (co.a + co.b * n), co)
    probes = 0
    for _ in range(10 * wait // n):
        states = [(s.state_for("x", 0.8), "x", 8) for _ in range(n)]  # fresh every pass
        for st, _, _ in states:
            st.accepted, st.rejected = 1.0, 9.0
        probes += sum(s.limits(states, n))
    assert 8 <= probes <= 12


def test_a_new_sequence_starts_from_what_its_kind_accepted():
    s = DraftScheduler()
    fresh = s.state_for("prompt_lookup", 0.0)
    assert (fresh.accepted, fresh.rejected) == (1.0, 1.0)
    for _ in range(50):  # greedy prompt-lookup sequences that accept nearly everything
        st = s.state_for("prompt_lookup", 0.0)
        s.observe(st, 8, 8)
        s.observe(st, 8, 7)
    learned = s.state_for("prompt_lookup", 0.0)
    assert learned.alpha > 0.85
    assert learned.accepted + learned.rejected == pytest.approx(PRIOR_STRENGTH)
    # another sampling regime, another method: nothing learned there
    assert s.state_for("prompt_lookup", 0.8).alpha == 0.5
    assert s.state_for("suffix", 0.0).alpha == 0.5
    # and it pays under load where the wide prior does not
    s2 = scheduler_timed(4e-4)
    s2.observe_propose("prompt_lookup", 0.0)
    assert s2.limits([(fresh, "prompt_lookup", 16)] * 8, 8)[0] == 0
    assert s2.limits([(learned, "prompt_lookup", 16)] * 8, 8)[0] > 0


def test_a_greedy_belief_leaves_a_finished_loop_within_a_few_steps():
    """A greedy sequence that drafted 15 tokens and kept them all for 20 steps, then has
    every draft rejected: within 4 steps its belief's mean is below 0.7. A sampled one
    keeps all its evidence (its acceptance is noisy, not changing)."""
    greedy = SeqDraftState(key=("auto", "greedy"))
    sampled = SeqDraftState(key=("auto", "t<=0.85"))
    for st in (greedy, sampled):
        for _ in range(20):
            st.observe(15, 15)
        for _ in range(4):
            st.observe(15, 0)
    assert greedy.alpha < 0.7
    assert greedy.accepted + greedy.rejected <= MAX_EVIDENCE
    assert sampled.alpha > 0.9


def test_the_plan_keeps_every_block_within_the_compiled_packed_pass():
    """``packed_draft_cap``: n drafting sequences' blocks, padded to the longest, fit the
    compiled packed pass (``CompiledPasses.packed``'s test), and one more token each would
    not -- so the plan never sends a pass to the eager path for a draft."""
    for n in range(1, 33):
        cap = packed_draft_cap(n)
        assert cap >= 1
        assert cap + 1 <= NARROW and max(2, n) * (cap + 1) <= PACKED_DRAFTED_ROWS
        assert cap + 2 > NARROW or max(2, n) * (cap + 2) > PACKED_DRAFTED_ROWS


def test_the_plan_bounds_blocks_only_for_the_compiled_packed_graphs():
    """``block_cap``: the packed graphs' bound where they run a batch; none (each drafter's
    own) where nodraft::packed_block does, or the passes are eager."""
    from nodraft.engine.core import block_cap
    from nodraft.micro import gemm

    model = tiny_model(dtype=torch.float32)
    assert block_cap(model, 8) is None  # eager
    model.compile(block=False)
    assert block_cap(model, 1) == packed_draft_cap(1) and block_cap(model, 8) == packed_draft_cap(8)
    if gemm.load():  # where nodraft's kernels build
        model.compile()  # lazy: decides (and loads them) at its first question
        assert block_cap(model, 8) is None and model.compiled.block_serves()


def test_a_chain_drafters_plan_is_bounded_by_its_own_longest_draft():
    """The batch plan prices no draft longer than the drafter sends: a sequence of a
    chain drafter may carry at most its ``num_speculative_tokens``."""
    model = tiny_model()
    engine = Engine({"tiny": model}, Registry(), eot_id=None, max_running=2)
    for method, params, want in (("prompt_lookup", {"num_speculative_tokens": 5}, 5),
                                 ("auto", {}, 16), ("none", {}, 64)):
        _, p = engine.registry.parse({"method": method, **params})
        handle = engine.submit(GenerationRequest("tiny", [1, 2, 3], 8, method=method, params=p),
                               lambda ev: None)
        assert engine._sequence(handle, 0).max_draft == want


class Recording(DraftEverything):
    """A plan that drafts for everyone and records what it is told: each step's (drafted
    depth, accepted) and each timed asking's method."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[int, int]] = []
        self.timed: list[str] = []

    def observe(self, state, drafted_depth, accepted):
        self.seen.append((drafted_depth, accepted))
        super().observe(state, drafted_depth, accepted)

    def observe_propose(self, method, seconds):
        self.timed.append(method)
        super().observe_propose(method, seconds)


def _two_sampled(drafter, plan: type = Recording) -> tuple[Recording, list[str]]:
    """Two sampled requests decoded with ``drafter`` (a class), both waiting before the
    engine starts, so every step is a packed one: (the engine's plan, of class ``plan``;
    every step's method)."""
    engine = float64_engine(max_running=2)
    engine.registry.register(drafter.name, drafter)
    engine.scheduler = plan()
    reqs = [GenerationRequest("micro", [1 + i, 2, 3, 4], 6, method=drafter.name,
                              params=drafter.Params(),
                              sampling=SamplingParams(temperature=0.8, seed=i))
            for i in range(2)]
    methods: list[str] = []
    ends: list[str] = []
    both = threading.Event()

    def ended(ev):
        if ev.kind == "step":
            methods.append(ev.step.method)
        if ev.kind in ("finish", "error"):
            ends.append(ev.kind)
            if len(ends) == 2:
                both.set()

    for r in reqs:
        engine.submit(r, ended)
    engine.start()
    try:
        assert both.wait(60) and ends == ["finish", "finish"]
    finally:
        engine.stop()
    return engine.scheduler, methods


def test_a_drafter_asked_that_sends_nothing_counts_as_a_rejection():
    """Asked for a draft in a packed pass and sending none, a sampled sequence's drafter
    gained nothing from being asked (and its asking cost time): the plan's belief records
    a draft rejected at its first token, so a sequence whose drafter finds nothing stops
    being asked. (Greedy sequences are not: a loop can begin at any step.)"""
    from nodraft.drafters.base import Draft, DrafterBase

    class Nothing(DrafterBase):
        name = "nothing"

        def propose(self, ctx, budget):
            return Draft.empty()

    seen = _two_sampled(Nothing)[0].seen
    # every step but each sequence's first (the prompt's prefill gives the first token) and
    # last (no room left for a draft) asked, and was refused
    assert seen.count((1, 0)) == len(seen) - 4 and seen.count((0, 0)) == 4


def test_a_drafter_that_did_not_look_is_neither_refused_nor_timed():
    """A drafter that answers ``Draft.not_looked()`` (``auto`` resting) was, to the plan,
    not asked: no rejection recorded, no drafting time, and its step is its idle method's."""
    from nodraft.drafters.base import Draft, DrafterBase

    class Resting(DrafterBase):
        name = "resting"
        idle_method = "none"

        def propose(self, ctx, budget):
            return Draft.not_looked()

    plan, methods = _two_sampled(Resting)
    assert plan.seen and set(plan.seen) == {(0, 0)}
    assert plan.timed == []
    assert set(methods) == {"none"}


def test_a_resting_drafter_is_left_out_of_the_plan_for_the_steps_it_declined():
    """In packed passes too, a drafter that declined its next steps in advance
    (``resting``) is neither asked nor told of them, and its sequence has no draft budget
    for the plan then (as plain decoding's)."""
    from nodraft.drafters.base import Draft, DrafterBase

    calls: list[tuple[str, int, int]] = []  # (what, request's first prompt token, tokens)

    class Resting(DrafterBase):
        name = "resting3"
        idle_method = "none"

        def propose(self, ctx, budget):
            calls.append(("propose", ctx.tokens[0], len(ctx.tokens)))
            self.resting = 3
            return Draft.not_looked()

        def observe(self, ctx, accepted):
            calls.append(("observe", ctx.tokens[0], len(ctx.tokens)))

    budgets: list[list[int]] = []

    class Planned(Recording):
        def limits(self, states, rows, prefill_rows=0):
            budgets.append([kmax for _, _, kmax in states])
            return super().limits(states, rows, prefill_rows)

    _, methods = _two_sampled(Resting, Planned)
    assert set(methods) == {"none"}
    for first in (1, 2):  # each request (6 tokens): the prefill's first token told; asked
        # at the next step, which declines the 3 after it; the last, with no room for a
        # draft, not asked and told
        mine = [(what, n) for what, f, n in calls if f == first]
        assert mine == [("observe", 5), ("propose", 5), ("observe", 10)], mine
    # the two sequences' budgets: 0 on the steps they rest
    assert [0, 0] in budgets and any(k > 0 for ks in budgets for k in ks)


def test_a_sampled_kind_probes_less_often_with_a_drafter_slow_to_ask():
    """A probe's price counts the asking time for a sampled kind; a greedy kind's probe
    is priced at its drafted block alone (a loop can begin at any step)."""
    co = PassFit().coefficients
    G = 32 / (co.a + co.b * 32)
    assert probe_after(G, co, propose_seconds=1e-3) > probe_after(G, co)

    def probes(temperature: float) -> int:
        s = DraftScheduler()
        s.observe_propose("x", 1e-3)
        n = 0
        for _ in range(200):
            states = [(s.state_for("x", temperature), "x", 8) for _ in range(32)]
            for st, _, _ in states:
                st.accepted, st.rejected = 1.0, 9.0
            n += sum(s.limits(states, 32))
        return n

    assert probes(0.0) > 1.5 * probes(0.8) > 0


def test_a_prompt_half_prefilled_in_packed_passes_finishes_its_prefill_alone():
    """A long prompt prefilled in chunks beside another sequence, which ends meanwhile,
    finishes its prefill on the lone path from where the chunks left off, and its first
    token comes from the pass that ends its prompt: the output is its solo output."""
    engine = float64_engine(max_running=2)
    engine.prefill_tokens = 4
    long_prompt = [(7 * i) % 60 + 1 for i in range(30)]
    requests = [GenerationRequest("micro", [3, 4], 2), GenerationRequest("micro", long_prompt, 5)]
    solo = [generate(MODEL, r.prompt, r.max_tokens, dtype=torch.float64)[0] for r in requests]
    prefilled = []
    prefill = MODEL.prefill_pass

    def recording(ids, cache, slot, start):
        prefilled.append((start, ids.shape[0]))
        return prefill(ids, cache, slot, start)

    MODEL.prefill_pass = recording
    done = threading.Event()
    events: list[list] = [[], []]
    try:
        for i, r in enumerate(requests):  # both waiting before the engine starts
            def cb(ev, i=i):
                events[i].append(ev)
                if sum(e.kind == "finish" for es in events for e in es) == 2:
                    done.set()
            engine.submit(r, cb)
        engine.start()
        assert done.wait(60)
    finally:
        engine.stop()
        MODEL.prefill_pass = prefill
    for es, want in zip(events, solo):
        assert [t for e in es if e.kind == "step" for t in e.step.tokens] == want
    # the long prompt's rest, alone, from where the packed chunks had left off
    assert prefilled and prefilled[-1][0] > 0 and sum(prefilled[-1]) == len(long_prompt)
