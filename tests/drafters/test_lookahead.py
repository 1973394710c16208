"""Lookahead decoding: the window's layout against the paper's, the Jacobi step and the
harvest, the n-gram pool, and the drafter on a tiny model."""

import torch

from nodraft.drafters.base import DraftContext
from nodraft.drafters.lookahead import Lookahead, NgramPool, ngram_tree, window_layout
from nodraft.micro.model import KVCache
from nodraft.engine.sequence import Sequence
from nodraft.engine.verify import accept
from tests.conftest import TINY, tiny_model
from tests.engine.helpers import generate

MODEL = tiny_model()


def names_seen(pos, mask, names):
    """Each aux row's offset and the names it attends to (column 0 is the current token)."""
    cols = ["c", *names]
    return {names[r]: (int(pos[r]), " ".join(c for c, v in zip(cols, mask[r].tolist()) if v))
            for r in range(len(names))}


def test_the_window_layout_is_the_papers():
    # W = 3, N = 4: level 0 = c a1 a2, level 1 = b0 b1 b2, level 2 = d0 d1 d2; row (l, i)
    # at offset l + i sees c, level 0 up to column i, and column i of levels 1..l.
    pos, mask = window_layout(3, 3)
    names = ["a1", "a2", "b0", "b1", "b2", "d0", "d1", "d2"]
    assert names_seen(pos, mask, names) == {
        "a1": (1, "c a1"),
        "a2": (2, "c a1 a2"),
        "b0": (1, "c b0"),
        "b1": (2, "c a1 b1"),
        "b2": (3, "c a1 a2 b2"),
        "d0": (2, "c b0 d0"),
        "d1": (3, "c a1 b1 d1"),
        "d2": (4, "c a1 a2 b2 d2"),
    }
    # every row sees one token per offset 0 .. its own: a trajectory of consecutive positions
    for r in range(len(names)):
        assert int(mask[r].sum()) == int(pos[r]) + 1


def test_start_up_window_is_causal_prompt_tokens():
    prompt = [7, 8, 9, 10, 11]
    d = Lookahead(Lookahead.Params(window=3, ngram=4, seed_from_prompt=False))
    ctx = DraftContext(list(prompt), len(prompt), MODEL, KVCache(TINY, 1), 0)
    draft = d.propose(ctx, 8)
    assert len(draft) == 0  # nothing pooled yet
    assert draft.n_aux == 3 + 4 - 3  # level 0 only: W + N - 3 tokens
    assert set(draft.aux.tokens.tolist()) <= set(prompt)
    assert draft.aux.pos.tolist() == [1, 2, 3, 4]
    assert torch.equal(draft.aux.mask, torch.ones(4, 5, dtype=torch.bool).tril(1))


def run_steps(seq: Sequence, n: int, check=None):
    with torch.inference_mode():
        if not seq.prefilled:
            seq.prefill()
        for _ in range(n):
            draft = seq.propose()
            logits, hidden = seq.verify(draft)
            if check is not None:
                check(seq, draft)
            path, bonus = accept(logits, draft, seq.sampling, seq.generator)
            seq.commit(draft, path, bonus, hidden)


