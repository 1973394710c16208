"""EAGLE: the dynamic tree, the draft KV cache across steps, training and loading."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from scipy.stats import chisquare

from nodraft.drafters.base import DraftContext
from nodraft.drafters.eagle import Eagle, features, load_head_state, write_untrained
from nodraft.drafters.eagle.evaluation import evaluate_head
from nodraft.micro.greedy import greedy_continue
from nodraft.micro.train import bf16_native
from nodraft.drafters.eagle.head import (EagleHead, cached_values, save_head, unroll,
                                         values)
from nodraft.drafters.registry import DrafterEnv, SpeculationError
from nodraft.micro.model import KVCache
from tests.conftest import TINY, tiny_model
from tests.engine.helpers import REGISTRY, generate

MODEL = tiny_model(seed=1)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> DrafterEnv:
    d = tmp_path_factory.mktemp("eagle")
    write_untrained(MODEL, "tiny", d)
    return DrafterEnv("tiny", MODEL, {}, checkpoint_dir=d)


@pytest.fixture(scope="module")
def fused_env(tmp_path_factory) -> DrafterEnv:
    """A head with EAGLE-3's fused features: the value rows of target layers 1 and 3."""
    d = tmp_path_factory.mktemp("eagle-fused")
    write_untrained(MODEL, "tiny", d, fuse_layers=(1, 3))
    return DrafterEnv("tiny", MODEL, {}, checkpoint_dir=d)


def prefilled(prompt: list[int]) -> DraftContext:
    """A context as the sequence leaves it after the prefill."""
    cache = KVCache(MODEL.config, 1, dtype=torch.float64)
    hidden: list[torch.Tensor] = []
    with torch.inference_mode():
        MODEL(torch.tensor([prompt[:-1]]), cache=cache, hidden=hidden)
    cache.advance(0, len(prompt) - 1)
    return DraftContext(list(prompt), len(prompt), MODEL, cache, 0, hidden[-1][0])


def commit(ctx: DraftContext, accepted: list[int], bonus: int) -> None:
    """What verification leaves behind: [current, *accepted] cached, their final hidden
    states in last_hidden, accepted + bonus appended."""
    n = ctx.n_cached
    hidden: list[torch.Tensor] = []
    with torch.inference_mode():
        MODEL(torch.tensor([[ctx.tokens[-1], *accepted]]), cache=ctx.cache, start=n, hidden=hidden)
    ctx.cache.advance(0, 1 + len(accepted))
    ctx.last_hidden = hidden[-1][0]
    ctx.tokens.extend(accepted + [bonus])


def from_scratch(ctx: DraftContext, env: DrafterEnv, params: Eagle.Params, budget: int = 64):
    """A new drafter on a copy of the context with no state and no hidden states: it must
    rebuild its cache from the target's features alone."""
    fresh = DraftContext(list(ctx.tokens), ctx.prompt_len, ctx.model, ctx.cache, 0)
    return Eagle(params, env).propose(fresh, budget)


