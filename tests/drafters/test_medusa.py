"""Medusa: the tree builder, the heads' drafts, their files, evaluation and training."""

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file

from nodraft.drafters.base import DraftContext
from nodraft.drafters.medusa import (Medusa, MedusaHeads, build_tree, head_cost, rank_accuracies,
                                     save_heads, weights_path, write_untrained)
from nodraft.drafters.medusa_train import evaluate_heads
from nodraft.drafters.registry import DrafterEnv, SpeculationError
from nodraft.micro.checkpoint import save_model
from nodraft.micro.model import KVCache, Micro, MicroConfig
from tests.conftest import TINY, tiny_model
from tests.engine.helpers import REGISTRY, generate, drafter_env


# -- the tree ---------------------------------------------------------------------------------
ACC = ((0.5, 0.2, 0.1), (0.4, 0.25, 0.05), (0.3, 0.1, 0.02))  # rank accuracies, 3 heads


def value(path, acc=ACC):
    v = 1.0
    for d, r in enumerate(path):
        v *= acc[d][r]
    return v


def test_rank_accuracies_are_the_differences_of_the_cumulative_top_k():
    got = rank_accuracies([[0.5, 0.7, 0.8], [0.3, 0.3, 0.4]])
    assert [pytest.approx(row) for row in got] == [[0.5, 0.2, 0.1], [0.3, 0.0, 0.1]]


def test_greedy_expansion_picks_nodes_by_the_product_of_accuracies():
    tree = build_tree(ACC, 6)
    # (0,) 0.5; then (0,0) = 0.5*0.4 and (1,) = 0.2 tie, the smaller path first; (0,1) 0.125,
    # (2,) 0.1, (1,0) 0.08 -- ahead of (0,0,0) 0.06 and (1,1) 0.05
    assert tree.paths == ((0,), (0, 0), (1,), (0, 1), (2,), (1, 0))
    assert tree.parents.tolist() == [-1, 0, -1, 0, -1, 2]
    assert tree.depth.tolist() == [1, 2, 1, 2, 1, 2]
    assert tree.rank.tolist() == [0, 0, 1, 1, 2, 0]
    assert tree.value == pytest.approx([value(p) for p in tree.paths])
    assert tree.expected_accepted() == pytest.approx(sum(value(p) for p in tree.paths))


