"""Suffix decoding's index drafts exactly what a depth-limited suffix trie over the same
sequences drafts (the structure the paper describes; the trie here is the oracle), for a
request's own growing tokens and for the global store of previous responses as it
evicts."""

from hypothesis import given, settings
from hypothesis import strategies as st

from nodraft.drafters.base import DraftContext
from nodraft.drafters.registry import DrafterEnv
from nodraft.drafters.ngrams import RequestIndex, ResponseStore, SuffixIndex, grow_tree
from nodraft.drafters.suffix import SuffixDecoding
from nodraft.micro.model import KVCache
from tests.conftest import TINY, tiny_model

MODEL = tiny_model()


class Trie:
    """Every substring of up to max_depth tokens of each sequence, with counts; a node is
    [count, {token: node}]."""

    def __init__(self, max_depth: int, sequences):
        self.root = [0, {}]
        for seq in sequences:
            for i in range(len(seq)):
                node = self.root
                for t in seq[i:i + max_depth]:
                    node = node[1].setdefault(t, [0, {}])
                    node[0] += 1

    def draft(self, query, max_len, limit, min_prob):
        for m in range(min(max_len, len(query)), 0, -1):  # the longest suffix continued
            node = self.root
            for t in query[len(query) - m:]:
                node = node[1].get(t)
                if node is None:
                    break
            if node is not None and node[1]:
                kids = lambda nd: [(t, c[0], c) for t, c in nd[1].items()]  # noqa: E731
                return (*grow_tree(node, limit(m), min_prob, kids), m)
        return None


def brute_match(tokens, max_len):
    """The longest suffix (<= max_len) occurring earlier with a following token."""
    n = len(tokens)
    for m in range(min(max_len, n - 1), 0, -1):
        tail = tokens[n - m:]
        if any(tokens[i:i + m] == tail for i in range(0, n - m)):
            return m
    return 0


# few distinct tokens, so matches, long ones and ties are common
sequences = st.lists(st.integers(0, 3), min_size=1, max_size=120) | st.lists(
    st.sampled_from([5, 6, 7, 8, 9, 5, 5]), min_size=1, max_size=60).map(lambda x: x * 3)
depths, probs, factors = (st.sampled_from([4, 8, 12, 32]), st.sampled_from([0.01, 0.1, 0.5]),
                          st.sampled_from([0.5, 1.0, 4.0]))


def limiter(factor):
    return lambda m: min(16, max(1, int(factor * m)))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(sequences, depths, probs, factors, st.integers(1, 60), st.sampled_from([1, 3, 4]))
def test_a_requests_index_drafts_what_the_trie_drafts(tokens, max_depth, min_prob, factor, grow_by,
                                                      k):
    # any longest directly-indexed n-gram k: prompt lookup sets it, suffix reads any; the
    # dict index and the searched one (a request's own) alike
    want = Trie(max_depth, [tokens]).draft(tokens, max_depth // 2, limiter(factor), min_prob)
    for kind in (SuffixIndex, RequestIndex):
        index = kind(max_occurrences=10**9, k=k)  # the trie counts all occurrences
        grown = tokens[:max(1, len(tokens) - grow_by)]
        index.extend(grown)  # the request's list grows, as a request's tokens arrive
        grown += tokens[len(grown):]
        index.extend(grown)
        starts, m = index.match(tokens, max_depth // 2)
        assert m == brute_match(tokens, max_depth // 2)
        assert index.draft(tokens, max_depth // 2, limiter(factor), min_prob, max_depth) == want


# ids whose 4-byte words overlap: 256's bytes then 1's contain 1's at an odd offset
WORDY = [0, 1, 256, 65536, 1 << 24, (1 << 32) - 1]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(WORDY), min_size=2, max_size=80), st.integers(1, 5),
       st.sampled_from([1, 2, 3, 10**9]))
def test_the_searched_index_finds_every_whole_token_occurrence_as_the_dict_does(tokens, n,
                                                                               cap):
    searched, kept = RequestIndex(max_occurrences=cap), SuffixIndex(max_occurrences=cap, k=5)
    for index in (searched, kept):
        index.extend(tokens[:len(tokens) // 2])
        index.extend(tokens)
    for start in range(len(tokens) - n + 1):
        gram = tokens[start:start + n]
        ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1:e + 1] == gram]
        assert searched.lookup(gram) == kept.lookup(gram) == ends[-cap:]
        for recent in (False, True):
            want = (ends[-1] if recent else ends[0]) if ends else None
            assert searched.first_end(gram, recent) == kept.first_end(gram, recent) == want
    assert searched.lookup([1 << 40]) == [] and searched.first_end([-1]) is None


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=12),
       st.integers(1, 5), st.lists(st.integers(0, 3), min_size=1, max_size=12),
       depths, probs, factors)