def reference_tree(drafter: Eagle, ctx: DraftContext, budget: int = 64):
    """EAGLE-2's tree built the slow way: every node's feature from its own sequential
    forwards along its path (no batching, no tree mask), then the same selection."""
    p, L, m = drafter.params, drafter.loaded, MODEL
    n, c = ctx.n_cached, MODEL.config
    layer = drafter.layer

    def run(rows_x: torch.Tensor, start: int, k, v) -> torch.Tensor:
        pos = torch.arange(start, start + rows_x.shape[0])
        cos, sin = m.rope_cos[pos][None, None], m.rope_sin[pos][None, None]
        mask = None if rows_x.shape[0] == 1 or start == 0 else \
            torch.ones(rows_x.shape[0], start + rows_x.shape[0], dtype=torch.bool).tril(start)
        return layer.forward(rows_x[None], cos, sin, (k, v), start, mask)[0]

    hidden: list[torch.Tensor] = []
    m(torch.tensor([ctx.tokens[:n]]), hidden=hidden)
    k = torch.zeros(c.n_heads, n + 64, c.head_dim, dtype=torch.float64)
    v = torch.zeros_like(k)
    x = L.tok_proj[torch.tensor(ctx.tokens[1:n + 1])] + features(m, hidden[-1][0]) @ L.w_feat_t
    root = run(x, 0, k, v)[-1]

    def log_q(f):
        return (f @ L.w_draft_t).log_softmax(-1)

    def feature_of(path: list[int]) -> torch.Tensor:  # path: draft-vocab indices
        kk, vv = k.clone(), v.clone()
        f = root
        for i, t in enumerate(path):
            f = run((L.tok_proj_draft[t] + f @ L.w_feat_t)[None], n + i, kk, vv)[0]
        return f

    depth = min(p.depth, budget)
    nodes = []  # (token index, parent, score, path)
    s, i = log_q(root).topk(p.top_k)
    frontier = []
    for sc, t in zip(s.tolist(), i.tolist()):
        nodes.append((t, -1, sc, [t]))
        frontier.append(len(nodes) - 1)
    for _ in range(2, depth + 1):
        level = []
        for f in frontier:
            t, _, sc, path = nodes[f]
            cs, ci = log_q(feature_of(path)).topk(p.top_k)
            for s2, t2 in zip(cs.tolist(), ci.tolist()):
                nodes.append((t2, f, sc + s2, path + [t2]))
                level.append(len(nodes) - 1)
        frontier = sorted(level, key=lambda j: -nodes[j][2])[:p.top_k]
    keep = min(p.total_tokens - 1, budget, len(nodes))
    order = sorted(range(len(nodes)), key=lambda j: (-nodes[j][2], len(nodes[j][3])))[:keep]
    sel = sorted(order)
    new = {j: a for a, j in enumerate(sel)}
    tokens = [int(drafter.draft_vocab[nodes[j][0]]) for j in sel]
    parents = [-1 if nodes[j][1] < 0 else new[nodes[j][1]] for j in sel]
    return tokens, parents


def as_lists(draft):
    parents = (draft.parents.tolist() if draft.parents is not None
               else list(range(-1, len(draft) - 1)))
    return draft.tokens.tolist(), parents


@pytest.mark.parametrize("params", [Eagle.Params(), Eagle.Params(depth=3, top_k=3, total_tokens=9),
                                    Eagle.Params(depth=5, top_k=2, total_tokens=30),
                                    Eagle.Params(depth=1, top_k=5, total_tokens=4)])
def test_the_dynamic_tree_is_eagle2s(env, params):
    ctx = prefilled([3, 9, 27, 17, 51, 25, 11, 33, 35, 41])
    drafter = Eagle(params, env)
    draft = drafter.propose(ctx, 64)
    tokens, parents = as_lists(draft)
    assert (tokens, parents) == reference_tree(drafter, ctx)
    assert len(tokens) == min(params.total_tokens - 1,
                              params.top_k + (params.depth - 1) * params.top_k ** 2)
    depth = draft.depths()
    assert max(depth) <= params.depth
    assert all(pa < i for i, pa in enumerate(parents))  # parents before children
    assert sum(d == 1 for d in depth) <= params.top_k
    assert all(parents.count(i) <= params.top_k for i in range(len(parents)))
    assert all(0 <= t < TINY.vocab_size for t in tokens)
    assert set(tokens) <= set(drafter.draft_vocab.tolist())
    assert draft.probs is None  # the sibling rule verifies it, lossless under sampling
    assert draft.cost == pytest.approx(params.depth * drafter.loaded.cost_per_forward)


def test_the_budget_bounds_nodes_and_depth(env):
    ctx = prefilled([1, 2, 3, 4, 5, 6])
    drafter = Eagle(Eagle.Params(depth=6, top_k=4, total_tokens=40), env)
    for budget in (1, 2, 3, 7):
        draft = drafter.propose(ctx, budget)
        assert 1 <= len(draft) <= budget
        assert max(draft.depths()) <= budget
        assert as_lists(draft) == reference_tree(drafter, ctx, budget)


