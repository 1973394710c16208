"""The draft vocabulary (drafters/draft_vocab.py) and early exit over it: the ranking's
rule, the committed rankings, drafts only from the subset, a clear error without one."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from nodraft.drafters.base import DrafterEnv, SpeculationError
from nodraft.drafters.draft_vocab import (check, coverage, draft_vocabulary, head_rows,
                                          weights_path)
from nodraft.drafters.early_exit import EarlyExit
from tests.conftest import tiny_model
from tests.engine.helpers import drafter_env, generate

MODEL = tiny_model()


def test_ids_are_ranked_by_count_ties_by_id():
    stream = np.array([5, 5, 5, 2, 2, 7, 7, 1, 0, 3])
    assert draft_vocabulary(stream, 8, 8).tolist() == [5, 2, 7, 0, 1, 3, 4, 6]
    assert draft_vocabulary(stream, 3, 8).tolist() == [5, 2, 7]
    ranked = draft_vocabulary(stream, 8, 8)
    assert coverage(ranked, stream, sizes=(1, 3, 8)) == {"1": 0.3, "3": 0.7, "8": 1.0}


@pytest.mark.parametrize("name", ["micro", "micro-layerskip"])
def test_the_committed_rankings(checkpoint_dir, name):
    got = load_file(str(weights_path(checkpoint_dir, name)))
    ranked, counts = got["ranked"], got["counts"]
    assert sorted(ranked.tolist()) == list(range(4096))  # every id once
    assert (counts[ranked][:-1] >= counts[ranked][1:]).all()  # most frequent first
    # EAGLE's head was given the first 1024 of the same ranking
    eagle = load_file(str(checkpoint_dir / f"{name}-eagle.safetensors"))["draft_vocab"]
    assert torch.equal(ranked[:1024], eagle)


def test_early_exit_drafts_only_from_its_draft_vocabulary(monkeypatch):
    env = drafter_env(MODEL)
    ids, rows = head_rows(env, 12)
    assert torch.equal(rows, MODEL.tok_embeddings.weight[ids])
    drafted = []
    propose = EarlyExit.propose

    def recording(self, ctx, budget):
        draft = propose(self, ctx, budget)
        drafted.extend(draft.tokens.tolist())
        return draft

    monkeypatch.setattr(EarlyExit, "propose", recording)
    params = {"exit_layer": 1, "num_speculative_tokens": 3, "draft_vocab": 12}
    want, _, _ = generate(MODEL, [1, 2, 3, 4], 30)
    got, seq, _ = generate(MODEL, [1, 2, 3, 4], 30, "early_exit", params)
    assert got == want and seq.stats.drafted > 0
    assert drafted and set(drafted) <= set(ids.tolist())


def test_no_ranking_or_too_few_ids_is_a_clear_error(tmp_path, checkpoint_dir):
    with pytest.raises(SpeculationError, match="nodraft train draft-vocab") as e:
        check(DrafterEnv("micro", None, checkpoint_dir=tmp_path), 256)
    assert e.value.param == "speculation.draft_vocab"
    check(DrafterEnv("micro", None, checkpoint_dir=checkpoint_dir), 4096)
    with pytest.raises(SpeculationError, match="at most the model's vocabulary, 4096"):
        check(DrafterEnv("micro", None, checkpoint_dir=checkpoint_dir), 4097)