def test_the_greedy_tree_is_the_best_tree_of_its_size():
    acc = ((0.45, 0.3, 0.15), (0.5, 0.2, 0.1))
    nodes = [(r,) for r in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    for size in range(1, 8):
        best = max(sum(value(p, acc) for p in subset)
                   for subset in itertools.combinations(nodes, size)
                   if all(len(p) == 1 or p[:-1] in subset for p in subset))
        assert build_tree(acc, size).expected_accepted() == pytest.approx(best)


@pytest.mark.parametrize("budget", [1, 2, 5, 13, 39, 64])
def test_budget_respected_parents_first_and_prefixes_are_smaller_trees(budget):
    tree = build_tree(ACC, budget)
    assert len(tree) == min(budget, 3 + 9 + 27)
    parents = tree.parents.tolist()
    assert all(p < i for i, p in enumerate(parents))
    for i, p in enumerate(parents):  # a child's path extends its parent's by one rank
        assert tree.paths[i][:-1] == (tree.paths[p] if p >= 0 else ())
    assert tree.value == tuple(sorted(tree.value, reverse=True))
    full = build_tree(ACC, 64)
    assert tree.paths == full.paths[:len(tree)]
    assert len(set(tree.paths)) == len(tree)


def test_ranks_that_are_never_right_are_not_drafted():
    tree = build_tree(((0.6, 0.0), (0.0, 0.0)), 10)
    assert tree.paths == ((0,),)


# -- the drafter ------------------------------------------------------------------------------
def tiny_env(tmp_path, model=None, name="tiny"):
    model = model or tiny_model()
    write_untrained(model, name, tmp_path)
    return DrafterEnv(name, model, {}, checkpoint_dir=tmp_path)


def test_missing_weights_are_a_speculation_error_saying_how_to_train(tmp_path):
    env = DrafterEnv("micro-nothing", tiny_model(), {}, checkpoint_dir=tmp_path)
    method, params = REGISTRY.parse("medusa")
    with pytest.raises(SpeculationError, match="nodraft train medusa --model micro-nothing"):
        REGISTRY.build(method, params, env)


def test_bad_parameters_are_speculation_errors(tmp_path):
    for bad in ({"num_heads": 0}, {"total_tokens": 65}, {"top_k": 0}):
        with pytest.raises(SpeculationError):
            REGISTRY.parse({"method": "medusa", **bad})
    env = tiny_env(tmp_path)  # 4 untrained heads
    with pytest.raises(SpeculationError, match="4 trained Medusa heads") as e:
        Medusa(Medusa.Params(num_heads=5), env)
    assert e.value.param == "speculation.num_heads"


def test_weights_load_once_per_model_in_the_target_dtype(tmp_path):
    env = tiny_env(tmp_path)
    a, b = Medusa(Medusa.Params(), env), Medusa(Medusa.Params(total_tokens=3), env)
    assert a.heads is b.heads and a.heads.weight.dtype == torch.float64
    assert a.heads.weight.abs().sum() > 0


def test_the_draft_reads_each_node_off_its_heads_top_k(tmp_path):
    env = tiny_env(tmp_path)
    model = env.model
    drafter = Medusa(Medusa.Params(total_tokens=12, top_k=3), env)
    h = torch.randn(3, TINY.dim, dtype=torch.float64)
    ctx = DraftContext([1, 2, 3], 3, model, KVCache(TINY), 0, last_hidden=h)
    draft = drafter.propose(ctx, 12)
    tree = drafter.tree
    top = [model.head(drafter.heads.block(h[-1], i)).topk(3).indices for i in range(4)]
    assert draft.tokens.tolist() == [int(top[d - 1][r]) for d, r in
                                     zip(tree.depth.tolist(), tree.rank.tolist())]
    assert draft.parents.tolist() == tree.parents.tolist() and draft.probs is None
    depth = int(tree.depth.max())
    assert draft.cost == pytest.approx(depth * head_cost(TINY))
    # a smaller step budget: a prefix of the tree, and only the heads it reaches run
    small = drafter.propose(ctx, 2)
    assert small.tokens.tolist() == draft.tokens.tolist()[:2]
    assert small.cost == pytest.approx(max(tree.depth[:2].tolist()) * head_cost(TINY))


def test_a_draft_vocabulary_drafts_its_ids_only_ranked_as_the_head_ranks_them(tmp_path):
    from nodraft.drafters import draft_vocab
    env = tiny_env(tmp_path)
    model, n = env.model, 8
    h = torch.randn(3, TINY.dim, dtype=torch.float64)
    ctx = DraftContext([1, 2, 3], 3, model, KVCache(TINY), 0, last_hidden=h)
    with pytest.raises(SpeculationError, match="nodraft train draft-vocab"):  # not ranked yet
        Medusa.check(Medusa.Params(top_k=2, draft_vocab=n), env)
    draft_vocab.write_untrained(model, env.model_name, tmp_path)
    Medusa.check(Medusa.Params(top_k=2, draft_vocab=n), env)
    drafter = Medusa(Medusa.Params(num_heads=2, total_tokens=5, top_k=2, draft_vocab=n), env)
    ids, _ = draft_vocab.head_rows(env, n)
    draft = drafter.propose(ctx, 5)
    tree = drafter.tree
    # each node: the rank-r token of its head's logits over the subset's ids
    top = [ids[model.head(drafter.heads.block(h[-1], i))[ids].topk(2).indices] for i in range(2)]
    assert draft.tokens.tolist() == [int(top[d - 1][r]) for d, r in
                                     zip(tree.depth.tolist(), tree.rank.tolist())]
    assert set(draft.tokens.tolist()) <= set(ids.tolist())
    assert draft.cost == pytest.approx(int(tree.depth.max()) * head_cost(TINY, n))
    assert head_cost(TINY, n) < head_cost(TINY)
    # the whole vocabulary, or more ids than it has, is the full head; more ranks than ids
    # are refused
    assert Medusa(Medusa.Params(draft_vocab=TINY.vocab_size), env).ids is None
    assert Medusa(Medusa.Params(draft_vocab=TINY.vocab_size + 1), env).ids is None
    assert Medusa(Medusa.Params(draft_vocab=0), env).ids is None
    with pytest.raises(ValueError, match="more than draft_vocab"):
        Medusa(Medusa.Params(num_heads=1, total_tokens=4, top_k=4, draft_vocab=2), env)
    with pytest.raises(SpeculationError):
        REGISTRY.parse({"method": "medusa", "draft_vocab": -1})


def test_no_hidden_state_yet_no_draft(tmp_path):
    env = tiny_env(tmp_path)
    ctx = DraftContext([7], 1, env.model, KVCache(TINY), 0, last_hidden=None)
    assert len(Medusa(Medusa.Params(), env).propose(ctx, 8)) == 0


def test_micro_sized_cost_model():
    assert head_cost(MicroConfig()) == pytest.approx(680_960 / 1_802_240)


def test_trees_are_drafted_and_accepted_on_a_tiny_model():
    model = tiny_model()
    prompt = [5, 6, 7, 8] * 6
    out, seq, steps = generate(model, prompt, 24, "medusa", {"total_tokens": 16})
    assert out == generate(model, prompt, 24)[0]
    assert seq.stats.drafted > 0 and seq.stats.drafter_errors == 0
    assert any(len(s.draft) > 1 for s in steps)


# -- evaluation -------------------------------------------------------------------------------
def test_evaluate_heads_counts_top_k_hits_against_tokens_two_plus_i_ahead():
    model = tiny_model()
    heads = MedusaHeads(2, TINY.dim).double()
    with torch.no_grad():
        heads.weight.normal_(0, 0.3)
    stream = torch.randint(0, TINY.vocab_size, (2 * 16 + 1,),
                           generator=torch.Generator().manual_seed(0)).numpy()
    got = evaluate_heads(model, heads, stream, top_k=3, T=16, max_tokens=32, batch=1)
    x = torch.as_tensor(stream, dtype=torch.long)
    hits = torch.zeros(2, 3)
    counts = torch.zeros(2)
    for w in range(2):
        row = x[w * 16:(w + 1) * 16 + 1]
        h = model.run_layers(model.embed(row[None]), torch.arange(17)[None], 0, 4)[0]
        for i in range(2):
            for j in range(17 - 2 - i):
                top = model.head(heads.block(h[j], i)).topk(3).indices.tolist()
                counts[i] += 1
                for k in range(3):
                    hits[i, k] += row[j + 2 + i].item() in top[:k + 1]
    want = (hits / counts[:, None]).tolist()
    assert [pytest.approx(row, abs=1e-4) for row in got["accuracy"]] == want
    assert got["top1"] == [r[0] for r in got["accuracy"]] and got["tokens"] == 32


# -- training ---------------------------------------------------------------------------------
def test_a_quick_training_run_writes_loadable_heads(tmp_path):
    from nodraft.drafters.medusa_train import main

    torch.manual_seed(0)
    config = MicroConfig(vocab_size=4096, dim=16, n_layers=1, n_heads=2, ffn_dim=32,
                         max_positions=128)
    save_model(Micro(config).eval(), "mini", {"name": "mini"}, tmp_path)
    main(["--model", "mini", "--checkpoints", str(tmp_path), "--out", str(tmp_path),
          "--steps", "3", "--heads", "3", "--batch-size", "2", "--seq-len", "64",
          "--top-k", "4", "--heldout-tokens", "256", "--threads", "1", "--log-every", "1",
          "--val-tokens", "64"])
    path = weights_path(tmp_path, "mini")
    record = json.loads(path.with_suffix(".json").read_text())
    assert record["steps"] == 3 and record["num_heads"] == 3 and record["tokens"] == 3 * 2 * 64
    assert record["command"].startswith("nodraft train medusa --model mini")
    acc = record["heldout"]["accuracy"]
    assert len(acc) == 3 and all(len(r) == 4 and r == sorted(r) for r in acc)
    assert (tmp_path / "mini-medusa.log").exists()
    # the ranking the heads' default draft vocabulary reads was written beside them
    vocab = json.loads((tmp_path / "mini-draft-vocab.json").read_text())
    assert vocab["command"].startswith("nodraft train medusa --model mini") and vocab["train_tokens"] > 0
    model = Micro(config).eval().requires_grad_(False)
    env = DrafterEnv("mini", model, {}, checkpoint_dir=tmp_path)
    drafter = Medusa(Medusa.Params(num_heads=3), env)
    assert drafter.heads.weight.abs().sum() > 0  # training moved the zero-initialised blocks
    ctx = DraftContext([1, 2], 2, model, KVCache(config), 0,
                       last_hidden=torch.randn(1, config.dim))
    draft = drafter.propose(ctx, 8)  # an untrained target: maybe no rank ever right, no tree
    assert len(draft) == min(8, len(drafter.tree))


def test_self_distillation_goes_on_from_trained_heads(tmp_path):
    from nodraft.drafters.medusa_train import main

    torch.manual_seed(0)
    config = MicroConfig(vocab_size=4096, dim=16, n_layers=1, n_heads=2, ffn_dim=32,
                         max_positions=256)
    save_model(Micro(config).eval(), "mini", {"name": "mini"}, tmp_path)
    common = ["--model", "mini", "--checkpoints", str(tmp_path), "--out", str(tmp_path),
              "--steps", "2", "--heads", "2", "--batch-size", "2", "--seq-len", "140",
              "--top-k", "3", "--heldout-tokens", "282", "--threads", "1", "--log-every", "1",
              "--val-tokens", "141", "--eval-windows", "2"]
    main(common)
    first = weights_path(tmp_path, "mini")
    before = load_file(str(first))["weight"].clone()
    main(common + ["--init", "mini", "--self-distill", "0.5", "--distill-rows", "3"])
    record = json.loads(first.with_suffix(".json").read_text())
    assert record["self_distill"] == 0.5 and record["distill_rows"] == 3
    assert record["init"]["steps"] == 2 and record["init"]["self_distill"] == 0.0
    assert not torch.equal(load_file(str(first))["weight"], before)  # trained on from them
    own = record["heldout_greedy"]  # the continuations only: 2 rows of 255 - 62 positions
    assert own["tokens"] == 2 * (255 - 62) and len(own["accuracy"]) == 2
    with pytest.raises(SystemExit):  # another number of heads than the ones it goes on from
        main(common[:-2] + ["--heads", "3", "--init", "mini"])


def test_nodraft_eval_reports_the_heads_on_held_out_text_and_on_greedy_continuations(tmp_path):
    from nodraft.drafters.evaluation import evaluate_drafters
    from nodraft.micro.checkpoint import load_model

    torch.manual_seed(0)
    config = MicroConfig(vocab_size=4096, dim=16, n_layers=1, n_heads=2, ffn_dim=32,
                         max_positions=1024)
    save_model(Micro(config).eval(), "mini", {"name": "mini"}, tmp_path)
    write_untrained(load_model("mini", tmp_path), "mini", tmp_path)
    m = evaluate_drafters(tmp_path, ["mini"], max_tokens=2000)["mini"]["medusa"]
    assert len(m["top1_by_head"]) == 4 and m["tokens"] == 3 * 512
    g = m["on_greedy"]  # 64 held-out prompts continued to 257 tokens, the continuation scored
    assert len(g["top1_by_head"]) == 4 and g["tokens"] == 64 * (256 - 62)
    assert all(0.0 <= a <= 1.0 for a in g["top1_by_head"])


def test_save_and_test_env_use_the_same_file_names(tmp_path):
    heads = MedusaHeads(2, TINY.dim)
    path = save_heads(heads, "x", {"heldout": {"accuracy": [[0.5], [0.2]]}}, tmp_path)
    assert path == tmp_path / "x-medusa.safetensors" and path.with_suffix(".json").exists()
    env = drafter_env(tiny_model())
    assert weights_path(env.checkpoint_dir, env.model_name).exists()
