"""The EAGLE ceiling benchmark's arithmetic: a depth-d chain's tokens per pass from the
per-position acceptance, divided by its verification pass (and its draft levels)."""

import pytest

from benchmarks import eagle_ceiling


def test_a_chains_ceiling_is_its_tokens_over_its_pass_and_levels():
    p = [0.5, 0.25, 0.1]  # P(at least j of the chain's tokens accepted)
    rows = eagle_ceiling.ceilings(p, lambda r: 1.0 + 0.2 * (r - 1), 0.3)
    assert [r["depth"] for r in rows] == [1, 2, 3]
    assert [r["tokens_per_pass"] for r in rows] == pytest.approx([1.5, 1.75, 1.85])
    assert [r["free_draft"] for r in rows] == pytest.approx([1.5 / 1.2, 1.75 / 1.4, 1.85 / 1.6])
    assert [r["measured_draft"] for r in rows] == pytest.approx(
        [1.5 / 1.5, 1.75 / 2.0, 1.85 / 2.5])


def test_nothing_accepted_is_one_token_a_step_at_best():
    rows = eagle_ceiling.ceilings([0.0] * 4, lambda r: 1.0, 0.0)
    assert all(r["free_draft"] == pytest.approx(1.0) for r in rows)


class _Argmax:
    """A 'model' whose argmax after each position is a fixed list of tokens."""

    def __init__(self, top: list[int], vocab: int = 10):
        self.top, self.vocab = top, vocab

    def __call__(self, ids):
        import torch

        n = ids.shape[1]
        logits = torch.zeros(1, n, self.vocab)
        for i, t in enumerate(self.top[:n]):
            logits[0, i, t] = 1.0
        return logits


def test_the_oracle_keeps_drafts_while_the_sampled_text_is_the_argmax():
    prompt = [0, 0]
    text = [5, 6, 2, 7, 7, 4]
    # the argmax at each position: position 1 (the prompt's last) predicts text[0]; it
    # equals the text but where the text has 2 and 4
    model = _Argmax([9, 5, 6, 1, 7, 7, 3, 0])
    hits, steps = eagle_ceiling.oracle_hits(model, prompt, text, depth=4)
    # step 1 keeps 5, 6 and emits 2; step 2 keeps 7, 7 and emits 4 (the last token)
    assert steps == 2 and hits == [2, 2, 0, 0]
    hits, steps = eagle_ceiling.oracle_hits(model, prompt, text, depth=1)
    # depth 1: 5 kept, 6 emitted; 2 emitted; 7 kept, 7 emitted; 4 emitted
    assert steps == 4 and hits == [2]
