"""The n-gram indexes of token sequences that the match-based drafters share: suffix
decoding reads them as depth-limited suffix trees, prompt lookup as where each n-gram ends.
Two kinds: ``SuffixIndex``, a dict of every n-gram's end positions (suffix decoding's store
of previous responses, read by many requests: ``ResponseStore``), and ``RequestIndex``, a
request's own tokens searched as bytes (``request_index``: one per request, shared by the
drafters reading it)."""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections import deque

from nodraft.drafters.base import DraftContext

_WORD = next(c for c in "IL" if array(c).itemsize == 4)  # an unsigned 4-byte token id


def grow_tree(root, max_nodes: int, min_prob: float, children
              ) -> tuple[list[int], list[int], float]:
    """Best-first tree from ``root``: (tokens, parents, expected accepted length).
    ``children(node)`` lists (token, count, child node); a child's probability is its
    parent's times count / the sum of its siblings' counts."""
    tokens: list[int] = []
    parents: list[int] = []
    score = 0.0
    heap: list = []
    counter = 0

    def push(node, parent_idx: int, parent_prob: float) -> None:
        nonlocal counter
        kids = children(node)
        total = sum(c for _, c, _ in kids)
        for t, c, child in kids:
            p = parent_prob * c / max(total, 1)
            if p >= min_prob:
                counter += 1
                heapq.heappush(heap, (-p, counter, t, child, parent_idx))

    push(root, -1, 1.0)
    while heap and len(tokens) < max_nodes:
        negp, _, t, child, parent_idx = heapq.heappop(heap)
        tokens.append(t)
        parents.append(parent_idx)
        score += -negp
        push(child, len(tokens) - 1, -negp)
    return tokens, parents, score


