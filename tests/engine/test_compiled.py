"""Compiled passes (micro/compiled.py), the graphs (``block=False``: what serves where
nodraft's one-call pass does not, tests/micro/test_block.py): the same numbers as eager
micro up to float rounding, the KV rows written where eager writes them, short contexts and cold families
eager, and a failed warm-up serving eager. The invariant with every pass compiled --
speculative greedy equal to plain greedy for every drafter and parameter set -- is checked
on the graphs a server builds and loads (tests/server/test_server_compiled.py), which are
the ones served."""

import sys

import pytest
import torch

from nodraft.micro import gemm
from nodraft.micro.checkpoint import load_model
from nodraft.micro.model import KVCache
from nodraft.engine.sequence import tree_attention_mask


@pytest.fixture(scope="module")
def pair(checkpoint_dir):
    """micro-layerskip eager and compiled (one compile per family for the module)."""
    eager = load_model("micro-layerskip", checkpoint_dir)
    compiled = load_model("micro-layerskip", checkpoint_dir).compile(block=False)
    return eager, compiled


def _prefilled(model, n: int, seed: int = 0) -> tuple[KVCache, list[int]]:
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    cache = KVCache(model.config, 2)
    with torch.inference_mode():
        model(ids[None], cache=cache, slot=1, start=0)
    cache.set_length(1, n)
    return cache, ids.tolist()


# one row, a short and a longer chain, a small and a larger tree
@pytest.mark.parametrize("T, tree", [(1, False), (3, False), (3, True), (5, False), (7, True)])
def test_a_compiled_pass_matches_eager(pair, T, tree):
    eager, compiled = pair
    ce, _ = _prefilled(eager, 40)
    cc, _ = _prefilled(eager, 40)  # the same prefix, written eagerly, for both
    ids = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(T))
    pos, mask = None, None
    if tree:  # two branches under the current token
        parents = [-1, 0, 1, -1, 3, 4] if T == 7 else [-1, -1]
        mask = tree_attention_mask(torch.tensor(parents))
        pos = 40 + torch.tensor([0, 1, 2, 3, 1, 2, 3] if T == 7 else [0, 1, 1])
    le, he = eager.verify_pass(ids, ce, 1, 40, pos, mask)
    lc, hc = compiled.verify_pass(ids, cc, 1, 40, pos, mask)
    assert compiled.compiled.compile_seconds > 0  # it did run compiled
    # with nodraft's product wherever it builds (micro/gemm.py)
    assert compiled.compiled.gemm_kind == ("nodraft" if gemm.load() else "torch")
    torch.testing.assert_close(lc, le, rtol=1e-4, atol=2e-4)
    torch.testing.assert_close(hc, he, rtol=1e-4, atol=2e-4)
    # the block's keys and values went to rows [40, 40+T) of slot 1, nothing else changed
    torch.testing.assert_close(cc.k, ce.k, rtol=1e-4, atol=2e-4)
    torch.testing.assert_close(cc.v, ce.v, rtol=1e-4, atol=2e-4)
    assert cc.k[:, 0].abs().sum() == 0 and cc.lengths == ce.lengths == [0, 40]