def test_the_draft_cache_follows_what_verification_commits(env):
    """Incremental drafting (rows appended from last_hidden, scratch rows rolled back) gives
    the same draft as drafting from scratch at every step, whatever was accepted."""
    params = Eagle.Params(depth=4, top_k=3, total_tokens=14)
    ctx = prefilled([7, 1, 30, 22, 5, 5, 61, 40])
    drafter = Eagle(params, env)
    gen = torch.Generator().manual_seed(0)
    for step in range(12):
        draft = drafter.propose(ctx, 64)
        assert as_lists(draft) == as_lists(from_scratch(ctx, env, params))
        tokens, parents = as_lists(draft)
        path: list[int] = []  # accept a random root-to-node path of the tree (0..depth long)
        want = int(torch.randint(0, 5, (1,), generator=gen))
        node = -1
        while len(path) < want:
            kids = [i for i, pa in enumerate(parents) if pa == node]
            if not kids:
                break
            node = kids[int(torch.randint(0, len(kids), (1,), generator=gen))]
            path.append(tokens[node])
        commit(ctx, path, int(torch.randint(0, TINY.vocab_size, (1,), generator=gen)))
        drafter.observe(ctx, path)


def test_a_missed_step_is_recomputed(env):
    params = Eagle.Params()
    ctx = prefilled([4, 8, 15, 16, 23, 42])
    drafter = Eagle(params, env)
    drafter.propose(ctx, 64)
    commit(ctx, [], 9)  # a step the drafter never hears of
    commit(ctx, [3, 5], 7)
    assert as_lists(drafter.propose(ctx, 64)) == as_lists(from_scratch(ctx, env, params))


def test_training_and_drafting_compute_the_same_features(env):
    """``unroll`` (training, evaluation) and the drafter's cache + tree mask agree: a top-1
    chain drafted at run time is the argmax of the unrolled steps fed that chain."""
    params = Eagle.Params(depth=4, top_k=1, total_tokens=5)
    ctx = prefilled([2, 4, 6, 8, 10, 12, 14])
    drafter = Eagle(params, env)
    chain = drafter.propose(ctx, 64).tokens.tolist()
    n = ctx.n_cached
    text = torch.tensor([ctx.tokens + chain[:-1]])
    hidden: list[torch.Tensor] = []
    MODEL(torch.tensor([ctx.tokens[:n]]), hidden=hidden)
    feats = torch.zeros(1, text.shape[1] - 1, TINY.dim, dtype=torch.float64)
    feats[0, :n] = features(MODEL, hidden[-1][0])
    outs = unroll(drafter.loaded.head, MODEL, text[:, 1:], feats, params.depth)
    w = drafter.loaded.w_draft_t
    got = [int(drafter.draft_vocab[(outs[j][0, n - 1 + j] @ w).argmax()]) for j in range(4)]
    assert got == chain


def test_fused_features_are_the_caches_value_rows_as_training_computes_them(fused_env):
    """A fused head reads the target's value rows from its KV cache at run time and from
    ``values`` in training: the same rows, and a top-1 chain drafted at run time is the
    argmax of the unrolled steps fed them (the fused term at committed rows only)."""
    params = Eagle.Params(depth=4, top_k=1, total_tokens=5)
    ctx = prefilled([2, 4, 6, 8, 10, 12, 14])
    drafter = Eagle(params, fused_env)
    assert drafter.loaded.fused == (1, 3)
    chain = drafter.propose(ctx, 64).tokens.tolist()
    n = ctx.n_cached
    hidden: list[torch.Tensor] = []
    MODEL(torch.tensor([ctx.tokens[:n]]), hidden=hidden)
    vals = values(MODEL, hidden[1:], (1, 3))[0]  # Micro's hidden starts at the embedding
    torch.testing.assert_close(cached_values(ctx.cache, 0, (1, 3), 0, n), vals)
    assert drafter.loaded.fuse_term(ctx, 0, n).abs().sum() > 0
    text = torch.tensor([ctx.tokens + chain[:-1]])
    feats = torch.zeros(1, text.shape[1] - 1, TINY.dim, dtype=torch.float64)
    feats[0, :n] = features(MODEL, hidden[-1][0])
    fused = torch.zeros(1, text.shape[1] - 1, 2 * TINY.dim, dtype=torch.float64)
    fused[0, :n] = vals
    outs = unroll(drafter.loaded.head, MODEL, text[:, 1:], feats, params.depth, vals=fused)
    w = drafter.loaded.w_draft_t
    got = [int(drafter.draft_vocab[(outs[j][0, n - 1 + j] @ w).argmax()]) for j in range(4)]
    assert got == chain
    unfused = unroll(drafter.loaded.head, MODEL, text[:, 1:], feats, 1)[0][0, n - 1]
    assert not torch.allclose(unfused, outs[0][0, n - 1])  # the fused term counts


