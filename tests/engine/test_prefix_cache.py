"""Automatic prefix caching: kept prompt blocks are the prefill's own rows, a prompt takes
its longest kept prefix (never its last token), the least recently used go first, and
every drafter's output from a cached prefix is its output without one."""

from __future__ import annotations

import pytest
import torch

from nodraft.drafters.registry import Registry
from nodraft.engine.core import Engine, GenerationRequest
from nodraft.engine.prefix_cache import BLOCK, PrefixCache
from nodraft.engine.sequence import Sequence
from nodraft.engine.verify import SamplingParams
from nodraft.micro.model import KVCache
from tests.conftest import TINY, tiny_model
from tests.engine.helpers import HEADS_DIR, drafter_env, generate, run_all

MODEL = tiny_model(seed=3)
NAME = f"tiny-{TINY.dim}-{TINY.n_layers}-{TINY.vocab_size}"  # drafter_env's heads' name


def random_cache(slots: int = 2) -> KVCache:
    cache = KVCache(TINY, slots, dtype=torch.float64)
    cache.k.normal_()
    cache.v.normal_()
    return cache


def block_bytes() -> int:
    c = TINY
    return (2 * c.n_layers * c.n_heads * BLOCK * c.head_dim + BLOCK * c.dim) * 8


def test_a_prompt_gets_the_rows_and_states_its_prefill_kept():
    pc = PrefixCache(1 << 30)
    cache = random_cache()
    prompt = list(range(3 * BLOCK + 5))
    hidden = torch.randn(len(prompt), TINY.dim, dtype=torch.float64)
    pc.store(prompt, len(prompt), cache, 0, hidden)
    assert len(pc) == 3 and pc.nbytes == 3 * block_bytes()
    got = pc.load(prompt + [7, 8], cache, 1)
    n = 3 * BLOCK
    assert got.shape == (n, TINY.dim) and torch.equal(got, hidden[:n])
    assert cache.lengths[1] == n
    assert torch.equal(cache.k[:, 1, :, :n], cache.k[:, 0, :, :n])
    assert torch.equal(cache.v[:, 1, :, :n], cache.v[:, 0, :, :n])
    assert (pc.queries, pc.hits) == (len(prompt) + 2, n)


def test_a_prompt_takes_its_longest_kept_prefix_never_its_last_token():
    pc = PrefixCache(1 << 30)
    cache = random_cache()
    prompt = list(range(2 * BLOCK))
    pc.store(prompt, len(prompt), cache, 0, torch.zeros(len(prompt), TINY.dim))
    # the same prompt: its last token is computed, so only the first block is read
    assert pc.load(prompt, cache, 1).shape[0] == BLOCK
    # one more token: both blocks
    assert pc.load(prompt + [1], cache, 1).shape[0] == 2 * BLOCK
    # a change in the second block: the first only; in the first: nothing
    assert pc.load(prompt[:BLOCK + 3] + [63] + prompt[BLOCK + 4:] + [1], cache, 1).shape[0] == BLOCK
    cache.set_length(1, 5)
    assert pc.load([63] + prompt[1:] + [1], cache, 1) is None
    assert cache.lengths[1] == 5  # untouched
    # a block is found only after the same blocks before it
    assert pc.load(prompt[BLOCK:] + prompt[BLOCK:] + [1], cache, 1) is None
    # rows short of a whole block are never kept
    pc2 = PrefixCache(1 << 30)
    pc2.store(prompt, BLOCK - 1, cache, 0, torch.zeros(len(prompt), TINY.dim))
    assert len(pc2) == 0


def test_the_least_recently_used_blocks_go_first_a_chains_deepest_first():
    pc = PrefixCache(4 * block_bytes())
    cache = random_cache()
    a = list(range(2 * BLOCK))
    b = list(range(40, 40 + 2 * BLOCK))
    for p in (a, b):
        pc.store(p, len(p), cache, 0, torch.zeros(len(p), TINY.dim))
    assert len(pc) == 4
    assert pc.load(a + [1], cache, 1) is not None  # a used: b is now the older
    c = list(range(10, 10 + BLOCK))
    pc.store(c, len(c), cache, 0, torch.zeros(len(c), TINY.dim))
    assert len(pc) == 4 and pc.nbytes <= pc.capacity_bytes
    # b lost its deepest block, not its first; a and c are whole
    assert pc.load(b + [1], cache, 1).shape[0] == BLOCK
    assert pc.load(a + [1], cache, 1).shape[0] == 2 * BLOCK
    assert pc.load(c + [1], cache, 1).shape[0] == BLOCK
    # a chain larger than the whole capacity keeps its first blocks
    small = PrefixCache(2 * block_bytes())
    long = list(range(5 * BLOCK))
    small.store(long, len(long), cache, 0, torch.zeros(len(long), TINY.dim))
    assert len(small) == 2 and small.load(long, cache, 1).shape[0] == 2 * BLOCK


def test_a_capacity_of_zero_keeps_nothing():
    pc = PrefixCache(0)
    cache = random_cache()
    prompt = list(range(3 * BLOCK))
    pc.store(prompt, len(prompt), cache, 0, torch.zeros(len(prompt), TINY.dim))
    assert len(pc) == 0 and pc.load(prompt, cache, 1) is None


