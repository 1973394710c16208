import dataclasses
import textwrap
import threading
import time

import pytest
import torch

from nodraft.drafters.base import Draft
from nodraft.drafters.ngrams import ResponseStore
from nodraft.drafters.registry import Registry, SpeculationError
from nodraft.engine.core import Engine, GenerationRequest, QueueFull
from nodraft.engine.stats import SpecStats
from nodraft.engine.verify import SamplingParams, accept, target_probs
from tests.conftest import TINY, tiny_model
from nodraft.engine.sequence import Sequence
from nodraft.micro.model import KVCache
from tests.engine.helpers import drafter_env, generate, run_all

MODEL = tiny_model()


class Exploding:
    name = "exploding"

    def __init__(self, every: int = 2):
        self.calls, self.every = 0, every

    def propose(self, ctx, budget):
        self.calls += 1
        if self.calls % self.every == 0:
            raise RuntimeError("boom")
        return Draft(torch.tensor([1, 2, 3])[:budget])

    def observe(self, ctx, accepted):
        pass


def test_a_drafter_that_raises_is_contained():
    want, _, _ = generate(MODEL, [5, 6, 7], 20)
    drafter = Exploding()
    got, seq, _ = generate(MODEL, [5, 6, 7], 20, drafter=drafter)
    assert got == want
    assert seq.stats.drafter_errors == drafter.calls // 2 > 0 and seq.finish_reason == "length"


class Resting:
    """Declines every step (``Draft.not_looked``), and every other time the next 3 as well
    (``resting``); records the token count at each call."""

    name = "resting"
    idle_method = "none"

    def __init__(self):
        self.asked: list[int] = []
        self.told: list[int] = []
        self.resting = 0

    def propose(self, ctx, budget):
        self.asked.append(len(ctx.tokens))
        self.resting = 3 if len(self.asked) % 2 else 0
        return Draft.not_looked()

    def observe(self, ctx, accepted):
        self.told.append(len(ctx.tokens))


def test_a_resting_drafter_is_neither_asked_nor_told_of_the_steps_it_declined():
    """After a ``not_looked`` draft with ``resting`` n, the sequence runs that step and the
    next n as plain decoding's without calling the drafter at all (``auto`` resting), then
    asks it again; with ``resting`` 0 it is told of the step as usual. The text is plain
    decoding's, greedy and seeded."""
    prompt = [5, 6, 7]
    for sampling in (SamplingParams(), SamplingParams(0.9, seed=4)):
        drafter = Resting()
        out, seq, steps = generate(MODEL, prompt, 12, drafter=drafter, sampling=sampling)
        assert out == generate(MODEL, prompt, 12, sampling=sampling)[0]
        P = len(prompt)
        # the prefill's first token is told; asked at P+1 (resting 3): P+2..P+4 not called;
        # asked at P+5 (resting 0: told), P+6 (resting 3), then P+10; the last step has no
        # room for a draft (not asked, told)
        assert drafter.asked == [P + 1, P + 5, P + 6, P + 10]
        assert drafter.told == [P + 1, P + 6, P + 11, P + 12]
        assert {r.method for r in steps} == {"none"} and seq.stats.drafted == 0
    # a plugin's ``resting`` that is no count is contained like a drafter that raises
    class Nonsense(Resting):
        resting = property(lambda self: "soon", lambda self, value: None)

    out, seq, _ = generate(MODEL, prompt, 6, drafter=Nonsense())
    assert out == generate(MODEL, prompt, 6)[0] and seq.stats.drafter_errors > 0