def test_a_head_given_fused_features_drafts_as_before_until_trained(env, tmp_path):
    _, state = load_head_state(env.checkpoint_dir, "tiny")
    plain = EagleHead.from_state(TINY, state)
    fused = plain.with_fused((1, 2, 3))
    assert fused.fused == (1, 2, 3) and not fused.fuse.weight.any()
    save_head(fused, "tiny", tmp_path, {})
    ctx_a, ctx_b = prefilled([3, 1, 4, 1, 5, 9, 2, 6]), prefilled([3, 1, 4, 1, 5, 9, 2, 6])
    params = Eagle.Params(depth=3, top_k=2, total_tokens=6)
    a = Eagle(params, env).propose(ctx_a, 64)
    b = Eagle(params, DrafterEnv("tiny", MODEL, {}, checkpoint_dir=tmp_path)).propose(ctx_b, 64)
    assert as_lists(a) == as_lists(b)
    with pytest.raises(ValueError, match="fuses layers"):
        fused.with_fused((1,))
    with pytest.raises(ValueError, match="distinct"):
        plain.with_fused((0, 1))


def test_a_fused_head_is_lossless(fused_env):
    prompt = [9, 3, 9, 3, 17, 2, 40]
    want, _, _ = generate(MODEL, prompt, 24)
    for params in (Eagle.Params(), TREE):
        got, seq, _ = generate(MODEL, prompt, 24, drafter=Eagle(params, fused_env))
        assert got == want and seq.stats.drafter_errors == 0


def test_missing_weights_say_how_to_train_them(tmp_path):
    with pytest.raises(SpeculationError, match="nodraft train eagle --model nowhere"):
        REGISTRY.build("eagle", Eagle.Params(), DrafterEnv("nowhere", MODEL, {},
                                                           checkpoint_dir=tmp_path))


def test_parameters_are_checked():
    for bad in ({"depth": 0}, {"top_k": 0}, {"total_tokens": 1}, {"total_tokens": 66}):
        with pytest.raises(SpeculationError):
            REGISTRY.parse({"method": "eagle", **bad})


def test_the_head_loads_once_per_model(env):
    first = Eagle(Eagle.Params(), env)
    assert Eagle(Eagle.Params(depth=2), env).loaded is first.loaded


def test_the_head_is_made_of_plain_tensors_whatever_the_callers_mode(env):
    """The compiled draft step closes over the head's tensors, and a saved graph's guards
    compare their dispatch keys: a head loaded in a request (inference mode) must match
    one loaded by an artifact build (outside it)."""
    from nodraft.drafters.eagle import load_for

    for mode in (True, False):
        fresh = DrafterEnv("tiny", MODEL, {}, checkpoint_dir=env.checkpoint_dir)
        with torch.inference_mode(mode):
            loaded = load_for(fresh)
        tensors = [loaded.tok_proj, loaded.tok_proj_draft, loaded.w_feat_t, loaded.w_draft_t,
                   *loaded.head.parameters(), *loaded.head.buffers()]
        assert not any(t.is_inference() for t in tensors)


def test_a_one_token_prompt_and_greedy_equivalence(env):
    want, _, _ = generate(MODEL, [5], 12)
    drafter = Eagle(Eagle.Params(), env)
    got, seq, steps = generate(MODEL, [5], 12, drafter=drafter)
    assert got == want and len(steps[0].draft) == 0 and seq.stats.drafter_errors == 0


def test_quick_training_yields_loadable_weights(checkpoint_dir, tmp_path):
    from nodraft.drafters.eagle.train import main
    from nodraft.micro.checkpoint import load_model, load_tokenizer
    from nodraft.micro.data import token_stream

    main(["--model", "micro", "--steps", "3", "--batch-size", "2", "--seq-len", "64",
          "--ttt-steps", "2", "--eval-windows", "4", "--eval-depth", "3", "--timing-repeats", "3",
          "--checkpoints", str(checkpoint_dir), "--save-to", str(tmp_path), "--out", str(tmp_path),
          "--threads", "1"])
    record = json.loads((tmp_path / "micro-eagle.json").read_text())
    assert record["steps"] == 3 and len(record["heldout"]["top1_by_position"]) == 3
    assert record["fuse_layers"] == []  # fused features only when asked
    assert record["precision"] == ("bf16" if bf16_native() else "fp32")
    assert record["draft_step"]["vocab_1024_us"] > 0 and record["draft_step"]["vocab_4096_us"] > 0
    model = load_model("micro", checkpoint_dir)
    _, state = load_head_state(tmp_path, "micro")
    assert state["draft_vocab"].numel() == 1024
    tok = load_tokenizer()
    acc = evaluate_head(model, state, token_stream(tok, "heldout"), depth=2, windows=2,
                        seq_len=32)
    assert len(acc["top1_by_position"]) == 2
    prompt = tok.encode("def fibonacci(n):\n    ")
    want, _, _ = generate(model, prompt, 16, dtype=torch.float32)
    drafter = Eagle(Eagle.Params(), DrafterEnv("micro", model, {}, checkpoint_dir=tmp_path))
    got, seq, _ = generate(model, prompt, 16, drafter=drafter, dtype=torch.float32)
    assert got == want and seq.stats.drafter_errors == 0