def test_the_global_index_drafts_what_a_trie_of_the_kept_responses_drafts(
        responses, cap, query, max_depth, min_prob, factor):
    index = SuffixIndex(max_occurrences=10**9)
    for r in responses:
        index.add(list(r))
        while len(index.stored) > cap:
            index.evict_oldest()
    kept = responses[-cap:]
    limit = limiter(factor)
    assert index.draft(query, max_depth // 2, limit, min_prob, max_depth) == Trie(max_depth, kept).draft(
        query, max_depth // 2, limit, min_prob)
    # the evicted responses' tokens are cut away once they are most of the store
    assert len(index.tokens) <= 2 * sum(len(r) + 1 for r in kept)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=20),
                          st.integers(1, 20)), min_size=1, max_size=4),
       st.lists(st.integers(0, 5), min_size=1, max_size=12), depths, probs, factors)
def test_a_store_holding_responses_many_times_drafts_what_the_trie_drafts(
        repeated, query, max_depth, min_prob, factor):
    """A load test's store holds each prompt's response many times: the alike occurrences
    are read as one of them with their number as its weight, and the draft is the trie's."""
    index = SuffixIndex(max_occurrences=10**9)
    kept = []
    for r, times in repeated:
        for _ in range(times):
            index.add(list(r))
            kept.append(r)
    limit = limiter(factor)
    assert index.draft(query, max_depth // 2, limit, min_prob, max_depth) == Trie(max_depth, kept).draft(
        query, max_depth // 2, limit, min_prob)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=40), min_size=1, max_size=6),
       st.lists(st.integers(0, 1), min_size=1, max_size=40), st.integers(1, 32))
def test_a_match_is_the_longest_suffix_found_in_the_responses(responses, query, max_len):
    """``match`` (a K-gram's occurrences extended backwards by halves) against the
    longest common suffix counted token by token at every indexed end: an n-gram ends
    before its response's last token (that one is only a continuation)."""
    index = SuffixIndex(max_occurrences=10**9)
    for r in responses:
        index.add(list(r))
    cap = min(max_len, len(query))
    found = {}  # end position -> the longest suffix of the query ending there (<= cap)
    for start, n in index.stored:
        r = index.tokens[start - index.base:start - index.base + n]
        for end in range(n - 1):
            length = 0
            while length < cap and length <= end and r[end - length] == query[-1 - length]:
                length += 1
            if length:
                found[start + end] = length
    starts, m = index.match(query, max_len)
    if not found:
        assert (starts, m) == ([], 0)
        return
    longest = max(found.values())
    if longest < min(SuffixIndex.K, cap):  # an m-gram's every end
        want = [e + 1 for e in sorted(found) if found[e] >= longest]
    else:  # extended: the ends that go furthest
        want = [e + 1 for e in sorted(found) if found[e] == longest]
    assert (starts, m) == (want, longest)


def _kept(index):
    return [index.tokens[s - index.base:s - index.base + n] for s, n in index.stored]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=8), st.integers(0, 4),
                          st.booleans()), min_size=1, max_size=30),
       st.lists(st.integers(0, 3), min_size=1, max_size=8), st.sampled_from([1, 6, 12, 10**9]))
