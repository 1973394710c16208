"""``suffix``: suffix decoding (Oliaro et al., 2024). Draft cost 0: no model runs.

Two suffix structures, both depth-limited suffix tries (every substring of up to
``max_depth`` tokens, with occurrence counts):

- the request's own: over its prompt and output, extended as tokens arrive;
- a global one over previous responses, shared by all requests on this server and model,
  bounded to ``max_cached_responses`` (the oldest response leaves first, its counts
  subtracted).

To draft, match the longest suffix of the context (up to ``max_depth // 2`` tokens, so a
match leaves at least as many levels of the depth-limited trie below it to draft from) in a
trie, then grow a *tree* best-first from the matched node: a child's estimated probability
is its parent's times count(child) / count(parent), nodes are added while that stays at or
above ``min_token_prob``, and the tree holds at most ``max_spec_factor * match_length``
nodes (the draft grows with the match length), within the step's budget. Of the two tries'
trees the one with the larger expected accepted length (the sum of its node
probabilities) is proposed.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import torch

from drafters.base import Draft, DraftContext
from drafters.registry import DrafterEnv

# A trie node is a list [count, children: dict[token, node]] (lists are cheaper than objects).


class SuffixTrie:
    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root: list = [0, {}]

    def add(self, tokens: list[int], sign: int = 1) -> None:
        """Add (or, with sign = -1, remove) every substring of ``tokens`` up to max_depth."""
        for i in range(len(tokens)):
            node = self.root
            node[0] += sign
            for t in tokens[i:i + self.max_depth]:
                child = node[1].get(t)
                if child is None:
                    child = node[1][t] = [0, {}]
                child[0] += sign
                if child[0] <= 0:
                    del node[1][t]
                    break
                node = child


class IncrementalTrie(SuffixTrie):
    """A suffix trie over a growing sequence: each new token extends the substrings that
    start at the last ``max_depth`` positions."""

    def __init__(self, max_depth: int):
        super().__init__(max_depth)
        self.active: deque = deque()  # nodes of the substrings still growing
        self.size = 0

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.root[0] += 1
            self.active.append(self.root)
            if len(self.active) > self.max_depth:
                self.active.popleft()
            for j, node in enumerate(self.active):
                child = node[1].get(t)
                if child is None:
                    child = node[1][t] = [0, {}]
                child[0] += 1
                self.active[j] = child
            self.size += 1


def match(trie: SuffixTrie, tokens: list[int], max_len: int) -> tuple[list | None, int]:
    """The node of the longest suffix of ``tokens`` (<= max_len) that has a continuation."""
    for m in range(min(max_len, len(tokens)), 0, -1):
        node = trie.root
        for t in tokens[len(tokens) - m:]:
            node = node[1].get(t)
            if node is None:
                break
        if node is not None and node[1]:
            return node, m
    return None, 0


def grow_tree(node: list, max_nodes: int, min_prob: float) -> tuple[list[int], list[int], float]:
    """Best-first tree from ``node``: (tokens, parents, expected accepted length)."""
    tokens: list[int] = []
    parents: list[int] = []
    score = 0.0
    heap: list = []
    counter = 0

    def push(parent_node: list, parent_idx: int, parent_prob: float) -> None:
        nonlocal counter
        total = sum(c[0] for c in parent_node[1].values())
        for t, child in parent_node[1].items():
            p = parent_prob * child[0] / max(total, 1)
            if p >= min_prob:
                counter += 1
                heapq.heappush(heap, (-p, counter, t, child, parent_idx))

    push(node, -1, 1.0)
    while heap and len(tokens) < max_nodes:
        negp, _, t, child, parent_idx = heapq.heappop(heap)
        tokens.append(t)
        parents.append(parent_idx)
        score += -negp
        push(child, len(tokens) - 1, -negp)
    return tokens, parents, score


class SuffixDecoding:
    name = "suffix"

    @dataclass(frozen=True)
    class Params:
        max_depth: int = 32
        max_spec_factor: float = 1.0
        min_token_prob: float = 0.1
        max_cached_responses: int = 256
        num_speculative_tokens: int = 16

        def __post_init__(self):
            if not 2 <= self.max_depth <= 64:
                raise ValueError("max_depth must be in 2..64")
            if not 0.0 < self.min_token_prob <= 1.0:
                raise ValueError("min_token_prob must be in (0, 1]")
            if not 0.0 < self.max_spec_factor <= 16.0:
                raise ValueError("max_spec_factor must be in (0, 16]")
            if not 0 <= self.max_cached_responses <= 100_000:
                raise ValueError("max_cached_responses must be in 0..100000")
            if not 1 <= self.num_speculative_tokens <= 64:
                raise ValueError("num_speculative_tokens must be in 1..64")

    def __init__(self, params: Params, env: DrafterEnv):
        self.params = params
        # The global trie is shared by every request of this model; the server's engine
        # thread is its only user, so it needs no lock.
        g = env.shared.setdefault("suffix_global", {})
        if g.get("max_depth") != params.max_depth:
            g.update(max_depth=params.max_depth, trie=SuffixTrie(params.max_depth),
                     responses=deque())
        self.global_state = g

    def _local(self, ctx: DraftContext) -> IncrementalTrie:
        trie = ctx.state.get("suffix_trie")
        if trie is None:
            trie = ctx.state["suffix_trie"] = IncrementalTrie(self.params.max_depth)
        trie.extend(ctx.tokens[trie.size:])
        return trie

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        p = self.params
        best = ([], [], 0.0)
        tail = ctx.tokens
        for trie in (self._local(ctx), self.global_state["trie"]):
            node, m = match(trie, tail, p.max_depth // 2)
            if node is None:
                continue
            limit = min(budget, p.num_speculative_tokens, max(1, int(p.max_spec_factor * m)))
            cand = grow_tree(node, limit, p.min_token_prob)
            if cand[2] > best[2]:
                best = cand
        tokens, parents, _ = best
        if not tokens:
            return Draft.empty()
        chain = parents == list(range(-1, len(parents) - 1))
        return Draft(torch.tensor(tokens), None if chain else torch.tensor(parents))

    def observe(self, ctx: DraftContext, accepted: list[int]) -> None:
        pass  # the request's trie catches up on the next propose

    def close(self, ctx: DraftContext) -> None:
        """Add the finished response to the global trie, evicting the oldest beyond the cap."""
        g, cap = self.global_state, self.params.max_cached_responses
        response = ctx.tokens[ctx.prompt_len:]
        if cap == 0 or not response:
            return
        g["trie"].add(response)
        g["responses"].append(response)
        while len(g["responses"]) > cap:
            g["trie"].add(g["responses"].popleft(), sign=-1)