@pytest.fixture(scope="module")
def compiled_env(env) -> DrafterEnv:
    """The same model and head, with compiled passes (lazy): EAGLE drafts through its
    compiled draft step (``drafters.eagle.compiled.CompiledDraft``)."""
    return DrafterEnv("tiny", copy.deepcopy(MODEL).compile(), {}, checkpoint_dir=env.checkpoint_dir)


# the default chain, and a tree (each shape compiles graphs of its own: seconds to a minute)
TREE = Eagle.Params(depth=4, top_k=2, total_tokens=6)


@pytest.mark.parametrize("params", [Eagle.Params(), TREE], ids=["chain", "tree"])
def test_the_compiled_draft_step_is_the_eager_one(env, compiled_env, params):
    """Step after step -- catch-ups of one row and of several, trees and chains -- the
    compiled draft step proposes the eager drafter's tree, and keeps the same draft cache."""
    prompt = [7, 1, 30, 22, 5, 5, 61, 40, 9]
    eager, compiled = Eagle(params, env), Eagle(params, compiled_env)
    ctx_e, ctx_c = prefilled(prompt), prefilled(prompt)
    ctx_c.model = compiled_env.model
    gen = torch.Generator().manual_seed(1)
    for step in range(8):
        de, dc = eager.propose(ctx_e, 64), compiled.propose(ctx_c, 64)
        assert as_lists(dc) == as_lists(de), step
        assert dc.cost == de.cost
        st_e, st_c = ctx_e.state["eagle"], ctx_c.state["eagle"]
        assert st_c.rows == st_e.rows
        torch.testing.assert_close(st_c.k[:, :st_c.rows], st_e.k[:, :st_e.rows])
        tokens, parents = as_lists(de)
        kids = [i for i, pa in enumerate(parents) if pa == 0]  # node 0's children
        accepted = [] if step % 2 == 0 else [tokens[0]] + [tokens[i] for i in kids[:1]]
        bonus = int(torch.randint(0, TINY.vocab_size, (1,), generator=gen))
        for ctx, drafter in ((ctx_e, eager), (ctx_c, compiled)):
            commit(ctx, accepted, bonus)
            drafter.observe(ctx, accepted)
    cd = compiled._compiled_draft(compiled_env.model)
    assert {(s[3]) for s in cd._ready} == {False, True}  # both catch-up graphs ran


def test_a_fused_heads_compiled_draft_step_is_the_eager_one(fused_env):
    """The fused term enters the compiled catch-up (one row and several) as the eager one."""
    compiled_env = DrafterEnv("tiny", copy.deepcopy(MODEL).compile(), {},
                              checkpoint_dir=fused_env.checkpoint_dir)
    prompt = [7, 1, 30, 22, 5, 5, 61, 40, 9]
    params = Eagle.Params(depth=2, total_tokens=3)
    eager, compiled = Eagle(params, fused_env), Eagle(params, compiled_env)
    ctx_e, ctx_c = prefilled(prompt), prefilled(prompt)
    ctx_c.model = compiled_env.model
    for step in range(5):
        de, dc = eager.propose(ctx_e, 64), compiled.propose(ctx_c, 64)
        assert as_lists(dc) == as_lists(de), step
        st_e, st_c = ctx_e.state["eagle"], ctx_c.state["eagle"]
        torch.testing.assert_close(st_c.k[:, :st_c.rows], st_e.k[:, :st_e.rows])
        accepted = [] if step % 2 == 0 else as_lists(de)[0][:2]
        for ctx, drafter in ((ctx_e, eager), (ctx_c, compiled)):
            commit(ctx, accepted, 11 + step)
            drafter.observe(ctx, accepted)
    cd = compiled._compiled_draft(compiled_env.model)
    assert {(s[3]) for s in cd._ready} == {False, True}