def test_early_exit_ranges_match_eager(pair):
    eager, compiled = pair
    ce, _ = _prefilled(eager, 30)
    cc, _ = _prefilled(eager, 30)
    x = torch.tensor([[11]])
    with torch.inference_mode():
        for E in (1, 3):
            pos = torch.tensor([[30]])
            he = eager.run_layers(eager.embed(x), pos, 0, E, cache=ce, slot=1, start=30)
            hc = compiled.run_layers(compiled.embed(x), pos, 0, E, cache=cc, slot=1, start=30)
            torch.testing.assert_close(hc, he, rtol=1e-4, atol=2e-4)
            le = eager(x, cache=ce, slot=1, start=30, exit_layer=E)
            lc = compiled(x, cache=cc, slot=1, start=30, exit_layer=E)
            torch.testing.assert_close(lc, le, rtol=1e-4, atol=2e-4)
            # the rest of a 3-row block from layer E on, the head included (the
            # verification of a draft that reuses its rows below E)
            block = torch.tensor([11, 12, 13])
            re = eager.exit_residual(block, ce, 1, 30, E)
            rc = compiled.exit_residual(block, cc, 1, 30, E)
            torch.testing.assert_close(rc, re, rtol=1e-4, atol=2e-4)
            fe, ge = eager.verify_from(re, ce, 1, 30, E)
            fc, gc = compiled.verify_from(re, cc, 1, 30, E)
            assert (E, 4, True, True) in {f[:4] for f in compiled.compiled._ready}
            torch.testing.assert_close(fc, fe, rtol=1e-4, atol=2e-4)
            torch.testing.assert_close(gc, ge, rtol=1e-4, atol=2e-4)
            # and what one whole pass over the block gives
            we, _ = eager.verify_pass(block, ce, 1, 30)
            torch.testing.assert_close(fe, we, rtol=1e-4, atol=2e-4)
            torch.testing.assert_close(cc.k, ce.k, rtol=1e-4, atol=2e-4)


# a lone row (run as two), a short prompt, one past the rows' broadcast products' sizes
@pytest.mark.parametrize("T", [1, 2, 7, 40])
def test_the_compiled_prefill_matches_eager(pair, T):
    eager, compiled = pair
    ids = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(T))
    ce, cc = KVCache(eager.config, 2), KVCache(eager.config, 2)
    he = eager.prefill_pass(ids, ce, 1, 0)
    hc = compiled.prefill_pass(ids, cc, 1, 0)
    assert any(f[0] == "prefill" for f in compiled.compiled._ready)  # it did run compiled
    assert hc.shape == he.shape == (T, eager.config.dim)
    torch.testing.assert_close(hc, he, rtol=1e-4, atol=1e-3)
    # the prompt's keys and values in rows [0, T) of slot 1; a lone row's scratch row after
    # it is past the committed length, where drafts are written too
    rows = max(T, 2)
    torch.testing.assert_close(cc.k[:, 1, :, :T], ce.k[:, 1, :, :T], rtol=1e-4, atol=2e-4)
    torch.testing.assert_close(cc.v[:, 1, :, :T], ce.v[:, 1, :, :T], rtol=1e-4, atol=2e-4)
    assert cc.k[:, 0].abs().sum() == 0 and cc.k[:, 1, :, rows:].abs().sum() == 0
    # what follows the prefill sees the same cache: the next token's logits agree
    nxt = torch.tensor([7])
    le, _ = eager.verify_pass(nxt, ce, 1, T)
    lc, _ = compiled.verify_pass(nxt, cc, 1, T)
    torch.testing.assert_close(lc, le, rtol=1e-4, atol=1e-3)


# a prompt's rows past a cached prefix (or a long prompt's next chunk): one row, a few, many
@pytest.mark.parametrize("T", [1, 5, 40])
def test_the_compiled_prefill_past_a_prefix_matches_eager(pair, T):
    eager, compiled = pair
    start = 20
    ce, _ = _prefilled(eager, start)
    cc, _ = _prefilled(eager, start)  # the same prefix, written eagerly, for both
    ids = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(T))
    he = eager.prefill_pass(ids, ce, 1, start)
    hc = compiled.prefill_pass(ids, cc, 1, start)
    L = eager.config.n_layers
    assert any(f[:4] == (0, L, False, T > 1) for f in compiled.compiled._ready)  # compiled
    assert hc.shape == he.shape == (T, eager.config.dim)
    torch.testing.assert_close(hc, he, rtol=1e-4, atol=1e-3)
    end = start + T
    torch.testing.assert_close(cc.k[:, 1, :, :end], ce.k[:, 1, :, :end], rtol=1e-4, atol=2e-4)
    torch.testing.assert_close(cc.v[:, 1, :, :end], ce.v[:, 1, :, :end], rtol=1e-4, atol=2e-4)