def test_figures_follow_the_definitions():
    prompt = [1, 2, 3, 4] * 6
    out, seq, steps = generate(MODEL, prompt, 30, "prompt_lookup")
    s = seq.stats
    assert s.target_passes == len(steps)
    assert s.accepted == sum(r.n_accepted for r in steps)
    assert s.drafted == sum(len(r.draft) for r in steps)
    assert s.accepted + s.target_passes == len(out)  # each pass emits accepted + 1 bonus
    assert sum(s.accepted_by_position) == s.accepted
    assert s.tokens_per_pass == pytest.approx((s.accepted + s.target_passes) / s.target_passes)
    assert s.estimated_speedup == pytest.approx(s.tokens_per_pass)  # prompt lookup costs 0
    _, plain, _ = generate(MODEL, prompt, 30)
    assert plain.stats.tokens_per_pass == 1.0 and plain.stats.acceptance_rate is None
    assert plain.stats.to_dict()["drafted"] == 0


@pytest.mark.parametrize("method,params", [
    ("none", {}), ("prompt_lookup", {}), ("lookahead", {}), ("early_exit", {"exit_layer": 1}),
    ("early_exit", {"exit_layer": 2, "reuse_kv": True}),
    ("medusa", {"num_heads": 1, "total_tokens": 3}), ("eagle", {})])
def test_only_model_free_chains_teach_the_pass_prices(method, params):
    """The table prices chains of model-free drafts (``auto``'s candidates): a pass after a
    drafter's own model ran (early exit's reusing ones not even whole), a tree's and one
    with lookahead's window rows run other graphs or start cold, and leave its scales
    alone; a plain pass (nothing drafted, no window rows) and a model-free chain's teach
    it, each by its rows."""
    from nodraft.drafters.costs import PassCost

    class Recording(PassCost):
        def observe(self, rows, seconds):
            seen.append(rows)
            super().observe(rows, seconds)

    seen: list[int] = []
    cost = Recording({1: 1e-3, 2: 1.5e-3, 3: 1.8e-3, 5: 2e-3, 9: 3e-3, 17: 5e-3})
    meth, p = Registry().parse({"method": method, **params})
    drafter = Registry().build(meth, p, drafter_env(MODEL))
    seq = Sequence(MODEL, KVCache(MODEL.config, 1), 0, [5, 6, 7, 8] * 6, drafter, 24,
                   SamplingParams(), method=meth, pass_cost=cost)
    steps = []
    with torch.inference_mode():
        while not seq.done:
            steps.append(seq.step())
    passes = steps[1:]  # the first token came from the prefill: no pass of its own
    plain = sum(1 for r in passes if not r.draft)
    if method in ("none", "prompt_lookup"):
        assert seen == [1 + len(r.draft) for r in passes]
        assert method == "none" or max(seen) > 1
    else:  # only its plain passes, if any (lookahead's all carry window rows)
        assert set(seen) <= {1} and len(seen) <= plain < len(passes)
    assert (cost.one_scale != 1.0) == (1 in seen)
    assert all(s is None for s in cost.scales) == (max(seen, default=1) == 1)


def test_pass_prices_learn_from_the_passes_requests_run():
    from nodraft.drafters.costs import LEARN, PassCost
    cost = PassCost({1: 1e-3, 2: 1.5e-3, 3: 1.8e-3, 5: 2e-3, 9: 3e-3, 17: 5e-3})
    assert cost(1) == 1e-3 and cost(4) == pytest.approx(1.9e-3)  # the table, interpolated
    for _ in range(200):  # one-row passes run 1.6x the table
        cost.observe(1, 1.6e-3)
    assert cost(1) == pytest.approx(1.6e-3, rel=1e-3)
    assert cost(3) == pytest.approx(1.6 * 1.8e-3, rel=1e-3)  # no pass of several rows seen
    cost.observe(3, 2 * 1.8e-3 * 1.6)  # a 3-row pass at twice its price
    assert cost(3) == pytest.approx(1.8e-3 * 1.6 * (1 + LEARN))  # one step of the way
    assert cost(9) == pytest.approx(3e-3 * 1.6)  # its size's scale alone
    assert cost(4) == pytest.approx(1.9e-3 * 1.6 * (1 + LEARN / 2))  # between 3 and 5
    for _ in range(300):  # 9-row passes at 2x the table: 9's scale, and between its neighbours
        cost.observe(9, 2 * 3e-3)
    assert cost(9) == pytest.approx(2 * 3e-3, rel=1e-3)
    assert cost(13) == pytest.approx((2 + 1.6) / 2 * 4e-3, rel=1e-3)
    assert cost(30) == pytest.approx(1.6 * cost.table(30))  # past 17: 17's, unseen
    for _ in range(300):  # 2-row passes at 0.4x the table
        cost.observe(2, 0.6e-3)
    assert cost(2) == cost(1)  # 0.4 x 1.5e-3 would be below a one-row pass: never
    assert cost.prices(40) == [cost(r) for r in range(41)]
    before = cost.one_scale
    cost.observe(1, 1.0)  # a preempted pass: counted as three times its price at most
    assert cost.one_scale == pytest.approx(before + LEARN * 2 * before)
    fresh = PassCost({1: 1e-3, 2: 1.5e-3, 3: 1.8e-3, 5: 2e-3})
    fresh.observe(4, 2 * 1.9e-3)  # half-way between 3 and 5: half a step each
    assert fresh(3) == pytest.approx(1.8e-3 * (1 + LEARN / 2))
    assert fresh(5) == pytest.approx(2e-3 * (1 + LEARN / 2))