class SuffixIndex:
    """Token sequences, read as a depth-limited suffix trie over them (every substring of
    up to ``max_depth`` tokens, with occurrence counts), kept as an index of where each
    n-gram (n <= ``K``) ends: ``K`` dict insertions a token where a trie takes
    ``max_depth`` (a trie over the request's tokens, updated every step, was half of
    ``auto``'s per-step time on repeating text; adding a response to the global one stalled
    the engine for milliseconds). The trie's node for a matched suffix is the set of the
    suffix's earlier occurrences, so its counts come from grouping those occurrences'
    continuations, for the few nodes a draft needs. Tested equal to a trie
    (tests/drafters/test_suffix.py).

    Two uses: a request's own tokens (``extend``: ``tokens`` is the request's growing list),
    and previous responses (``add`` / ``evict_oldest``: each stored after a ``None``
    separator, so no match or continuation crosses from one response into the next).
    Positions are absolute; ``base`` is the position of ``tokens[0]`` once evicted
    responses are cut away."""

    K = 4  # the default: the longest n-gram looked up directly; longer matches extend
    # Occurrences read per match: the most recent ones. A common n-gram (an indentation
    # run) occurs thousands of times in a store of 256 responses, and a match reads each
    # of its occurrences; the trie, which counted them all, paid at insertion instead.
    MAX_OCCURRENCES = 64

    def __init__(self, max_occurrences: int = MAX_OCCURRENCES, k: int = K):
        self.max_occurrences = max_occurrences
        self.K = k
        self.tokens: list = []
        self.base = 0
        self.ends: dict[tuple, list[int]] = {}  # n-gram -> end positions, ascending
        self.indexed = -1  # the request's own: last end position indexed
        self.stored: deque = deque()  # previous responses: (start, length), oldest first

    def _grams(self, start: int, first_end: int, last_end: int):
        """(end, n-gram) for every n-gram (n <= K) ending at first_end..last_end of a
        sequence at ``start``, each n-gram's ends in ascending order. A step's few tokens
        are sliced directly; many (a response stored or evicted) go by n, then by end, the
        n-grams coming out of ``zip`` over shifted slices, not a slice and a tuple apiece."""
        toks, base = self.tokens, self.base
        if last_end - first_end < 4:
            for end in range(first_end, last_end + 1):
                for n in range(1, min(self.K, end - start + 1) + 1):
                    yield end, tuple(toks[end - n + 1 - base:end + 1 - base])
            return
        for n in range(1, self.K + 1):
            e0 = max(first_end, start + n - 1)  # the first end with n tokens behind it
            if e0 > last_end:
                break
            seq = toks[e0 - n + 1 - base:last_end + 1 - base]
            yield from zip(range(e0, last_end + 1), zip(*[seq[i:] for i in range(n)]))

    def _index(self, start: int, first_end: int, last_end: int, sign: int = 1) -> None:
        """(Un)index the n-grams ending at first_end..last_end of a sequence at ``start``."""
        ends = self.ends
        if sign > 0:
            for end, key in self._grams(start, first_end, last_end):
                at = ends.get(key)
                if at is None:
                    ends[key] = [end]
                else:
                    at.append(end)
        else:  # the oldest occurrence is the first
            for _, key in self._grams(start, first_end, last_end):
                at = ends[key]
                if len(at) == 1:
                    del ends[key]
                else:
                    del at[0]

    def extend(self, tokens: list[int]) -> None:
        """Index the request's own tokens (the list the request appends to): every n-gram
        ending before the current token, ``tokens[-1]``, which is only a continuation."""
        self.tokens = tokens
        self._index(0, self.indexed + 1, len(tokens) - 2)
        self.indexed = max(self.indexed, len(tokens) - 2)

    def add(self, response: list[int]) -> None:
        self.tokens.append(None)
        start = self.base + len(self.tokens)
        self.tokens.extend(response)
        self.stored.append((start, len(response)))
        self._index(start, start, start + len(response) - 2)

    def evict_oldest(self) -> None:
        start, length = self.stored.popleft()
        self._index(start, start, start + length - 2, sign=-1)
        cut = (self.stored[0][0] if self.stored else self.base + len(self.tokens)) - self.base
        if cut > len(self.tokens) // 2:  # drop the evicted tokens once they are the most
            del self.tokens[:cut]
            self.base += cut

    def lookup(self, gram: list[int]) -> list[int]:
        """The end positions of ``gram``'s most recent ``max_occurrences`` occurrences,
        ascending (none: empty)."""
        ends = self.ends.get(tuple(gram))
        if not ends:
            return []
        return ends[-self.max_occurrences:] if len(ends) > self.max_occurrences else ends

    def first_end(self, gram: list[int], recent: bool = False) -> int | None:
        """Where ``gram``'s first (``recent``: last) occurrence ends; None if it has none."""
        ends = self.ends.get(tuple(gram))
        return (ends[-1] if recent else ends[0]) if ends else None

    def match(self, query: list[int], max_len: int) -> tuple[list[int], int]:
        """(where the continuations of the longest suffix of ``query`` (<= max_len) with
        one start, its length)."""
        n, toks, base = len(query), self.tokens, self.base
        for m in range(min(self.K, max_len, n), 0, -1):
            ends = self.lookup(query[n - m:])
            if ends:
                break
        else:
            return [], 0
        if m < self.K:
            return [e + 1 for e in ends], m
        # extend each occurrence of the K-gram backwards, up to max_len
        best, starts, limit = m, [], min(max_len, n)
        tail = query[n - limit:]
        for e in ends:
            end = e - base + 1
            if end - limit >= 0 and toks[end - limit:end] == tail:
                length = limit  # the whole way (one comparison in C: loops are common)
            else:  # the longest that matches: a token further, then by halves (each
                # test one comparison in C; a match of length L holds every shorter one)
                length, hi = m, min(limit - 1, end)
                if length < hi and toks[end - length - 1] == tail[limit - length - 1]:
                    length += 1
                else:
                    hi = length
                while length < hi:
                    mid = (length + hi + 1) // 2
                    if toks[end - mid:end] == tail[limit - mid:]:
                        length = mid
                    else:
                        hi = mid - 1
            if length > best:
                best, starts = length, [e + 1]
            elif length == best:
                starts.append(e + 1)
        return starts, best

    def draft(self, query: list[int], max_len: int, max_nodes, min_prob: float,
              max_depth: int):
        """The continuation tree under the longest matched suffix of ``query`` in a
        ``max_depth`` trie: (tokens, parents, expected accepted length, match length), or
        None without a match. ``max_nodes(m)`` is the node budget for a match of length m."""
        starts, m = self.match(query, max_len)
        if not m:
            return None
        toks, base, depth_left = self.tokens, self.base, max_depth - m
        size = base + len(toks)
        limit = max_nodes(m)
        # occurrences whose next tokens are the same as far as the tree can reach (its
        # depth, its node budget) grow the same subtree: one of them stands for them all,
        # with their number as its weight (a store holding a response many times -- a
        # load test's, a repeated request's -- matched 64 alike occurrences a token)
        reach = min(limit, depth_left)
        weighted: dict[tuple, list[int]] = {}
        for p in starts:
            key = tuple(toks[p - base:p - base + reach])
            rep = weighted.get(key)
            if rep is None:
                weighted[key] = [p, 1]
            else:
                rep[1] += 1

        def follow(nodes):  # [(position, weight)] -> [(token, position, weight)], live ones
            return [(t, p, w) for p, w in nodes if p < size and (t := toks[p - base]) is not None]

        def children(node):  # node: (continuation positions and weights, depth below the match)
            nodes, depth = node
            if depth >= depth_left:
                return []
            groups: dict[int, list] = {}
            for t, p, w in follow(nodes):
                g = groups.get(t)
                if g is None:
                    groups[t] = [w, [(p + 1, w)]]
                else:
                    g[0] += w
                    g[1].append((p + 1, w))
            return [(t, c, (g, depth + 1)) for t, (c, g) in groups.items()]

        # While every occurrence continues alike, the tree is a chain of probability 1:
        # read off the groups' keys (their next ``reach`` tokens; one group on repeating
        # text, most drafts, whose key is the chain), the heap only past a fork. An
        # occurrence ends at a response's end (None) or the tokens' (its key is shorter).
        keys = list(weighted)
        if len(keys) == 1:
            key = keys[0]
            k = key.index(None) if None in key else len(key)
            chain = list(key[:k])
            live = [0]
        else:
            chain, k = [], 0
            live = [j for j, key in enumerate(keys) if key and key[0] is not None]
            while live and k < reach:
                t = keys[live[0]][k]
                if any(keys[j][k] != t for j in live):
                    break
                chain.append(t)
                k += 1
                live = [j for j in live if len(keys[j]) > k and keys[j][k] is not None]
        reps = list(weighted.values())
        nodes = [(reps[j][0] + k, reps[j][1]) for j in live]
        if k >= limit:
            return chain, list(range(-1, k - 1)), float(k), m
        rest, parents, score = grow_tree((nodes, k), limit - k, min_prob, children)
        return (chain + rest, list(range(-1, k - 1)) + [q + k if q >= 0 else k - 1 for q in parents],
                k + score, m)