def test_short_contexts_and_cold_families_run_eager(checkpoint_dir):
    model = load_model("micro", checkpoint_dir).compile(lazy=False, block=False)
    cache, _ = _prefilled(model, 20)
    x = torch.zeros(1, 160)
    run = model.compiled.run
    assert run(x, torch.tensor([20]), 0, 4, cache, 1, 20, None, True) is None  # not warmed
    assert run(x, torch.tensor([1]), 0, 4, cache, 1, 1, None, True) is None  # prefix < 2
    # eager fallback gives the right answer all the same
    want = load_model("micro", checkpoint_dir).verify_pass(torch.tensor([5]), cache, 1, 20)
    got = model.verify_pass(torch.tensor([5]), cache, 1, 20)
    assert torch.equal(got[0], want[0])


def test_a_failed_warm_up_leaves_the_engine_serving_eager(checkpoint_dir):
    import threading

    from nodraft.drafters.registry import Registry
    from nodraft.engine.core import WARM_UP_SWITCH_INTERVAL, Engine, GenerationRequest

    model = load_model("micro", checkpoint_dir).compile(lazy=False)

    switch = []

    def broken(cache, slot, early_exit=True):
        switch.append(sys.getswitchinterval())
        raise RuntimeError("no C++ compiler")

    model.compiled.warm_up = broken
    engine = Engine({"micro": model}, Registry(), eot_id=None, max_running=2)
    engine.start()
    before = sys.getswitchinterval()
    try:
        engine.warm_up().join(30)
        assert engine.compiled_error == "micro: RuntimeError: no C++ compiler"
        # the GIL changed hands more often while compiling, and as before afterwards
        assert switch == [pytest.approx(WARM_UP_SWITCH_INTERVAL)]  # microseconds inside
        assert sys.getswitchinterval() == before
        assert model.compiled is None and not engine.compiled_ready
        done, tokens = threading.Event(), []

        def cb(ev):
            if ev.kind == "step":
                tokens.extend(ev.step.tokens)
            elif ev.kind in ("finish", "error"):
                done.set()

        engine.submit(GenerationRequest("micro", [5, 6, 7, 8], 6), cb)
        assert done.wait(60) and len(tokens) == 6
    finally:
        engine.stop()


def test_after_the_warm_up_no_pass_compiles(checkpoint_dir):
    """The warm-up compiles the graphs the engine's passes use as they are called -- from
    another thread, in inference mode, at any context length, slot and block size -- so no
    request compiles one on the engine's thread (a guard on the inputs' dispatch keys once
    made every first real pass recompile: seconds, on a server that said "ready")."""
    import threading

    from torch._dynamo.utils import counters

    # one thread in both, as Engine.warm_up and a lone sequence's step run (the thread
    # count is part of dynamo's guards, and per thread)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = load_model("micro", checkpoint_dir).compile(lazy=False, block=False)
    try:
        model.compiled.warm_up(KVCache(model.config, 2), 0, early_exit=False)
    finally:
        torch.set_num_threads(threads)
    graphs = counters["stats"]["unique_graphs"]
    cache = KVCache(model.config, 2)
    ids = torch.randint(0, model.config.vocab_size, (60,), generator=torch.Generator().manual_seed(0))
    ready = set(model.compiled._ready)

    def passes():
        torch.set_num_threads(1)
        with torch.inference_mode():
            for T in (1, 2, 60):  # prompts of every size prefill compiled
                model.prefill_pass(ids[:T], cache, 1, 0)
            model.prefill_pass(ids[:16], cache, 1, 0)
            for T in (1, 20):  # the rows past a cached prefix
                model.prefill_pass(ids[16:16 + T], cache, 1, 16)
            model.prefill_pass(ids[:37], cache, 1, 0)
            cache.set_length(1, 37)
            for T in (1, 4, 1, 6, 2):
                model.verify_pass(ids[:T], cache, 1, cache.lengths[1])
                cache.advance(1, T)
            # a mask that is a view past its storage's start, as early exit's verification
            # passes one (a slice of the block's (T, start + T) mask)
            n = cache.lengths[1]
            sliced = model.block_mask(3, n, None)[:, n:]
            assert sliced.storage_offset() > 0
            L = model.config.n_layers
            assert model.compiled.run(model.embed(ids[:3]), torch.arange(n, n + 3), 0, L,
                                      cache, 1, n, sliced, head=True) is not None
    thread = threading.Thread(target=passes)
    thread.start()
    thread.join()
    assert counters["stats"]["unique_graphs"] == graphs
    assert model.compiled._ready == ready  # the warmed families, and they ran