def test_early_exit_cost_is_counted():
    _, seq, _ = generate(MODEL, [1, 2, 3], 10, "early_exit", {"exit_layer": 2, "num_speculative_tokens": 2})
    s = seq.stats
    assert s.draft_cost > 0
    assert s.estimated_speedup == pytest.approx((s.accepted + s.target_passes) / (s.target_passes + s.draft_cost))


def test_measured_cost_figures_price_each_pass_by_its_rows():
    """plain seconds: (accepted + 1) one-row passes a pass; verify seconds: the table's
    price of a pass of that many rows; draft seconds: the drafter's timed work."""
    from nodraft.drafters.costs import PassCost

    class Fixed(PassCost):  # prices that do not learn from the passes run (below)
        def observe(self, rows, seconds):
            pass

    table = Fixed({1: 1e-3, 2: 1.5e-3, 3: 1.8e-3, 5: 2e-3, 9: 3e-3, 17: 5e-3})
    prompt = [1, 2, 3, 4] * 6
    cache = KVCache(MODEL.config, 1, dtype=MODEL.tok_embeddings.weight.dtype)
    reg = Registry()
    L = MODEL.config.n_layers
    for method, params in (("prompt_lookup", {}), ("none", {}), ("early_exit", {"exit_layer": 1}),
                           ("early_exit", {"exit_layer": 1, "reuse_kv": True})):
        seq = Sequence(MODEL, cache, 0, list(prompt), reg.build(
            *reg.parse({"method": method, **params}), drafter_env(MODEL)), 30, method=method,
            pass_cost=table)
        steps = []
        with torch.inference_mode():
            while not seq.done:
                steps.append(seq.step())
        s = seq.stats
        assert s.plain_seconds == pytest.approx(sum((r.accepted + 1) * 1e-3 for r in steps))
        # early exit's pass that reuses the rows below its exit: E/L of it priced at 1 row
        reused = params.get("exit_layer", 0) / L if params.get("reuse_kv") else 0
        assert s.verify_seconds == pytest.approx(sum(
            (1 - reused) * table(1 + len(r.draft)) + reused * table(1) if r.draft
            else table(1) for r in steps))
        assert s.draft_seconds == pytest.approx(sum(r.draft_seconds for r in steps))
        assert s.measured_cost_speedup == pytest.approx(
            s.plain_seconds / (s.verify_seconds + s.draft_seconds))
        if method == "none":  # one 1-row pass a token, and no drafter to time
            assert s.draft_seconds == 0 and s.measured_cost_speedup == pytest.approx(1.0)
        elif method == "prompt_lookup":
            assert s.draft_seconds > 0 and s.accepted > 0
            # longer passes cost more than one row: below the course's estimate here
            assert 1.0 < s.measured_cost_speedup < s.estimated_speedup
        d = s.to_dict()
        assert d["measured_cost_speedup"] == pytest.approx(s.measured_cost_speedup, abs=1e-4)


