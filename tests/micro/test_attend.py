"""nodraft::attend (micro/csrc/attend.cpp): each slot's one row attends over its own cached
rows, then itself -- softmax attention computed here in float64 -- for any head size up to
128, ragged lengths (zero included), strided cache views, and slots with no row. And
nodraft::put_rows, which writes a packed pass's new rows into the cache."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nodraft.micro import gemm

pytestmark = pytest.mark.skipif(not gemm.load(), reason=f"nodraft's kernels unavailable: {gemm.why()}")


def attend(*args):
    return torch.ops.nodraft.attend.default(*args)


def reference(q, k, v, kc, vc, src, starts, scale):
    """The contract, one slot and head at a time, in float64."""
    B, H, D = kc.shape[0], q.shape[1], q.shape[2]
    y = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        r, n = int(src[b]), int(starts[b])
        if not 0 <= r < q.shape[0]:
            continue
        for h in range(H):
            keys = torch.cat([kc[b, h, :n], k[r, h][None]]).double()
            vals = torch.cat([vc[b, h, :n], v[r, h][None]]).double()
            p = torch.softmax(keys @ q[r, h].double() * scale, dim=0)
            y[b, h] = p @ vals
    return y


def inputs(N, B, H, D, C, seed, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(N, H, D, generator=g) * spread for _ in range(3))
    # the caches as the engine's: a view into a longer, wider cache (strides not compact)
    big_k = torch.randn(3, B + 2, H, C + 5, D, generator=g)
    big_v = torch.randn(3, B + 2, H, C + 5, D, generator=g)
    kc, vc = big_k[1, 1:B + 1, :, :C], big_v[1, 1:B + 1, :, :C]
    starts = torch.randint(0, C + 1, (B,), generator=g)
    src = torch.randint(0, N, (B,), generator=g)
    return q, k, v, kc, vc, src, starts


@settings(max_examples=80, deadline=None)
@given(N=st.integers(1, 12), B=st.integers(1, 9), H=st.integers(1, 5),
       D=st.integers(1, 128), C=st.integers(0, 70), seed=st.integers(0, 999))
def test_it_is_softmax_attention_over_each_slots_own_rows(N, B, H, D, C, seed):
    q, k, v, kc, vc, src, starts = inputs(N, B, H, D, C, seed)
    scale = 1 / math.sqrt(D)
    got = attend(q, k, v, kc, vc, src, starts, scale)
    assert got.shape == (B, H, D) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference(q, k, v, kc, vc, src, starts, scale),
                               rtol=1e-4, atol=1e-5)


def test_micro_shape_with_sharp_scores_and_rows_past_each_length_ignored():
    """micro's heads (4 x 40), 32 slots of ragged length; scores large enough that the
    softmax is nearly one-hot (the exponential's range matters); rows past a slot's length
    hold NaN, which must never be read."""
    q, k, v, kc, vc, src, starts = inputs(40, 32, 4, 40, 181, seed=7, spread=4.0)
    for b in range(32):
        kc[b, :, int(starts[b]):] = float("nan")
        vc[b, :, int(starts[b]):] = float("nan")
    got = attend(q, k, v, kc, vc, src, starts, 1 / math.sqrt(40))
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), reference(q, k, v, kc, vc, src, starts,
                                                       1 / math.sqrt(40)),
                               rtol=1e-4, atol=1e-5)


def test_a_slot_without_a_row_gets_zeros_and_a_lone_slot_attends_to_itself():
    q, k, v, kc, vc, _, _ = inputs(3, 4, 2, 24, 10, seed=1)
    src = torch.tensor([3, 0, -1, 2])  # 3 and -1: no row (3 is N, the packed pass's marker)
    starts = torch.tensor([5, 0, 10, 10])
    got = attend(q, k, v, kc, vc, src, starts, 0.2)
    assert torch.equal(got[0], torch.zeros(2, 24)) and torch.equal(got[2], torch.zeros(2, 24))
    torch.testing.assert_close(got[1], v[0])  # nothing cached: all weight on its own row
    torch.testing.assert_close(got.double(), reference(q, k, v, kc, vc, src, starts, 0.2),
                               rtol=1e-4, atol=1e-5)


def test_bad_input_is_refused_with_a_reason():
    q, k, v, kc, vc, src, starts = inputs(2, 2, 2, 8, 6, seed=2)
    with pytest.raises(RuntimeError, match="length 7 outside"):
        attend(q, k, v, kc, vc, src, torch.tensor([1, 7]), 1.0)
    with pytest.raises(RuntimeError, match="float32 only"):
        attend(q.double(), k.double(), v.double(), kc, vc, src, starts, 1.0)
    with pytest.raises(RuntimeError, match="head size 129"):
        big = torch.zeros(2, 2, 129)
        attend(big, big, big, torch.zeros(2, 2, 3, 129), torch.zeros(2, 2, 3, 129), src,
               starts, 1.0)
    with pytest.raises(RuntimeError, match="must be"):
        attend(q, k, v, kc[:1], vc, src, starts, 1.0)


def test_it_runs_inside_a_compiled_graph_with_symbolic_sizes():
    """As the packed passes call it: inputs that are views of the graph's own buffers,
    every size dynamic, one graph for several batches."""
    fn = torch.compile(lambda qkv, kc, vc, src, starts: attend(
        qkv[:, 0] * 2, qkv[:, 1], qkv[:, 2], kc, vc, src, starts, 0.25), dynamic=True,
        fullgraph=True)
    for N, B, C in ((5, 3, 17), (9, 6, 40)):
        q, k, v, kc, vc, src, starts = inputs(N, B, 3, 16, C, seed=N)
        got = fn(torch.stack([q, k, v], 1), kc, vc, src, starts)
        torch.testing.assert_close(got.double(), reference(q * 2, k, v, kc, vc, src, starts,
                                                           0.25), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_put_rows_writes_each_rows_keys_at_its_slot_and_row_and_nothing_else(dtype):
    g = torch.Generator().manual_seed(5)
    L, S, H, M, D, N = 3, 6, 4, 20, 40, 9
    cache = torch.randn(L, S, H, M, D, generator=g).to(dtype)
    want = cache.clone()
    pairs = torch.randperm(S * M, generator=g)[:N]  # distinct (slot, row) places
    slots, rows = pairs // M, pairs % M
    fresh = torch.randn(L, N, H, D, generator=g).to(dtype)
    want[:, slots, :, rows] = fresh.transpose(0, 1)
    torch.ops.nodraft.put_rows.default(cache, slots, rows, fresh)
    assert torch.equal(cache, want)


def test_put_rows_refuses_a_place_outside_the_cache():
    cache = torch.zeros(2, 3, 2, 5, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.nodraft.put_rows.default(cache, torch.tensor([0, 3]), torch.tensor([1, 1]),
                                           torch.ones(2, 2, 2, 8))
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.nodraft.put_rows.default(cache[:, :, :, :4], torch.tensor([0]),
                                           torch.tensor([1]), torch.ones(2, 1, 2, 8))
    assert not cache.any()  # refused before anything was written