def test_every_aux_row_gets_the_logits_of_its_trajectory():
    """The engine's block (positions n + offset, the aux mask) makes each window row's
    logits those of a plain forward over the context and the row's trajectory."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9, 10, 11, 12, 13]
    cache = KVCache(TINY, 1, dtype=torch.float64)
    seq = Sequence(MODEL, cache, 0, prompt, Lookahead(Lookahead.Params(window=3, ngram=4)), 40)
    rows = []

    def check(seq, draft):
        ids, pos, mask = seq.block(draft)
        n, k = len(seq.tokens) - 1, len(draft)
        for r in range(draft.n_aux):
            seen = mask[1 + k + r].nonzero()[:, 0]
            assert pos[seen].tolist() == list(range(n, n + len(seen)))
            want = MODEL(torch.tensor([seq.tokens[:-1] + ids[seen].tolist()]))[0, -1]
            torch.testing.assert_close(seq.ctx.aux_logits[r], want)
            rows.append(r)

    run_steps(seq, 5, check)
    assert len(rows) == 4 + 7 + 8 * 3  # start-up (4, then 7 rows), then the full window


def test_start_up_fills_the_levels_then_the_window_keeps_its_shape():
    cache = KVCache(TINY, 1, dtype=torch.float64)
    d = Lookahead(Lookahead.Params(window=3, ngram=5))
    seq = Sequence(MODEL, cache, 0, list(range(20)), d, 100)
    shapes = []
    for _ in range(5):
        run_steps(seq, 1)
        shapes.append([len(lvl) for lvl in seq.ctx.state["levels"]])
    # level 0 excludes the current token: W + N - 3 = 5 at first, W - 1 = 2 when full
    assert shapes == [[4, 5], [3, 4, 4], [2, 3, 3, 3], [2, 3, 3, 3], [2, 3, 3, 3]]


def test_a_jacobi_step_harvests_one_ngram_per_column_and_shifts_the_levels():
    W, N = 3, 4
    d = Lookahead(Lookahead.Params(window=W, ngram=N, guesses=4, seed_from_prompt=False))
    c = 1
    ctx = DraftContext([9, 9, c], 3, MODEL, KVCache(TINY, 1), 0)
    st = d._state(ctx)
    st["levels"] = [[11, 12], [20, 21, 22], [30, 31, 32]]  # a1 a2 / b0 b1 b2 / d0 d1 d2
    draft = d.propose(ctx, 8)
    assert draft.aux.tokens.tolist() == [11, 12, 20, 21, 22, 30, 31, 32]
    outputs = [50, 51, 52, 53, 54, 40, 41, 42]  # the top level's rows predict 40 41 42
    ctx.aux_logits = torch.nn.functional.one_hot(torch.tensor(outputs), TINY.vocab_size).float()
    ctx.tokens += [7]  # nothing accepted, the bonus token 7
    d.observe(ctx, [])
    pool = st["pool"]
    assert pool.get(c) == [(20, 30, 40)]  # column 0 starts with the current token
    assert pool.get(11) == [(21, 31, 41)]
    assert pool.get(12) == [(22, 32, 42)]
    assert st["levels"] == [[21, 22], [30, 31, 32], [40, 41, 42]]
    # the next step drafts from the harvest: the pool's n-grams under the current token
    ctx.tokens += [11]
    draft = d.propose(ctx, 8)
    assert draft.tokens.tolist() == [21, 31, 41] and draft.parents is None


def test_the_pool_keeps_the_most_recent_guesses_per_token_without_duplicates():
    pool = NgramPool(per_key=2)
    for tail in [(1, 2), (3, 4), (1, 2), (5, 6)]:
        pool.add(0, tail)
    assert pool.get(0) == [(5, 6), (1, 2)]  # (1, 2) was seen again, so (3, 4) left first
    pool.add(0, (5, 6))
    assert pool.get(0) == [(5, 6), (1, 2)]
    assert pool.get(9) == []


def test_the_pool_is_seeded_from_the_prompt_and_merged_into_a_tree():
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1]
    d = Lookahead(Lookahead.Params(window=2, ngram=3, guesses=4))
    ctx = DraftContext(list(prompt), len(prompt), MODEL, KVCache(TINY, 1), 0)
    draft = d.propose(ctx, 8)
    # under 1: (2, 3) and (2, 4), most recent first, sharing the node 2
    assert draft.tokens.tolist() == [2, 3, 4]
    assert draft.parents.tolist() == [-1, 0, 0]
    d_off = Lookahead(Lookahead.Params(window=2, ngram=3, seed_from_prompt=False))
    ctx = DraftContext(list(prompt), len(prompt), MODEL, KVCache(TINY, 1), 0)
    assert len(d_off.propose(ctx, 8)) == 0
    # G bounds the guesses kept per first token
    d_one = Lookahead(Lookahead.Params(window=2, ngram=3, guesses=1))
    ctx = DraftContext(list(prompt), len(prompt), MODEL, KVCache(TINY, 1), 0)
    assert d_one.propose(ctx, 8).tokens.tolist() == [2, 3]


def test_output_ngrams_join_the_pool_as_they_are_emitted():
    d = Lookahead(Lookahead.Params(window=2, ngram=3))
    ctx = DraftContext([4, 5], 2, MODEL, KVCache(TINY, 1), 0)
    d.propose(ctx, 8)
    ctx.tokens += [6, 4]
    d.observe(ctx, [6])  # no aux logits: the window waits, the text is pooled
    assert ctx.state["pool"].get(4) == [(5, 6)]
    assert ctx.state["pool"].get(5) == [(6, 4)]


def test_ngram_tree_respects_the_budget_and_puts_parents_first():
    grams = [(1, 2, 3), (1, 2, 4), (5, 6, 7)]
    assert ngram_tree(grams, 10) == ([1, 2, 3, 4, 5, 6, 7], [-1, 0, 1, 1, -1, 4, 5])
    assert ngram_tree(grams, 4) == ([1, 2, 3, 4], [-1, 0, 1, 1])
    assert ngram_tree(grams, 0) == ([], [])


def test_near_the_end_of_the_context_the_window_waits():
    prompt = [i % TINY.vocab_size for i in range(TINY.max_positions - 4)]
    d = Lookahead(Lookahead.Params(window=4, ngram=4))
    ctx = DraftContext(list(prompt), len(prompt), MODEL, KVCache(TINY, 1), 0)
    draft = d.propose(ctx, 2)
    assert draft.n_aux == 0 and draft.cost == 0.0  # 5 window rows do not fit in 4
    levels = [list(lvl) for lvl in ctx.state["levels"]]
    ctx.tokens.append(0)
    d.observe(ctx, [])
    assert ctx.state["levels"] == levels


def test_a_repeating_prompt_gets_tokens_accepted_and_the_output_is_plain_greedy():
    unit = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]
    prompt = unit * 4 + unit[:3]
    want, _, _ = generate(MODEL, prompt, 40)
    for params in ({}, {"seed_from_prompt": False, "window": 5, "ngram": 4}):
        got, seq, _ = generate(MODEL, prompt, 40, "lookahead", params)
        assert got == want
        assert seq.stats.accepted > 0, params
        assert seq.stats.draft_cost > 0