def test_an_idle_engine_measures_its_pass_costs_before_any_request():
    """... past a context where compiled passes run (they need a few cached rows; a table
    timed at position 0 priced every compiled pass as an eager one)."""
    from nodraft.drafters import costs
    from nodraft.micro.compiled import MIN_CONTEXT
    model = tiny_model(dtype=torch.float32)  # an object of its own: no table measured yet
    assert costs.latest(model) is None
    starts, verify = [], model.verify_pass

    def recording(ids, cache, slot, start, *args, **kwargs):
        starts.append(start)
        return verify(ids, cache, slot, start, *args, **kwargs)

    model.verify_pass = recording
    engine = Engine({"tiny": model}, Registry(), eot_id=None, max_running=2)
    engine.start()
    try:
        deadline = time.monotonic() + 30
        while costs.latest(model) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        table = costs.latest(model)
        assert table is not None and table(17) >= table(1) > 0
        assert starts and min(starts) >= MIN_CONTEXT
        assert not engine.idle_work()  # measured once, not again and again
        events = run_all(engine, [GenerationRequest("tiny", [1, 2, 3, 1, 2, 3], 8,
                                                    method="prompt_lookup")])[0]
        stats = events[-1].stats
        assert stats.verify_seconds > 0 and stats.plain_seconds > 0
        assert costs.latest(model) is table
    finally:
        engine.stop()


def test_tables_wait_for_the_compiled_passes_being_loaded():
    """While a warm start loads its saved graphs (``costs_after_load``), an idle engine
    measures nothing -- an eager table would be thrown away in seconds and would slow the
    load -- then measures once they are ready; a request meanwhile still gets a table."""
    from nodraft.drafters import costs
    model = tiny_model(dtype=torch.float32)
    engine = Engine({"tiny": model}, Registry(), eot_id=None, max_running=2)
    engine.costs_after_load = True
    assert not engine.idle_work()
    engine.compiled_ready = True
    assert engine.idle_work()
    engine.idle(pending=lambda: True)  # a request on its way goes first
    assert costs.latest(model) is None and engine.idle_work()
    engine.compiled_ready, engine.compiled_error = False, "tiny: the build failed"
    assert engine.idle_work()  # a failed load measures the eager passes at once
    engine.compiled_error = None
    engine.start()
    try:
        events = run_all(engine, [GenerationRequest("tiny", [1, 2, 3] * 10, 4)])[0]
        assert costs.latest(model) is not None and events[-1].stats.plain_seconds > 0
    finally:
        engine.stop()


def test_work_between_requests_waits_for_a_gap():
    """``between_requests`` returns once nothing runs (a graph load then holds the GIL
    between requests, not during one), or after ``longest`` under unbroken load."""
    engine = float64_engine(max_running=2)
    engine.start()
    try:
        finished, returned = threading.Event(), []  # busy when between_requests returned

        def cb(ev):
            if ev.kind in ("finish", "error"):
                finished.set()

        engine.submit(GenerationRequest("micro", [5, 6, 7, 8], 120), cb)
        deadline = time.monotonic() + 10
        while not engine.busy and time.monotonic() < deadline:
            time.sleep(0.001)
        assert engine.busy
        engine.between_requests(longest=0.0)  # under load: at once
        returned.append(engine.busy)
        engine.between_requests(longest=60)
        returned.append(engine.busy)
        assert returned == [True, False] and finished.wait(10)
    finally:
        engine.stop()


def test_a_pass_that_waits_for_a_gap_is_the_gap():
    """Asked from the thread that runs the passes (a drafter that loads its saved graphs at
    a request's first use), ``between_requests`` returns at once: that request is what
    keeps the engine busy."""
    engine = float64_engine(max_running=2)
    engine.running.append(object())  # busy, with no engine thread to finish it
    engine._iterating = threading.get_ident()
    done = threading.Event()
    threading.Thread(target=lambda: (engine.between_requests(longest=60), done.set()),
                     daemon=True).start()
    engine.between_requests(longest=60)  # this thread: at once
    assert engine.busy and not done.wait(0.2)  # another thread: waits for the gap
    engine.running.clear()
    assert done.wait(10)


