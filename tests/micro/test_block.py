"""nodraft::block and nodraft::packed_block (micro/csrc/block.cpp), the one-call passes of
a lone sequence and of a batch: eager micro's numbers up to float rounding for every pass
the engine runs (a decode step, chains and trees, early exit's ranges, prompts from an
empty slot and past a prefix, every kind of packed batch, on both checkpoints and any head
width they take); batch-invariant bit for bit (a token alone, behind drafts, on an accepted
tree path, or batched beside other sequences gives the same logits); their inputs
checked; and where they serve (``CompiledPasses.block_serves``)."""

import pytest
import torch

from nodraft.engine.sequence import tree_attention_mask
from nodraft.micro import gemm
from nodraft.micro.checkpoint import load_model
from nodraft.micro.model import KVCache, Micro, MicroConfig
from nodraft.micro.ops import additive_mask

pytestmark = pytest.mark.skipif(not gemm.load(), reason=f"nodraft's kernels unavailable: {gemm.why()}")

TOL = dict(rtol=1e-4, atol=2e-4)


@pytest.fixture(scope="module", params=["micro", "micro-layerskip"])
def pair(request, checkpoint_dir):
    eager = load_model(request.param, checkpoint_dir)
    fast = load_model(request.param, checkpoint_dir).compile()
    assert fast.compiled.block_serves()
    return eager, fast


def _prefilled(model, n: int, slots: int = 3, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> KVCache:
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    cache = KVCache(model.config, slots, dtype=dtype)
    with torch.inference_mode():
        model(ids[None], cache=cache, slot=1, start=0)
    cache.set_length(1, n)
    return cache


def _ops(fn) -> set[str]:
    with torch.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("T, tree", [(1, False), (3, False), (3, True), (6, False), (7, True)])
def test_a_block_matches_eager(pair, T, tree):
    eager, fast = pair
    ce, cf = _prefilled(eager, 40), _prefilled(eager, 40)
    ids = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(T))
    pos, mask = None, None
    if tree:
        parents = [-1, 0, 1, -1, 3, 4] if T == 7 else [-1, -1]
        mask = tree_attention_mask(torch.tensor(parents))
        pos = 40 + torch.tensor([0, 1, 2, 3, 1, 2, 3] if T == 7 else [0, 1, 1])
    le, he = eager.verify_pass(ids, ce, 1, 40, pos, mask)
    ops = _ops(lambda: fast.verify_pass(ids, cf, 1, 40, pos, mask))
    lf, hf = fast.verify_pass(ids, cf, 1, 40, pos, mask)
    assert "nodraft::block" in ops and "aten::linear" not in ops  # one call, no eager layers
    torch.testing.assert_close(lf, le, **TOL)
    torch.testing.assert_close(hf, he, **TOL)
    # its keys and values in rows [40, 40 + T) of slot 1, nothing else written
    torch.testing.assert_close(cf.k, ce.k, **TOL)
    torch.testing.assert_close(cf.v, ce.v, **TOL)
    assert cf.k[:, 0].abs().sum() == 0 and cf.k[:, 1, :, 40 + T:].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_chain_from_its_ids_gives_the_block_s_bits(pair, dtype):
    """``verify_chain`` (a decode step's token, or it and a chain of drafts, as token ids)
    runs ONE ``nodraft::chain`` call: the logits, residual stream and cache rows
    ``verify_pass`` gives over the same ids, bit for bit; a bad id is refused, the cache
    left as it was."""
    eager, fast = pair
    for T in (1, 4):
        ids = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(T))
        by_pass, by_ids = _prefilled(fast, 30, dtype=dtype), _prefilled(fast, 30, dtype=dtype)
        lp, hp = fast.verify_pass(ids, by_pass, 1, 30)
        spare = _prefilled(fast, 30)
        ops = _ops(lambda: fast.verify_chain(ids.tolist(), spare, 1, 30))
        assert "nodraft::chain" in ops and "aten::embedding" not in ops
        lc, hc = fast.verify_chain(ids.tolist(), by_ids, 1, 30)
        assert torch.equal(lc, lp) and torch.equal(hc, hp)
        assert torch.equal(by_ids.k, by_pass.k) and torch.equal(by_ids.v, by_pass.v)
        if dtype == torch.float32:  # eager micro: verify_pass's eager pass, the same numbers
            le, _ = eager.verify_chain(ids.tolist(), _prefilled(eager, 30), 1, 30)
            torch.testing.assert_close(lc, le, **TOL)
    cache = _prefilled(fast, 30)
    before = cache.k.clone()
    with pytest.raises(RuntimeError, match="token id 4096 outside the table's 4096"):
        fast.verify_chain([5, 4096], cache, 1, 30)
    with pytest.raises(RuntimeError, match="outside the cache"):
        fast.verify_chain([5], cache, 1, cache.max_len)
    assert torch.equal(cache.k, before)