class ResponseStore:
    """Suffix decoding's store of previous responses, shared by a server's requests of one
    model: a ``SuffixIndex`` over the last responses kept, each ``keep`` bounded by its
    caller's cap (the oldest leaves first).

    While requests read it (``index``), a response is indexed when it is kept, as each
    evicted one is unindexed -- ``K`` dict insertions a token in and as many out again.
    Once ``cap`` responses have been kept since the last read -- enough to have replaced
    everything indexed then -- the store stops indexing: a kept response waits as it is,
    and one that later keeps push out is never indexed. So a server whose requests do not
    read the store (``auto`` resting under sampling, plain decoding) pays an append a
    response. The next read indexes what waits, at most ``read_tokens`` tokens of it (the
    engine's one thread waits on a read): the newest responses that fit, at least one.
    Every other read finds what an index that took each response at its keep holds
    (tests/drafters/test_suffix.py)."""

    # the most tokens a read after a spell unread indexes: about a prefill chunk's work
    READ_TOKENS = 4096

    def __init__(self, max_occurrences: int = SuffixIndex.MAX_OCCURRENCES,
                 k: int = SuffixIndex.K, read_tokens: int = READ_TOKENS):
        self._index = SuffixIndex(max_occurrences, k)
        self.read_tokens = read_tokens
        self.unread = 0  # responses kept since the last read
        self.pending: deque[list[int]] = deque()  # kept unindexed (not read), oldest first
        self.dead = 0  # the index's oldest responses that keeps since then evicted

    def __len__(self) -> int:
        """The responses kept (a read after a spell unread may find fewer)."""
        return len(self._index.stored) - self.dead + len(self.pending)

    def keep(self, response: list[int], cap: int) -> None:
        """Keep ``response`` (a list the caller no longer changes), then evict the oldest
        beyond ``cap``. Nothing is kept, nor evicted, with ``cap`` 0 or an empty response."""
        if cap <= 0 or not response:
            return
        idx = self._index
        if self.unread < cap and not self.pending:  # read lately: indexed now
            idx.add(response)
            while len(idx.stored) > cap:
                idx.evict_oldest()
        else:
            self.pending.append(response)
            over = len(self) - cap
            if over > 0:
                from_index = min(over, len(idx.stored) - self.dead)
                self.dead += from_index
                for _ in range(over - from_index):
                    self.pending.popleft()
        self.unread += 1

    @property
    def index(self) -> SuffixIndex:
        """The index over the responses kept and not evicted (after a spell unread, the
        newest of them within ``read_tokens``)."""
        self.unread = 0
        idx, pending = self._index, self.pending
        if not pending:
            return idx
        # the newest waiting responses that fit (at least one)
        tokens = len(pending[-1])
        fit = 1
        while fit < len(pending) and tokens + len(pending[-fit - 1]) <= self.read_tokens:
            fit += 1
            tokens += len(pending[-fit])
        if fit == len(pending) and self.dead < len(idx.stored):
            # all of them, and some of what the index holds is still kept: unindex the rest
            for _ in range(self.dead):
                idx.evict_oldest()
        else:  # a new index: the responses it held are older than any dropped here
            idx = self._index = SuffixIndex(idx.max_occurrences, idx.K)
        for r in itertools.islice(pending, len(pending) - fit, None):
            idx.add(r)
        pending.clear()
        self.dead = 0
        return idx