def test_unseeded_sampling_draws_the_chain_from_q_compiled_as_eager(env, compiled_env):
    """Unseeded sampling: each level's token is drawn from the head's q at the request's
    temperature (Gumbel-max over noise from the request's generator), and q travels with
    the draft for the rejection rule; the compiled draft step draws what the eager one
    draws from the same noise, with the same q. Seeded, the chain stays the argmax."""
    params = Eagle.Params()
    prompt = [7, 1, 30, 22, 5, 5, 61, 40, 9]
    eager, compiled = Eagle(params, env), Eagle(params, compiled_env)
    ctx_e, ctx_c = prefilled(prompt), prefilled(prompt)
    ctx_c.model = compiled_env.model
    for ctx in (ctx_e, ctx_c):
        ctx.temperature, ctx.generator = 0.8, torch.Generator().manual_seed(5)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        de, dc = eager.propose(ctx_e, 64), compiled.propose(ctx_c, 64)
        assert as_lists(dc) == as_lists(de), step
        assert de.probs is not None and de.probs.shape == (len(de), TINY.vocab_size)
        torch.testing.assert_close(dc.probs, de.probs)
        torch.testing.assert_close(de.probs.sum(-1), torch.ones(len(de), dtype=de.probs.dtype))
        assert bool((de.probs[torch.arange(len(de)), de.tokens] > 0).all())
        accepted = [] if step % 2 == 0 else de.tokens[:2].tolist()
        bonus = int(torch.randint(0, TINY.vocab_size, (1,), generator=gen))
        for ctx, drafter in ((ctx_e, eager), (ctx_c, compiled)):
            commit(ctx, accepted, bonus)
            drafter.observe(ctx, accepted)
    seeded = prefilled(prompt)
    seeded.temperature, seeded.draw = 0.8, lambda logits, t: int(logits.argmax())
    assert Eagle(params, env).propose(seeded, 64).probs is None