def test_the_store_indexed_when_read_is_the_index_kept_at_each_response(keeps, query,
                                                                         read_tokens):
    """Responses kept with a cap each (0 keeps nothing), the store read now and then: a
    read finds the responses an index that took each at its keep holds, in order, with the
    same drafts as that index -- unless, after as many responses kept unread as their cap,
    what waits unindexed is more than ``read_tokens`` tokens: then the newest of those
    that fit (at least one)."""
    store = ResponseStore(max_occurrences=10**9, read_tokens=read_tokens)
    responses: list[list[int]] = []
    alive: list[int] = []  # what an index taking each response at its keep holds (ids)
    indexed: list[int] = []  # what the store's index holds, read or not
    unread, waiting = 0, False
    limit = limiter(1.0)
    for response, cap, read in keeps + [([], 0, True)]:
        if cap and response:
            responses.append(list(response))
            alive = (alive + [len(responses) - 1])[-cap:]
            if unread < cap and not waiting:  # indexed as it is kept
                indexed = alive
            else:
                waiting = True
            unread += 1
        store.keep(list(response), cap)
        assert len(store) == len(alive)
        if not read:
            continue
        waits = [i for i in alive if i not in indexed]
        fit, tokens = [], 0
        for i in reversed(waits):  # the newest waiting that fit, at least one
            tokens += len(responses[i])
            if fit and tokens > read_tokens:
                break
            fit.insert(0, i)
        if fit != waits:
            alive = fit
        indexed, unread, waiting = alive, 0, False
        index = store.index
        kept = [responses[i] for i in alive]
        assert _kept(index) == kept and len(store) == len(kept)
        eager = SuffixIndex(max_occurrences=10**9)
        for r in kept:
            eager.add(r)
        assert index.draft(query, 4, limit, 0.1, 8) == eager.draft(query, 4, limit, 0.1, 8)


def test_the_draft_follows_the_most_frequent_continuation_as_a_tree():
    # [1 2] was followed by 3 twice and by 4 once: 3 first, 4 as its sibling
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 7, 1, 2]
    index = RequestIndex()
    index.extend(tokens)
    toks, parents, score, m = index.draft(tokens, 16, lambda m: 4, 0.1, 32)
    # then 3's continuations 9 and 8 (1/3 each; 4's 7 ties and came later)
    assert m == 2 and toks == [3, 4, 9, 8] and parents == [-1, -1, 0, 0]
    assert abs(score - sum([2 / 3, 1 / 3, 1 / 3, 1 / 3])) < 1e-9


def test_a_match_reads_its_most_recent_occurrences_only():
    # [1 2] followed by 3 four times, then by 4 twice
    tokens = [1, 2, 3] * 4 + [1, 2, 4] * 2 + [1, 2]
    for cap, want in ((100, [3]), (2, [4])):
        for kind in (SuffixIndex, RequestIndex):
            index = kind(max_occurrences=cap)
            index.extend(tokens)
            assert index.draft(tokens, 2, lambda m: 1, 0.1, 32)[0] == want


def test_the_drafter_keeps_the_last_responses_and_drafts_from_them():
    env = DrafterEnv("micro", MODEL, {}, None)
    drafter = SuffixDecoding(SuffixDecoding.Params(max_cached_responses=2), env)
    for response in ([40, 41, 42], [50, 51, 52], [60, 61, 62]):
        drafter.close(DraftContext([1] + response, 1, MODEL, KVCache(TINY, 1), 0))
    g = drafter.global_index
    assert [g.tokens[s - g.base:s - g.base + n] for s, n in g.stored] == [[50, 51, 52], [60, 61, 62]]

    def draft(tokens):
        return drafter.propose(DraftContext(tokens, len(tokens), MODEL, KVCache(TINY, 1), 0),
                               8).tokens.tolist()

    # one node per matched token (max_spec_factor 1)
    assert draft([3, 50]) == [51] and draft([50, 51]) == [52] and draft([60, 61]) == [62]
    assert draft([3, 40]) == []  # evicted


def test_a_repeated_request_is_drafted_from_the_stored_response():
    from tests.engine.helpers import generate

    shared: dict = {}
    prompt = [7, 3, 11, 2]
    first, first_seq, _ = generate(MODEL, prompt, 40, "suffix", shared=shared)
    again, again_seq, _ = generate(MODEL, prompt, 40, "suffix", shared=shared)
    assert again == first == generate(MODEL, prompt, 40)[0]  # lossless, both times
    # the second request finds the first one's response in the store: far fewer passes
    assert again_seq.stats.target_passes < first_seq.stats.target_passes / 2