def test_the_head_between_passes_gives_a_pass_s_bits(pair):
    """``head_rows`` (a prompt's first token, after its prefill) by ``nodraft::head``, from
    the head matrix the passes read: bit for bit the logits a pass's head gives the same
    rows, however many rows it is given."""
    from nodraft.micro.packed import head_rows

    eager, fast = pair
    cf = _prefilled(eager, 40)
    with torch.inference_mode():
        lf, hf = fast.verify_pass(torch.tensor([5, 6, 7]), cf, 1, 40, None, None)
        assert "nodraft::head" in _ops(lambda: head_rows(fast, hf[-1:]))
        assert torch.equal(head_rows(fast, hf), lf)
        assert torch.equal(head_rows(fast, hf[-1:]), lf[-1:])
        torch.testing.assert_close(head_rows(fast, hf), eager.head(hf), **TOL)


def test_early_exit_ranges_match_eager(pair):
    eager, fast = pair
    ce, cf = _prefilled(eager, 30), _prefilled(eager, 30)
    block = torch.tensor([11, 12, 13])
    for E in (1, 3):
        le, re = eager.exit_pass(block, ce, 1, 30, E)
        lf, rf = fast.exit_pass(block, cf, 1, 30, E)
        torch.testing.assert_close(lf, le, **TOL)
        torch.testing.assert_close(rf, re, **TOL)
        torch.testing.assert_close(fast.exit_residual(block, cf, 1, 30, E), re, **TOL)
        fe, ge = eager.verify_from(re, ce, 1, 30, E)
        ff, gf = fast.verify_from(re, cf, 1, 30, E)
        torch.testing.assert_close(ff, fe, **TOL)
        torch.testing.assert_close(gf, ge, **TOL)
        torch.testing.assert_close(cf.k, ce.k, **TOL)