def test_a_family_picks_its_product_the_same_whether_first_or_not():
    """In a fresh process the product is not resolved until a graph is built or loaded:
    the first family must still get the weights and product every later one would (a
    saved one-row graph built first, with the product unresolved, took the packed
    weights, and its load in the engine refused the unpacked ones)."""
    import subprocess

    code = (
        "import torch\n"
        "from nodraft.micro import gemm\n"
        "from nodraft.micro.compiled import closure_data\n"
        "from tests.conftest import tiny_model\n"
        "m = tiny_model(dtype=torch.float32).compile(lazy=False, gemm='auto')\n"
        "L = m.config.n_layers\n"
        "def kinds(fn):\n"
        "    c = closure_data(fn)\n"
        "    return (any(v is torch.mm for v in c.values()),\n"
        "            sorted(v.dim() for v in c.values() if isinstance(v, torch.Tensor)))\n"
        "first = kinds(m.compiled._core(0, L, True, False))\n"
        "later = kinds(m.compiled._core(0, L, True, False))\n"
        "print(first == later, first[0], gemm.unit())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    assert out.returncode == 0, out.stderr[-2000:]
    same, uses_torch_mm, unit = out.stdout.split()[-3:]
    assert same == "True"
    if unit == "AVX2":  # the one-row graphs multiply with torch.mm there
        assert uses_torch_mm == "True"


def _packed_batches(model, cache):
    """Batches over ``cache`` (5 slots, each with a prefix of its own): one row per slot
    of the whole cache; one row in a sparse range with a slot whose prefix is empty (a
    one-token prompt); chains and a tree; and prompt chunks beside steps -- a first chunk
    (the prefill graph) and a later one (the full pass without a head)."""
    from nodraft.micro.packed import Segment

    V = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(0, V, (n,), generator=g)  # noqa: E731
    lens = [30, 12, 0, 45, 21]
    with torch.inference_mode():
        for s, n in enumerate(lens):
            if n:
                model.prefill_pass(ids(n), cache, s, 0)
    tree = tree_attention_mask(torch.tensor([-1, -1, 0, 2]))
    seg = lambda s, T, pos=None, mask=None: Segment(  # noqa: E731
        s, lens[s], ids(T), torch.arange(lens[s], lens[s] + T) if pos is None else lens[s] + pos,
        mask)
    return [
        [seg(s, 1) for s in range(5)],
        [seg(0, 1), seg(2, 1), seg(4, 1)],
        [seg(0, 4), seg(1, 1), seg(3, 5, torch.tensor([0, 1, 1, 2, 3]), tree), seg(4, 2)],
        [seg(0, 1), seg(1, 1), seg(3, 1), seg(4, 3)],  # one drafted block: its group padded
        [seg(1, 2), seg(4, 3)],  # drafted blocks only: the one-row group all padding
        [seg(2, 1), seg(3, 6), seg(0, 2)],  # one one-row block (an empty prefix)
        [seg(0, 3), Segment(2, 0, ids(9), torch.arange(9), logits=False),
         Segment(1, 12, ids(6), torch.arange(12, 18), logits=False), seg(4, 1)],
    ]


def test_packed_passes_match_eager(checkpoint_dir):
    """The compiled packed passes (micro/compiled.py ``packed``, through ``forward_packed``)
    give eager's logits, hidden states and cache rows, for every kind of batch: one-row
    blocks over the whole cache and in a sparse range, drafted blocks (chains, a tree)
    beside one-row ones or alone, a lone one-row block beside drafted ones, prompt chunks
    beside steps (a later chunk through the full pass without a head)."""
    from nodraft.micro.packed import forward_packed

    eager = load_model("micro", checkpoint_dir)
    compiled = load_model("micro", checkpoint_dir).compile(block=False)  # lazy: compiles as it goes
    ce, cc = KVCache(eager.config, 5, 64), KVCache(eager.config, 5, 64)
    ops = set()
    for want_batch, got_batch in zip(_packed_batches(eager, ce), _packed_batches(eager, cc)):
        want = forward_packed(eager, want_batch, ce)
        with torch.profiler.profile() as prof:
            got = forward_packed(compiled, got_batch, cc)
        ops |= {e.name for e in prof.events()}
        for (lw, hw), (lg, hg) in zip(want, got):
            assert (lw is None) == (lg is None)
            if lw is not None:
                torch.testing.assert_close(lg, lw, rtol=1e-4, atol=2e-4)
            torch.testing.assert_close(hg, hw, rtol=1e-4, atol=2e-4)
        torch.testing.assert_close(cc.k, ce.k, rtol=1e-4, atol=2e-4)
        torch.testing.assert_close(cc.v, ce.v, rtol=1e-4, atol=2e-4)
    families = {f[:2] for f in compiled.compiled._ready if f[0] == "packed"}
    assert families == {("packed", False), ("packed", True)}  # both ran compiled
    L = eager.config.n_layers
    assert (0, L, False, True) in {f[:4] for f in compiled.compiled._ready}  # the later chunk
    # the one-row blocks' attention: nodraft's kernel wherever the products are nodraft's
    assert ("nodraft::attend" in ops) == (compiled.compiled.gemm_kind == "nodraft")
    if compiled.compiled.gemm_kind == "nodraft":  # the rows written by nodraft's copy too
        assert "nodraft::put_rows" in ops
    # drafted blocks past PACKED_DRAFTED_ROWS padded rows: left to the eager pass
    from nodraft.micro.compiled import PACKED_DRAFTED_ROWS
    from nodraft.micro.packed import Segment

    T = PACKED_DRAFTED_ROWS // 4 + 1
    wide = [Segment(s, 20, torch.zeros(T, dtype=torch.long), torch.arange(20, 20 + T))
            for s in range(4)]
    assert compiled.compiled.packed(wide, cc) is None
    assert compiled.compiled.packed(wide[:3], cc) is not None


def test_the_head_between_passes_reads_the_compiled_copy_and_matches(pair):
    """``head_rows`` (a prompt's first token): the compiled passes' (in, out) head weight
    when compiled, the eager head otherwise -- the same logits up to float rounding."""
    from nodraft.micro.packed import head_rows

    eager, compiled = pair
    h = torch.randn(3, eager.config.dim, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(head_rows(eager, h), eager.head(h))
        torch.testing.assert_close(head_rows(compiled, h), eager.head(h), rtol=1e-4, atol=1e-4)
        # the copy the graphs read, not the embedding's (out, in) weight
        w = compiled.compiled._weights()["head"]
        assert w.shape == (eager.config.dim, eager.config.vocab_size) and w.is_contiguous()


def test_the_head_between_passes_never_resolves_the_product(checkpoint_dir, monkeypatch):
    """A server's first request meets compiled passes not built yet (eager until they
    load): its first token's head must not resolve the product, which may build
    ``nodraft::mm`` on the engine's thread (seconds; a first request once waited 20 s)."""
    from nodraft.micro.packed import head_rows

    model = load_model("micro", checkpoint_dir).compile(lazy=False)
    monkeypatch.setattr(gemm, "choose", lambda *a: pytest.fail("the product was resolved"))
    h = torch.randn(1, model.config.dim, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(head_rows(model, h), model.head(h))
    assert model.compiled.built_weights() is None