class RequestIndex(SuffixIndex):
    """A request's own growing tokens, read as ``SuffixIndex`` reads them (the same
    matches, drafts and ``lookup``), found by searching rather than kept in a dict: the
    tokens as 4-byte words in a ``bytearray``, an n-gram's occurrences found by
    ``bytearray.find``/``rfind`` (C's search over a few kilobytes, aligned to whole
    tokens; ids below 2**32). Extending costs one copy of the new tokens' bytes, where the
    dict took ``K`` insertions a token: a prompt of a few hundred tokens indexed at a
    request's first step cost ``auto`` and the match-based drafters about a plain step's
    time, and ``auto``'s every ask after it had rested paid for the tokens of the rest
    (docs/LOG.md, "`auto`'s rests, the server's and ended by a copy"). Any ``K`` costs the
    same, so one index serves every caller."""

    def __init__(self, max_occurrences: int = SuffixIndex.MAX_OCCURRENCES,
                 k: int = SuffixIndex.K):
        super().__init__(max_occurrences, k)
        # tokens[:indexed + 1] (every n-gram ending at or before ``indexed``), 4 bytes each
        self.words = bytearray()

    def extend(self, tokens: list[int]) -> None:
        self.tokens = tokens
        last = len(tokens) - 2  # the current token ends no n-gram: it has no continuation
        if last > self.indexed:
            self.words += array(_WORD, tokens[self.indexed + 1:last + 1]).tobytes()
            self.indexed = last

    def _pattern(self, gram: list[int]) -> bytes | None:
        try:
            return array(_WORD, gram).tobytes()
        except (OverflowError, TypeError):  # not a token id: occurs nowhere
            return None

    def _ends_back(self, gram: list[int]):
        """The end positions of ``gram``'s whole-token occurrences, most recent first."""
        pat = self._pattern(gram)
        if pat is None:
            return
        words, width = self.words, len(pat)
        hi = len(words)
        while (i := words.rfind(pat, 0, hi)) >= 0:
            if not i & 3:  # at a token's start (else the bytes straddle two tokens)
                yield (i + width) // 4 - 1
            hi = i + width - 1  # the next one starts before i (occurrences may overlap)

    def lookup(self, gram: list[int]) -> list[int]:
        # ``_ends_back``'s search written out (no generator): on repeating text a K-gram
        # occurs dozens of times, and suffix decoding looks one up at every step it drafts
        pat = self._pattern(gram)
        if pat is None:
            return []
        rfind, width, cap = self.words.rfind, len(pat), self.max_occurrences
        ends: list[int] = []
        hi = len(self.words)
        while len(ends) < cap and (i := rfind(pat, 0, hi)) >= 0:
            if not i & 3:
                ends.append((i + width) // 4 - 1)
            hi = i + width - 1
        ends.reverse()
        return ends

    def first_end(self, gram: list[int], recent: bool = False) -> int | None:
        if recent:
            return next(self._ends_back(gram), None)
        pat = self._pattern(gram)
        if pat is None:
            return None
        lo = 0
        while (i := self.words.find(pat, lo)) >= 0:
            if not i & 3:
                return (i + len(pat)) // 4 - 1
            lo = i + 1
        return None


def request_index(ctx: DraftContext, k: int | None = None) -> RequestIndex:
    """The request's own index, brought up to date: one per request, kept on the context
    (``ctx.ngrams``) so that every match-based drafter reading it -- suffix decoding,
    prompt lookup, both under ``auto`` -- shares it. ``k``: the longest n-gram the caller
    looks up directly (suffix decoding extends longer matches from ``K``-grams); any costs
    the same, so the index keeps the largest asked for."""
    index = ctx.ngrams
    if index is None:
        index = ctx.ngrams = RequestIndex(k=k or RequestIndex.K)
    elif k is not None and index.K < k:
        index.K = k
    index.extend(ctx.tokens)
    return index