@pytest.mark.parametrize("T, start", [(1, 0), (2, 0), (7, 0), (70, 0), (1, 20), (5, 20), (40, 20)])
def test_a_prompt_matches_eager(pair, T, start):
    eager, fast = pair
    ce, cf = _prefilled(eager, start), _prefilled(eager, start)
    ids = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(T))
    he = eager.prefill_pass(ids, ce, 1, start)
    hf = fast.prefill_pass(ids, cf, 1, start)
    torch.testing.assert_close(hf, he, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(cf.k, ce.k, **TOL)
    torch.testing.assert_close(cf.v, ce.v, **TOL)
    assert cf.k[:, 1, :, start + T:].abs().sum() == 0  # no scratch row written past it
    nxt = torch.tensor([7])
    torch.testing.assert_close(fast.verify_pass(nxt, cf, 1, start + T)[0],
                               eager.verify_pass(nxt, ce, 1, start + T)[0], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_token_gives_the_same_bits_alone_behind_drafts_and_on_a_tree_path(pair, dtype):
    """The contract that makes a lone sequence's speculative decoding equal its plain
    decoding bit for bit: a row's logits do not depend on the rows verified with it --
    over a float32 cache and over a float16 one."""
    _, fast = pair
    ids = torch.randint(0, 4096, (8,), generator=torch.Generator().manual_seed(5))
    chain = _prefilled(fast, 25, dtype=dtype)
    lc, hc = fast.verify_pass(ids[:6], chain, 1, 25)  # the token and five drafts
    alone = _prefilled(fast, 25, dtype=dtype)
    for t in range(6):  # one token a pass, each committed before the next
        la, ha = fast.verify_pass(ids[t:t + 1], alone, 1, 25 + t)
        assert torch.equal(la[0], lc[t]) and torch.equal(ha[0], hc[t])
    # a tree: node 0 the current token; nodes 1, 3 a first draft; 2 under 1, 4 under 3
    # (each draft's parent among the drafts, -1 the current token)
    tree = tree_attention_mask(torch.tensor([-1, 0, -1, 2]))
    tid = torch.stack([ids[0], ids[1], ids[2], ids[7], ids[2]])
    pos = 25 + torch.tensor([0, 1, 2, 1, 2])
    branchy = _prefilled(fast, 25, dtype=dtype)
    lt, _ = fast.verify_pass(tid, branchy, 1, 25, pos, tree)
    # path 0 -> 3 -> 4 accepted: its rows moved in place, the next token's pass sees them
    branchy.move_rows(1, [25, 28, 29], 25)
    path = _prefilled(fast, 25, dtype=dtype)
    lp, _ = fast.verify_pass(torch.stack([ids[0], ids[7], ids[2]]), path, 1, 25)
    for node, row in ((0, 0), (3, 1), (4, 2)):
        assert torch.equal(lt[node], lp[row])
    nxt = torch.tensor([9])
    assert torch.equal(fast.verify_pass(nxt, branchy, 1, 28)[0],
                       fast.verify_pass(nxt, path, 1, 28)[0])


def test_other_widths_match_eager():
    """Any head width the kernel takes (even, up to 128; here 16 and 24 wide, three and
    two heads) and a width that is not a multiple of eight."""
    for config in (MicroConfig(vocab_size=300, dim=48, n_layers=2, n_heads=3, ffn_dim=100,
                               max_positions=64),
                   MicroConfig(vocab_size=300, dim=36, n_layers=3, n_heads=3, ffn_dim=80,
                               max_positions=64)):
        torch.manual_seed(0)
        eager = Micro(config)
        fast = Micro(config)
        fast.load_state_dict(eager.state_dict())
        fast.compile()
        ce, cf = KVCache(config, 2), KVCache(config, 2)
        ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(fast.prefill_pass(ids[:12], cf, 1, 0),
                                   eager.prefill_pass(ids[:12], ce, 1, 0), **TOL)
        le, _ = eager.verify_pass(ids[12:16], ce, 1, 12)
        lf, _ = fast.verify_pass(ids[12:16], cf, 1, 12)
        assert fast.compiled.block_serves()
        torch.testing.assert_close(lf, le, **TOL)


def test_bad_inputs_are_refused_with_the_reason(pair):
    _, fast = pair
    cache = _prefilled(fast, 10)
    c = fast.config
    compiled = fast.compiled
    h = torch.zeros(2, c.dim)
    good = dict(pos=torch.tensor([10, 11]), lo=0, hi=c.n_layers, slot=1, start=10, mask=None)

    def run(**kw):
        a = {**good, **kw}
        return compiled.run(h if "h" not in kw else kw["h"], a["pos"], a["lo"], a["hi"], cache,
                            a["slot"], a["start"], a["mask"], True)

    with pytest.raises(RuntimeError, match="outside the cache"):
        run(start=cache.max_len - 1)
    with pytest.raises(RuntimeError, match="outside the cache"):
        run(slot=3)
    with pytest.raises(RuntimeError, match="position 5000 outside the rotary tables"):
        run(pos=torch.tensor([10, 5000]))
    with pytest.raises(RuntimeError, match="mask must be"):
        run(mask=torch.zeros(3, 3))
    with pytest.raises(RuntimeError, match="not the width"):
        run(h=torch.zeros(2, c.dim + 1))
    assert run() is not None  # and still serves


def test_where_it_serves(checkpoint_dir, monkeypatch):
    model = load_model("micro", checkpoint_dir)
    assert not model.compile(block=False).compiled.block_serves()
    assert not model.compile(gemm="torch").compiled.block_serves()  # torch.mm everywhere
    assert model.compile().compiled.block_serves()
    # a server's engine (lazy=False) never builds the library on a request's path: until it
    # is loaded (with the graphs), its passes run eager
    monkeypatch.setattr(gemm, "loaded", lambda: False)
    monkeypatch.setattr(gemm, "choose", lambda *a: pytest.fail("the library was asked for"))
    model.compile(lazy=False)
    assert not model.compiled.block_serves()
    cache = _prefilled(model, 10)
    assert model.compiled.run(torch.zeros(1, 160), torch.tensor([10]), 0, 4, cache, 1, 10, None,
                              True) is None


def test_a_packed_pass_matches_eager_for_every_kind_of_batch(checkpoint_dir):
    """``nodraft::packed_block`` (``forward_packed`` where it serves): eager's logits,
    hidden states and cache rows for one-row blocks over the whole cache and a sparse
    range, chains and a tree beside one-row blocks, drafted blocks alone, prompts' chunks
    (from an empty slot and past a prefix) beside steps -- all in one call."""
    from nodraft.micro.packed import forward_packed
    from tests.engine.test_compiled import _packed_batches

    eager = load_model("micro", checkpoint_dir)
    fast = load_model("micro", checkpoint_dir).compile()
    ce, cf = KVCache(eager.config, 5, 64), KVCache(eager.config, 5, 64)
    for want_batch, got_batch in zip(_packed_batches(eager, ce), _packed_batches(eager, cf)):
        want = forward_packed(eager, want_batch, ce)
        ops = _ops(lambda: forward_packed(fast, got_batch, KVCache(eager.config, 5, 64)))
        got = forward_packed(fast, got_batch, cf)
        assert "nodraft::packed_block" in ops and "aten::linear" not in ops
        for (lw, hw), (lg, hg) in zip(want, got):
            assert (lw is None) == (lg is None)
            if lw is not None:
                torch.testing.assert_close(lg, lw, **TOL)
            torch.testing.assert_close(hg, hw, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(cf.k, ce.k, **TOL)
        torch.testing.assert_close(cf.v, ce.v, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_sequence_gets_the_same_bits_batched_as_alone(checkpoint_dir, dtype):
    """Batch-invariant across sequences too: a block's logits in a packed pass beside
    other sequences' blocks (one-row steps, a tree, a prompt's chunk) are its logits when it
    runs alone, bit for bit -- over a float32 cache and over a float16 one."""
    from nodraft.micro.packed import Segment, forward_packed

    fast = load_model("micro", checkpoint_dir).compile()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 4096, (n,), generator=g) for n in (17, 30, 9, 24)]

    def fresh():
        cache = KVCache(fast.config, 5, 96, dtype)
        for s, p in enumerate(prompts):
            fast.prefill_pass(p, cache, s, 0)
        return cache

    chain = torch.randint(0, 4096, (4,), generator=g)
    tree = tree_attention_mask(torch.tensor([-1, -1, 0]))
    batch = [Segment(0, 17, chain, torch.arange(17, 21)),
             Segment(1, 30, chain[:1], torch.tensor([30])),
             Segment(2, 9, chain, torch.tensor([9, 10, 10, 11]), tree),
             Segment(3, 24, chain[:2], torch.arange(24, 26)),
             Segment(4, 0, prompts[0][:7], torch.arange(7), logits=False)]
    packed = forward_packed(fast, batch, fresh())
    for s, (lg, hg) in zip(batch, packed):
        alone = fresh()
        if s.logits:
            la, ha = fast.verify_pass(s.ids, alone, s.slot, s.start, s.pos, s.mask)
            assert torch.equal(lg, la) and torch.equal(hg, ha)
        else:
            assert torch.equal(hg, fast.prefill_pass(s.ids, alone, s.slot, s.start))


def test_a_packed_pass_refuses_a_slot_twice_and_lengths_that_do_not_add_up(checkpoint_dir):
    fast = load_model("micro", checkpoint_dir).compile()
    cache = KVCache(fast.config, 3, 64)
    op = torch.ops.nodraft.packed_block.default
    norms, mats = fast.compiled._block_weights(0, fast.config.n_layers, True)
    h = torch.zeros(2, fast.config.dim)
    args = (h, torch.tensor([3, 4]), fast.rope_cos, fast.rope_sin, norms, mats, cache.k, cache.v)
    with pytest.raises(RuntimeError, match="taken twice"):
        op(*args, [1, 1], [0, 0], [3, 4], [None, None], [1, 1], 0, 1e-5)
    with pytest.raises(RuntimeError, match="add up to 3"):
        op(*args, [1, 2], [0, 1], [3, 4], [None, None], [1, 1], 0, 1e-5)
    h2, lg = op(*args, [1, 1], [0, 1], [3, 4], [None, None], [1, 0], 0, 1e-5)
    assert h2.shape == (2, fast.config.dim) and lg.shape == (1, fast.config.vocab_size)


def test_a_float16_cache_holds_its_rows_rounded_and_reads_them_back(checkpoint_dir):
    """A float16 cache: the pass writes every key and value rounded to half precision and
    attends over exactly those rows -- eager micro over the same float16 cache gives its
    numbers, a float32 cache nearly; and the graphs, which take only the model's own
    dtype, leave such a cache to nodraft::block or to eager passes."""
    eager = load_model("micro", checkpoint_dir)
    fast = load_model("micro", checkpoint_dir).compile()
    ids = torch.randint(0, 4096, (5,), generator=torch.Generator().manual_seed(3))
    half, half_eager = (_prefilled(m, 30, dtype=torch.float16) for m in (fast, eager))
    full = _prefilled(fast, 30)
    assert half.k.dtype == torch.float16 and half.v.dtype == torch.float16
    torch.testing.assert_close(half.k, half_eager.k, rtol=2e-3, atol=2e-3)
    lh, _ = fast.verify_pass(ids, half, 1, 30)
    le, _ = eager.verify_pass(ids, half_eager, 1, 30)
    lf, _ = fast.verify_pass(ids, full, 1, 30)
    torch.testing.assert_close(lh, le, rtol=1e-3, atol=2e-3)
    torch.testing.assert_close(lh, lf, rtol=1e-2, atol=2e-2)  # half precision's rounding
    assert not torch.equal(lh, lf)  # the rows read were the rounded ones
    # the rows this pass wrote are its keys and values, rounded: the first layer's, whose
    # inputs (the tokens' embeddings) both caches share, are the float32 ones rounded
    assert torch.equal(half.k[0, 1, :, 30:35], full.k[0, 1, :, 30:35].half())
    assert torch.equal(half.v[0, 1, :, 30:35], full.v[0, 1, :, 30:35].half())
    # a float16 cache's head must be whole vectors of 8 for nodraft::block
    from nodraft.micro.compiled import _block_reads, _graphs_read
    assert _block_reads(half) and not _graphs_read(half, torch.float32)