def test_stops_at_end_of_text_without_emitting_it():
    want, _, _ = generate(MODEL, [9, 8, 7], 30)
    stop = want[5]
    got, seq, _ = generate(MODEL, [9, 8, 7], 30, "prompt_lookup", stop_ids=frozenset({stop}))
    assert got == want[:want.index(stop)] and seq.finish_reason == "stop"


def test_accept_rules_by_hand():
    logits = torch.full((4, TINY.vocab_size), -10.0, dtype=torch.float64)
    logits[0, 5] = logits[1, 6] = logits[2, 7] = logits[3, 9] = 10.0
    greedy = SamplingParams()
    assert accept(logits, Draft(torch.tensor([5, 6, 8])), greedy) == ([0, 1], 7)
    assert accept(logits, Draft(torch.tensor([4, 6, 7])), greedy) == ([], 5)
    assert accept(logits[:1], Draft.empty(), greedy) == ([], 5)
    # a tree: node 1 (token 5) is the right child of the root, node 2 (token 7) its child;
    # node i's prediction is logits row 1 + i, so after node 2 the bonus is row 3's 9
    tree = Draft(torch.tensor([4, 5, 7]), torch.tensor([-1, -1, 1]))
    assert accept(logits, tree, greedy) == ([1, 2], 9)
    wrong_child = Draft(torch.tensor([4, 5, 6]), torch.tensor([-1, -1, 1]))
    assert accept(logits, wrong_child, greedy) == ([1], 7)


def test_top_k_and_top_p_keep_the_right_support():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert p.tolist() == pytest.approx([0.625, 0.375, 0, 0])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert p[3] == 0 and p.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.95, 0.999])
@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])  # flat to peaked: nuclei of 1 to ~4000
def test_top_p_from_the_top_k_equals_top_p_from_a_full_sort(top_p, scale, monkeypatch):
    """The array operations' nucleus (``nodraft::kept``'s is tests/engine/test_race_kernel.py's)."""
    monkeypatch.setenv("NODRAFT_RACE", "numpy")
    g = torch.Generator().manual_seed(int(scale * 10 + top_p * 1000))
    logits = torch.randn(6, 4096, generator=g) * scale
    sp = SamplingParams(temperature=0.8, top_p=top_p)
    # the reference: rank every token
    probs = (logits / 0.8).softmax(-1)
    vals, order = probs.sort(dim=-1, descending=True)
    keep = (vals.cumsum(-1) - vals) < top_p
    keep[..., 0] = True
    want = probs.masked_fill(~keep.scatter(-1, order, keep), 0.0)
    want = want / want.sum(-1, keepdim=True)
    got = target_probs(logits, sp)
    assert torch.equal(got > 0, want > 0)  # the same nucleus in every row
    torch.testing.assert_close(got, want)
    for r in range(6):  # and row by row, as verification asks for them
        torch.testing.assert_close(target_probs(logits[r], sp), want[r])


def test_registry_errors_list_what_exists():
    reg = Registry()
    with pytest.raises(SpeculationError, match="available: .*prompt_lookup"):
        reg.parse("medusa_v9")
    with pytest.raises(SpeculationError, match="it takes: .*ngram_max"):
        reg.parse({"method": "ngram", "ngram_maxx": 3})
    with pytest.raises(SpeculationError, match="must be int"):
        reg.parse({"method": "ngram", "ngram_max": "3"})
    with pytest.raises(SpeculationError, match="exit_layer"):
        reg.parse({"method": "early_exit", "exit_layer": 4})
    assert reg.parse("ngram")[0] == "prompt_lookup"
    assert reg.parse(None, default="suffix")[0] == "suffix"