def float64_engine(**kw) -> Engine:
    engine = Engine({NAME: MODEL}, Registry(), eot_id=None, **kw)
    for c in engine.caches.values():
        c.k, c.v = c.k.double(), c.v.double()
    engine.checkpoint_dir = HEADS_DIR
    return engine


SYSTEM = torch.randint(0, TINY.vocab_size, (37,), generator=torch.Generator().manual_seed(5)).tolist()
PROMPTS = [SYSTEM + [1, 2, 3], SYSTEM + [4, 5, 6, 7, 8, 9] * 4, SYSTEM + [1, 2, 3],
           SYSTEM[:20], SYSTEM + [1, 2, 3] + [9] * 30]
METHODS = [("none", {}), ("prompt_lookup", {}), ("suffix", {}), ("lookahead", {}),
           ("early_exit", {"exit_layer": 2}), ("medusa", {}), ("eagle", {}), ("auto", {})]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("concurrent", [False, True])
def test_every_drafter_gets_its_solo_output_from_a_cached_prefix(temperature, concurrent):
    """One request at a time (the lone path: the prefill, then the rows past the cached
    prefix in a pass of their own) or all together (the packed passes' prompt chunks):
    each request's tokens are those it gets alone, without a prefix cache; and the cache
    was used."""
    drafter_env(MODEL)  # the tiny model's untrained Medusa and EAGLE heads
    reg = Registry()
    requests, solo = [], []
    for i, (method, params) in enumerate(METHODS):
        for j, prompt in enumerate(PROMPTS):
            sp = SamplingParams(temperature, seed=100 * i + j if temperature else None)
            m, p = reg.parse({"method": method, **params})
            requests.append(GenerationRequest(NAME, prompt, 12, sp, m, p))
            solo.append(generate(MODEL, prompt, 12, method, params, sp)[0])
    def serve(prefix_cache_bytes: int) -> tuple[Engine, list]:
        engine = float64_engine(max_running=6 if concurrent else 1, max_waiting=100,
                                prefix_cache_bytes=prefix_cache_bytes)
        engine.prefill_tokens = 24  # a prompt's rows past its cached prefix, several passes
        engine.start()
        try:
            if concurrent:
                return engine, run_all(engine, requests)
            return engine, [run_all(engine, [r])[0] for r in requests]
        finally:
            engine.stop()

    engine, events = serve(1 << 30)
    cached = []
    for want, evs in zip(solo, events):
        assert evs[-1].kind == "finish", evs[-1]
        steps = [e.step for e in evs if e.kind == "step"]
        assert [t for s in steps for t in s.tokens] == want
        assert steps[0].cached_tokens is not None
        assert all(s.cached_tokens is None for s in steps[1:])
        cached.append(steps[0].cached_tokens)
    assert all(c % BLOCK == 0 for c in cached)
    pc = engine.prefix_caches[NAME]
    assert sum(cached) == pc.hits > 0 and pc.queries == sum(len(r.prompt) for r in requests)
    if not concurrent:  # after the first, every prompt but the short one starts with kept blocks
        assert cached[0] == 0 and min(cached[1:3]) >= 32 and cached[3] == 16
        # the drafters saw the same prompt features (EAGLE's cache is built from them):
        # the same drafts as without a prefix cache (auto's choices follow timings: not it)
        _, plain = serve(0)
        for r, evs, other in zip(requests, events, plain):
            if r.method != "auto":
                assert ([e.step.draft for e in evs if e.kind == "step"]
                        == [e.step.draft for e in other if e.kind == "step"])


def test_prompt_logprobs_from_a_cached_prefix_equal_those_without():
    reg = Registry()
    m, p = reg.parse("none")
    prompt = SYSTEM + [1, 2, 3]
    want = []
    for bytes_ in (0, 1 << 20):
        engine = float64_engine(max_running=1, prefix_cache_bytes=bytes_)
        engine.start()
        try:
            got = [run_all(engine, [GenerationRequest(NAME, prompt, 3, method=m, params=p,
                                                      logprobs=2, prompt_logprobs=True)])[0]
                   for _ in range(2)]
        finally:
            engine.stop()
        firsts = [next(e.step for e in evs if e.kind == "step") for evs in got]
        assert [f.cached_tokens for f in firsts] == ([0, 0] if bytes_ == 0 else [0, 32])
        want.append([f.prompt_logprobs for f in firsts])
    flat = [lp for run in want for lp in run]
    assert len(flat[0]) == len(prompt) - 1
    for lp in flat[1:]:
        assert [t for t, _ in lp] == pytest.approx([t for t, _ in flat[0]], abs=1e-9)
        assert [top for _, top in lp] == [top for _, top in flat[0]]


def test_a_sequences_prefill_alone_keeps_and_reads_blocks():
    """``Sequence.prefill`` (every prompt token but the last) keeps and reads blocks too."""
    pc = PrefixCache(1 << 30)
    prompt = SYSTEM + [1, 2, 3]
    outs = []
    for _ in range(2):
        cache = KVCache(TINY, 1, dtype=torch.float64)
        env = drafter_env(MODEL)
        seq = Sequence(MODEL, cache, 0, prompt, Registry().build(*Registry().parse("none"), env), 8,
                       prefix_cache=pc)
        seq.prefill()
        outs.append((seq.cached_tokens, seq.ctx.last_hidden))
    assert outs[0][0] == 0 and outs[1][0] == 32
    assert torch.allclose(outs[0][1], outs[1][1], atol=1e-12)
