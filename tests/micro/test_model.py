import pytest
import torch

from nodraft.micro.model import KVCache, Micro, MicroConfig
from tests.conftest import TINY, tiny_model


def test_default_config_has_micro_size():
    m = Micro(MicroConfig())
    assert 1_700_000 <= m.num_params() <= 1_950_000
    assert m.config.n_layers == 4 and m.config.max_positions == 1024
    # tied embeddings: the head is the embedding, not a second matrix
    assert not any("head" in n for n, _ in m.named_parameters())


def test_kv_cache_decoding_matches_full_forward(tiny):
    x = torch.randint(0, TINY.vocab_size, (1, 40))
    full = tiny(x)[0]
    cache = KVCache(TINY, n_slots=3, dtype=torch.float64)
    slot = 2
    out = [tiny(x[:, :17], cache=cache, slot=slot)[0]]  # a prefill chunk...
    cache.advance(slot, 17)
    for t in range(17, 40):  # ...then one token at a time
        out.append(tiny(x[:, t:t + 1], cache=cache, slot=slot)[0])
        cache.advance(slot, 1)
    torch.testing.assert_close(torch.cat(out), full, rtol=1e-9, atol=1e-9)


def test_rollback_is_setting_a_length(tiny):
    x = torch.randint(0, TINY.vocab_size, (1, 30))
    cache = KVCache(TINY, dtype=torch.float64)
    tiny(x[:, :20], cache=cache)
    cache.advance(0, 20)
    junk = torch.randint(0, TINY.vocab_size, (1, 7))
    tiny(junk, cache=cache)  # scratch rows 20..26, never committed
    cache.set_length(0, 20)  # roll back: rows past 20 are ignored and overwritten
    got = tiny(x[:, 20:], cache=cache)[0]
    torch.testing.assert_close(got, tiny(x)[0, 20:], rtol=1e-9, atol=1e-9)


def test_exit_layer_reads_layer_k_through_the_final_norm_and_head(tiny):
    x = torch.randint(0, TINY.vocab_size, (2, 12))
    hidden = []
    tiny(x, hidden=hidden)
    assert len(hidden) == TINY.n_layers + 1  # embeddings, then each layer
    for k in range(1, TINY.n_layers + 1):
        torch.testing.assert_close(tiny(x, exit_layer=k), tiny.head(hidden[k]))
    torch.testing.assert_close(tiny(x, exit_layer=TINY.n_layers), tiny(x))


def test_run_layers_in_two_ranges_equals_one(tiny):
    x = torch.randint(0, TINY.vocab_size, (1, 9))
    pos = torch.arange(9)[None]
    h = tiny.embed(x)
    whole = tiny.run_layers(h, pos, 0, 4)
    split = tiny.run_layers(tiny.run_layers(h, pos, 0, 2), pos, 2, 4)
    torch.testing.assert_close(whole, split)


def test_tree_mask_equals_each_branch_decoded_alone(tiny):
    """Two branches in one block, at shared positions, give each branch's own logits."""
    prefix = torch.randint(0, TINY.vocab_size, (1, 10))
    a = torch.randint(0, TINY.vocab_size, (1, 3))
    b = torch.randint(0, TINY.vocab_size, (1, 2))
    cache = KVCache(TINY, dtype=torch.float64)
    tiny(prefix, cache=cache)
    cache.advance(0, 10)
    block = torch.cat([a, b], dim=1)  # rows: a0 a1 a2 b0 b1
    pos = torch.tensor([[10, 11, 12, 10, 11]])
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
                         [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    got = tiny(block, pos, cache=cache, tree_mask=mask)[0]
    torch.testing.assert_close(got[:3], tiny(torch.cat([prefix, a], 1))[0, 10:])
    torch.testing.assert_close(got[3:], tiny(torch.cat([prefix, b], 1))[0, 10:])


def test_move_rows_compacts_an_accepted_path(tiny):
    prefix = torch.randint(0, TINY.vocab_size, (1, 6))
    cache = KVCache(TINY, dtype=torch.float64)
    tiny(prefix, cache=cache)
    cache.advance(0, 6)
    # a tree stored in rows 6..9: [x, y1, y2, z] where the path x -> y2 is accepted
    x, y1, y2, z = torch.randint(0, TINY.vocab_size, (4,)).tolist()
    block = torch.tensor([[x, y1, y2, z]])
    pos = torch.tensor([[6, 7, 7, 8]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    tiny(block, pos, cache=cache, tree_mask=mask)
    cache.move_rows(0, [6, 8], 6)
    cache.set_length(0, 8)
    nxt = torch.randint(0, TINY.vocab_size, (1, 1))
    got = tiny(nxt, cache=cache)[0]
    want = tiny(torch.cat([prefix, torch.tensor([[x, y2]]), nxt], 1))[0, -1:]
    torch.testing.assert_close(got, want)


def test_slots_are_independent(tiny):
    cache = KVCache(TINY, n_slots=2, dtype=torch.float64)
    a = torch.randint(0, TINY.vocab_size, (1, 8))
    b = torch.randint(0, TINY.vocab_size, (1, 8))
    tiny(a, cache=cache, slot=0)
    cache.advance(0, 8)
    tiny(b, cache=cache, slot=1)
    cache.advance(1, 8)
    t = torch.randint(0, TINY.vocab_size, (1, 1))
    torch.testing.assert_close(tiny(t, cache=cache, slot=0)[0], tiny(torch.cat([a, t], 1))[0, -1:])


def test_fp32_cache_decode_close_to_full_forward():
    m = tiny_model(dtype=torch.float32)
    x = torch.randint(0, TINY.vocab_size, (1, 20))
    cache = KVCache(TINY)
    steps = []
    for t in range(20):
        steps.append(m(x[:, t:t + 1], cache=cache)[0])
        cache.advance(0, 1)
    torch.testing.assert_close(torch.cat(steps), m(x)[0], rtol=1e-4, atol=1e-4)


def test_longs_is_torch_tensor_of_the_list():
    """``longs`` makes the tensor ``torch.tensor(values, dtype=torch.long)`` makes: values,
    shape, dtype, an owned writable buffer; and a ``Draft.of``'s lists read back as its
    tensors do."""
    from nodraft.drafters.base import Draft
    from nodraft.micro.ops import cat_ints, longs

    for values in ([], [7], [0, 2**40, -3, 4095], [[1, 2], [3, 4]], list(range(300))):
        got, want = longs(values), torch.tensor(values, dtype=torch.long)
        assert got.dtype == torch.long and got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got, want)
    a = longs([1, 2, 3])
    a[0] = 9  # its own memory: nothing else sees the write
    assert longs([1, 2, 3]).tolist() == [1, 2, 3]
    assert torch.equal(cat_ints([[1, 2], torch.tensor([3]), [4]]), torch.tensor([1, 2, 3, 4]))
    d = Draft.of([5, 6, 7], [-1, 0, 0], 2)
    assert d.token_list == d.tokens.tolist() == [5, 6, 7] and len(d) == d.tokens.numel()
    assert d.parents.tolist() == [-1, 0, 0] and d.parents.dtype == torch.long
    assert len(Draft.of([])) == 0 and Draft.of([]).token_list == []
