"""Prompt lookup's matching rules, by hand: the docstring's example, first against most
recent occurrence, and how long a draft each match length earns."""

from nodraft.drafters.base import DraftContext
from nodraft.drafters.prompt_lookup import PromptLookup
from nodraft.micro.model import KVCache
from tests.conftest import TINY, tiny_model

MODEL = tiny_model()


def propose(tokens: list[int], budget: int = 64, **params) -> list[int]:
    drafter = PromptLookup(PromptLookup.Params(**params))
    ctx = DraftContext(tokens, len(tokens), MODEL, KVCache(TINY, 1), 0)
    return drafter.propose(ctx, budget).tokens.tolist()


def test_the_docstring_example():
    a, b, c, d = 1, 2, 3, 4
    assert propose([a, b, c, d, a, b]) == [c, d, a, b]


def test_first_and_most_recent_occurrence():
    # the 3-gram [7 8 9] occurs at 0 (followed by 1 2) and at 5 (followed by 3 4)
    tokens = [7, 8, 9, 1, 2, 7, 8, 9, 3, 4, 7, 8, 9]
    assert propose(tokens, match="first", num_speculative_tokens=2) == [1, 2]
    assert propose(tokens, match="recent", num_speculative_tokens=2) == [3, 4]


def test_a_full_length_match_earns_the_whole_budget_a_shorter_one_2_to_the_n():
    passage = list(range(10, 40))
    # the last 3 tokens occur once before: a full-length match, 16 tokens (the default)
    assert propose(passage + passage[:3]) == passage[3:19]
    assert propose(passage + passage[:3], budget=5) == passage[3:8]
    # only the 1-gram [10] matches: at most 2**1 = 2 tokens
    assert propose(passage + [99, 10]) == [11, 12]


def test_no_match_no_draft():
    assert propose(list(range(20))) == []