def test_the_sampled_chains_first_token_follows_q(env):
    """The first draft token, drawn afresh from one context 400 times, is distributed as
    the q the draft reports (chi-square)."""
    params = Eagle.Params(depth=1, total_tokens=2)
    prompt = [7, 1, 30, 22, 5, 5, 61, 40, 9]
    counts, q = torch.zeros(TINY.vocab_size), None
    for i in range(400):
        ctx = prefilled(prompt)
        ctx.temperature, ctx.generator = 1.0, torch.Generator().manual_seed(i)
        draft = Eagle(params, env).propose(ctx, 64)
        counts[int(draft.tokens[0])] += 1
        q = draft.probs[0] if q is None else q
        torch.testing.assert_close(draft.probs[0], q)
    expected = q.double() * 400
    keep = expected >= 5  # pool the rare tokens
    obs = torch.cat([counts.double()[keep], counts.double()[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    assert int(keep.sum()) >= 2
    assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-3


def test_the_compiled_draft_keeps_its_first_nodes_near_the_end(env, compiled_env):
    params = TREE  # its graphs, compiled above
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    drafts = []
    for budget in (64, 3, 1):
        ctx = prefilled(prompt)
        ctx.model = compiled_env.model
        drafter = Eagle(params, compiled_env)
        drafter.propose(ctx, 64)  # the prompt's catch-up (eager: no committed rows yet)
        commit(ctx, [], 11)
        drafts.append(as_lists(drafter.propose(ctx, budget)))
    whole = drafts[0]
    for (tokens, parents), budget in zip(drafts[1:], (3, 1)):
        assert (tokens, parents) == (whole[0][:budget], whole[1][:budget])


def test_the_server_warm_up_compiles_the_default_draft_step(env):
    """``Engine.warm_up`` compiles EAGLE's default draft step after the target's graphs;
    until then (not lazy) the drafter drafts eager."""
    from nodraft.drafters.eagle.compiled import _COMPILED_DRAFTS
    from nodraft.drafters.registry import Registry
    from nodraft.engine.core import Engine

    model = copy.deepcopy(MODEL).compile(lazy=False)
    model.compiled.warm_up = lambda cache, slot, early_exit=True: 0.0  # the target's: elsewhere
    engine = Engine({"tiny": model}, Registry(), eot_id=None, max_running=1)
    engine.checkpoint_dir = env.checkpoint_dir
    threads = torch.get_num_threads()
    ctx = prefilled([7, 1, 30, 22, 5, 5, 61, 40, 9])
    ctx.model = model
    drafter = Eagle(Eagle.Params(), DrafterEnv("tiny", model, {}, checkpoint_dir=env.checkpoint_dir))
    drafter.propose(ctx, 64)
    commit(ctx, [], 3)
    drafter.propose(ctx, 64)  # before the warm-up: eager, nothing compiled
    assert model.compiled not in _COMPILED_DRAFTS or not drafter._compiled_draft(model)._ready
    try:
        engine.warm_up().join()
        assert engine.compiled_ready
        cd = _COMPILED_DRAFTS[model.compiled][env.checkpoint_dir / "tiny-eagle.safetensors"]
        p = Eagle.Params()
        assert {s[:4] for s in cd._ready} == {(p.depth, p.top_k, p.total_tokens - 1, False),
                                             (p.depth, p.top_k, p.total_tokens - 1, True)}
        # and a request's drafts run those graphs without compiling again (inputs made in
        # inference mode, as the warm-up's are)
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        torch.set_num_threads(1)  # as the engine steps a lone sequence (and compiles)
        fresh = Eagle(Eagle.Params(), DrafterEnv("tiny", model, {},
                                                 checkpoint_dir=env.checkpoint_dir))
        ctx2 = prefilled([7, 1, 30, 22, 5, 5, 61, 40, 9, 12, 4])
        ctx2.model = model
        for _ in range(3):
            d = fresh.propose(ctx2, 64)
            commit(ctx2, [], 3)
        assert len(d) and counters["stats"]["unique_graphs"] == graphs
    finally:
        torch.set_num_threads(threads)
        engine.stop()


def test_greedy_continue_is_the_targets_greedy_decoding():
    prompts = torch.tensor([[3, 9, 27, 17, 51], [1, 2, 3, 4, 5]])
    out = greedy_continue(MODEL, prompts, 12)
    assert out.shape == (2, 17) and (out[:, :5] == prompts).all()
    for b in range(2):
        assert out[b, 5:].tolist() == generate(MODEL, prompts[b].tolist(), 12)[0]


def test_self_distillation_goes_on_from_a_trained_head(checkpoint_dir, tmp_path):
    from nodraft.drafters.eagle.train import main

    common = ["--model", "micro", "--batch-size", "2", "--seq-len", "64", "--eval-windows", "4",
              "--eval-depth", "2", "--timing-repeats", "2", "--checkpoints", str(checkpoint_dir),
              "--threads", "1"]
    first, second = tmp_path / "first", tmp_path / "second"
    main(common + ["--steps", "2", "--save-to", str(first), "--out", str(first)])
    main(common + ["--steps", "3", "--init", "micro", "--init-from", str(first),
                   "--self-distill", "0.5", "--distill-rows", "3", "--fuse-layers", "auto",
                   "--save-to", str(second), "--out", str(second)])
    record = json.loads((second / "micro-eagle.json").read_text())
    assert record["steps"] == 3 and record["init"]["steps"] == 2
    # auto: micro's every layer but the first (its value rows read the embedding)
    assert record["fuse_layers"] == [1, 2, 3] and record["init"]["fuse_layers"] == []
    assert record["self_distill"] == 0.5 and record["distill_rows"] == 3
    assert len(record["heldout_greedy"]["top1_by_position"]) == 2
    _, before = load_head_state(first, "micro")
    _, after = load_head_state(second, "micro")
    assert torch.equal(before["draft_vocab"], after["draft_vocab"])  # its vocabulary kept
    assert not torch.equal(before["fc.weight"], after["fc.weight"])  # and trained on
    assert "fuse.weight" not in before and after["fuse.weight"].any()  # fused, trained from 0
    log = (second / "micro-eagle.log").read_text()
    assert "self-distillation rows: 3/3" in log
    with pytest.raises(SystemExit):
        main(common + ["--self-distill", "1.5"])