def test_a_plugin_from_an_installed_package_is_served(tmp_path, monkeypatch):
    """A tiny installed distribution (code + dist-info with an entry point)."""
    pkg = tmp_path / "nodraft_echo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        import torch
        from nodraft.drafters.base import Draft

        class Echo:
            """Proposes the prompt's first tokens, whatever the context."""
            name = "echo"

            @dataclass(frozen=True)
            class Params:
                length: int = 2

            def __init__(self, params, env):
                self.params = params

            def propose(self, ctx, budget):
                return Draft(torch.tensor(ctx.tokens[: min(self.params.length, budget)]))

            def observe(self, ctx, accepted):
                pass
    '''))
    info = tmp_path / "nodraft_echo-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nodraft-echo\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[nodraft.drafters]\necho = nodraft_echo:Echo\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry()
    assert "echo" in reg.names()
    method, params = reg.parse({"method": "echo", "length": 3})
    assert params.length == 3
    engine = Engine({"micro": MODEL}, reg, eot_id=None, max_running=1, max_waiting=0)
    engine.caches["micro"].k = engine.caches["micro"].k.double()
    engine.caches["micro"].v = engine.caches["micro"].v.double()
    engine.start()
    try:
        events = run_to_end(engine, GenerationRequest("micro", [3, 4, 3, 4], 12, method=method, params=params))
        tokens = [t for e in events if e.kind == "step" for t in e.step.tokens]
        assert tokens == generate(MODEL, [3, 4, 3, 4], 12)[0]
        assert events[-1].stats.method == "echo" and events[-1].stats.drafted > 0
    finally:
        engine.stop()


def run_to_end(engine, request, timeout=30.0):
    events, done = [], threading.Event()

    def cb(ev):
        events.append(ev)
        if ev.kind in ("finish", "error"):
            done.set()

    engine.submit(request, cb)
    assert done.wait(timeout)
    return events


def float64_engine(**kw) -> Engine:
    engine = Engine({"micro": MODEL}, Registry(), eot_id=None, **kw)
    for c in engine.caches.values():
        c.k, c.v = c.k.double(), c.v.double()
    return engine


def test_engine_serves_concurrent_requests_and_bounds_the_queue():
    engine = float64_engine(max_running=2, max_waiting=1)
    engine.start()
    try:
        reg = Registry()
        results = []
        lock = threading.Lock()
        dones = [threading.Event() for _ in range(3)]

        def cb_for(i):
            def cb(ev):
                with lock:
                    results.append((i, ev))
                if ev.kind in ("finish", "error"):
                    dones[i].set()
            return cb

        m, p = reg.parse("suffix")
        for i in range(3):
            engine.submit(GenerationRequest("micro", [i + 1] * 5, 40, method=m, params=p), cb_for(i))
        with pytest.raises(QueueFull):
            engine.submit(GenerationRequest("micro", [1], 5), lambda ev: None)
        assert all(d.wait(30) for d in dones)
        for i in range(3):
            toks = [t for j, e in results if j == i and e.kind == "step" for t in e.step.tokens]
            assert toks == generate(MODEL, [i + 1] * 5, 40)[0]
        assert engine.load == (0, 0) and sorted(engine.free_slots["micro"]) == [0, 1]
    finally:
        engine.stop()


def test_cancel_frees_the_slot_before_the_next_step():
    engine = float64_engine(max_running=1, max_waiting=4)
    engine.start()
    try:
        first_step, finished = threading.Event(), threading.Event()
        reasons = []

        def cb(ev):
            if ev.kind == "step":
                first_step.set()
            elif ev.kind in ("finish", "error"):
                reasons.append(ev.finish_reason)
                finished.set()

        h = engine.submit(GenerationRequest("micro", [1, 2], 100_000 // 1000), cb)
        assert first_step.wait(10)
        engine.cancel(h)
        assert finished.wait(10)
        assert reasons in (["cancelled"], ["length"])
        deadline = time.time() + 5
        while engine.load != (0, 0) and time.time() < deadline:
            time.sleep(0.01)
        assert engine.free_slots["micro"] == [0]
    finally:
        engine.stop()


def test_spec_stats_merge():
    a, b = SpecStats("x"), SpecStats("x")
    a.record(3, 2, 0.5)
    b.record(4, 3, 0.0)
    a.merge(b)
    assert (a.drafted, a.accepted, a.target_passes, a.accepted_by_position) == (7, 5, 2, [2, 2, 1])


def test_a_lone_prompt_prefills_on_one_thread_unless_it_is_long():
    """A lone sequence's prefill runs on the engine's ``threads`` only from
    THREADED_PREFILL_TOKENS prompt tokens (a short prompt's first token came later on two);
    its later steps on one."""
    from nodraft.engine.core import THREADED_PREFILL_TOKENS

    model = tiny_model(dtype=torch.float32, config=dataclasses.replace(TINY, max_positions=512))
    seen: list[tuple[str, int]] = []
    prefill, verify = model.prefill_pass, model.verify_pass

    def counting(kind, fn):
        def call(*args, **kwargs):
            seen.append((kind, torch.get_num_threads()))  # OpenMP's count is per thread
            return fn(*args, **kwargs)
        return call

    model.prefill_pass = counting("prefill", prefill)
    model.verify_pass = counting("verify", verify)
    engine = Engine({"tiny": model}, Registry(), eot_id=None, max_running=1, threads=2)
    engine.start()
    try:
        short = [3] * 10
        long = [4] * THREADED_PREFILL_TOKENS
        for prompt, want in ((short, 1), (long, 2)):
            seen.clear()
            events = run_all(engine, [GenerationRequest("tiny", prompt, 3)])[0]
            assert events[-1].kind == "finish", events[-1]
            # the first step (the prefill, then the first pass) on the prefill's threads;
            # every later step on one
            verify = [n for k, n in seen if k == "verify"]
            assert ("prefill", want) in seen and verify[-2:] == [1, 1], seen
    finally:
        engine.stop()


def test_the_first_token_comes_from_the_prompts_prefill_pass():
    """A lone sequence's first step is ONE pass over the whole prompt: the head over its
    last row gives the first token (the prefill's, no verification pass after it); the
    drafters then see every prompt token's features, and plain decoding still makes one
    target pass per token."""
    model = tiny_model(dtype=torch.float32)
    calls: list[tuple[str, int]] = []
    prefill, verify = model.prefill_pass, model.verify_pass

    def counting(kind, fn):
        def call(ids, *args, **kwargs):
            calls.append((kind, ids.shape[0]))
            return fn(ids, *args, **kwargs)
        return call

    model.prefill_pass = counting("prefill", prefill)
    model.verify_pass = counting("verify", verify)
    prompt = [7, 3, 9, 1, 4]
    with torch.inference_mode():
        want = int(model(torch.tensor([prompt]))[0, -1].argmax())
    out, seq, steps = generate(model, prompt, 1)
    assert out == [want] and calls == [("prefill", 5)]
    assert seq.stats.target_passes == 1 and seq.cache.lengths[0] == len(prompt)
    assert seq.ctx.last_hidden.shape[0] == len(prompt)  # every prompt token's features
    calls.clear()
    out, seq, _ = generate(model, prompt, 6)
    assert calls == [("prefill", 5)] + [("verify", 1)] * 5
    assert seq.stats.target_passes == 6 and out[0] == want


def test_prompts_prefilled_in_a_packed_pass_get_their_first_token_from_it():
    """Two prompts waiting together are prefilled in one packed pass, and the same pass
    gives each its first token: one-token requests end after one pass."""
    engine = Engine({"tiny": tiny_model(dtype=torch.float32)}, Registry(), eot_id=None,
                    max_running=2)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    want = [generate(engine.models["tiny"], p, 1)[0] for p in prompts]
    done = threading.Event()
    events: list[list] = [[], []]

    for i, p in enumerate(prompts):  # both waiting before the engine starts
        def cb(ev, i=i):
            events[i].append(ev)
            if sum(e.kind == "finish" for es in events for e in es) == 2:
                done.set()
        engine.submit(GenerationRequest("tiny", p, 1), cb)
    engine.start()
    try:
        assert done.wait(60)
    finally:
        engine.stop()
    assert engine.passes == 1
    for es, w in zip(events, want):
        assert [e.step.tokens for e in es if e.kind == "step"] == [w]
        assert es[-1].stats.target_passes == 1


def test_a_sampled_auto_request_rested_through_is_looked_back_on_after_it_ends():
    """On a fresh server, an ``auto`` request at temperature 0.7 is never asked to draft;
    its response is looked back on from the close hook the engine runs after the request's
    end (``Auto._hindsight``): the server's state for ``auto`` holds the regime's
    hindsight credit (spent), and its suffix candidate's store of responses the response."""
    engine = float64_engine(max_running=1, max_waiting=4)
    engine.start()
    try:
        ended, stats = threading.Event(), []

        def cb(ev):
            if ev.kind in ("finish", "error"):
                stats.append(ev.stats)
                ended.set()

        method, params = Registry().parse({"method": "auto",
                                            "candidates": "prompt_lookup,suffix"})
        engine.submit(GenerationRequest("micro", [3, 1, 4, 1, 5, 9, 2, 6] * 4, 40,
                                        SamplingParams(temperature=0.7, seed=5),
                                        method=method, params=params), cb)
        assert ended.wait(30)
        deadline = time.time() + 5
        state = engine.shared.setdefault(("auto", "micro"), {})
        while "t<=0.85" not in state.get("auto_hindsight", {}) and time.time() < deadline:
            time.sleep(0.01)
    finally:
        engine.stop()
    assert stats[0].drafted == 0 and stats[0].target_passes == 40
    assert state["auto_hindsight"]["t<=0.85"] < 0.0  # looked back on: its time spent
    assert len(state["suffix"]["suffix_global"]) == 1  # auto's suffix candidate's store


@pytest.mark.parametrize("cancel", [False, True])
def test_a_drafter_is_closed_after_its_requests_end_is_reported(cancel):
    """The engine runs a finished sequence's close hook (suffix decoding's store taking
    the response) after the request's end is reported, at its next iteration: before the
    next request is admitted, and when nothing else is running (a cancelled request too)."""
    engine = float64_engine(max_running=1, max_waiting=4)
    engine.start()
    try:
        store = engine.shared.setdefault(("suffix", "micro"), {}).setdefault(
            "suffix_global", ResponseStore())
        stored_at_end, first_step, ended = [], threading.Event(), threading.Event()

        def cb(ev):
            if ev.kind == "step":
                first_step.set()
            elif ev.kind in ("finish", "error"):
                stored_at_end.append(len(store))
                ended.set()

        method, params = Registry().parse({"method": "suffix"})
        h = engine.submit(GenerationRequest("micro", [3, 1, 4, 1, 5], 400 if cancel else 12,
                                            method=method, params=params), cb)
        if cancel:
            assert first_step.wait(10)
            engine.cancel(h)
        assert ended.wait(10)
        assert stored_at_end == [0]  # not yet when the end was reported
        deadline = time.time() + 5
        while (engine.busy or not len(store)) and time.time() < deadline:
            time.sleep(0.01)
        assert not engine.busy and len(store) == 1  # closed with nothing else to run
        # a request waiting for the slot is admitted after the close: its drafter sees the
        # response stored
        stored_at_admit = []

        def admitted(ev):
            if ev.kind == "admit":
                stored_at_admit.append(len(store))
            if ev.kind in ("finish", "error"):
                ended.set()

        ended.clear()
        engine.submit(GenerationRequest("micro", [2, 7, 1], 6, method=method, params=params),
                      lambda ev: None)
        engine.submit(GenerationRequest("micro", [2, 7], 4, method=method, params=params),
                      admitted)
        assert ended.wait(10) and stored_at_admit == [2]
    finally:
        engine.stop()
