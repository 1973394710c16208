"""nodraft::mm (micro/gemm.py, micro/csrc/gemm.cpp): torch.mm's numbers up to float
rounding for any shape, and the same bits for a row whatever else is in the call."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nodraft.micro import gemm

pytestmark = pytest.mark.skipif(not gemm.load(), reason=f"nodraft::mm unavailable: {gemm.why()}")


def mm(a, b):
    return torch.ops.nodraft.mm.default(a, b)


@settings(max_examples=60, deadline=None)
@given(M=st.integers(1, 40), K=st.integers(1, 400), N=st.integers(1, 300), seed=st.integers(0, 99))
def test_it_computes_the_product_for_any_shape(M, K, N, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
    got = mm(a, b)
    assert got.shape == (M, N) and got.dtype == torch.float32
    torch.testing.assert_close(got, a @ b, rtol=1e-5, atol=1e-5 * K ** 0.5)


@pytest.mark.parametrize("K, N", [(160, 4096), (160, 480), (384, 160), (37, 70)])
def test_a_rows_result_does_not_depend_on_the_other_rows(K, N):
    g = torch.Generator().manual_seed(K + N)
    a, b = torch.randn(17, K, generator=g), torch.randn(K, N, generator=g)
    full = mm(a, b)
    for i in range(17):  # alone, and as the first rows of every shorter call
        assert torch.equal(mm(a[i:i + 1], b)[0], full[i])
        assert torch.equal(mm(a[:i + 1], b), full[:i + 1])


@pytest.mark.parametrize("K, blocks", [(160, 30), (160, 10), (384, 10), (160, 256), (37, 7),
                                       (5, 1)])
def test_a_few_rows_of_a_packed_weight_give_each_rows_own_bits(K, blocks):
    """One to three rows take a packed weight's whole blocks several at a time on AVX2 (four
    for one row, two for two or three), and what is left one at a time: every row still
    gets the bits it gets in a call of 17 rows, and from the weight unpacked."""
    g = torch.Generator().manual_seed(K + blocks)
    a, b = torch.randn(17, K, generator=g), torch.randn(K, gemm.PACK * blocks, generator=g)
    packed = gemm.pack(b)
    full = mm(a, b)
    assert torch.equal(mm(a, packed), full)
    for M in (1, 2, 3):
        for i in range(0, 17 - M + 1, 3):
            assert torch.equal(mm(a[i:i + M], packed), full[i:i + M]), (M, i)


@settings(max_examples=40, deadline=None)
@given(M=st.integers(1, 20), K=st.integers(1, 400), blocks=st.integers(1, 20),
       seed=st.integers(0, 99))
def test_a_packed_weight_gives_the_same_bits(M, K, blocks, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(M, K, generator=g), torch.randn(K, gemm.PACK * blocks, generator=g)
    packed = gemm.pack(b)
    assert packed.shape == (blocks, K, gemm.PACK)  # 16-column blocks, each contiguous
    assert torch.equal(packed[1 % blocks], b[:, gemm.PACK * (1 % blocks):][:, :gemm.PACK])
    assert torch.equal(mm(a, packed), mm(a, b))
    torch.testing.assert_close(mm(a, packed), a @ b, rtol=1e-5, atol=1e-5 * K ** 0.5)


def test_weights_that_cannot_be_packed_are_left_as_they_are():
    b = torch.randn(160, 70)  # 70 columns: not whole blocks
    d = torch.randn(160, 32, dtype=torch.float64)  # whole blocks, but not float32
    assert gemm.pack(b) is b and gemm.pack(d) is d
    with pytest.raises(RuntimeError, match="a packed weight is"):
        mm(torch.randn(2, 160), torch.randn(4, 160, 8))
    w = torch.randn(160, 32)  # a packed double weight: torch.mm's numbers
    a = torch.randn(3, 160)
    torch.testing.assert_close(mm(a.double(), gemm.pack(w).double()), a.double() @ w.double())


def test_threads_do_not_change_the_bits():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 384, generator=g), torch.randn(384, 4096, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = mm(a, b)
        torch.set_num_threads(2)
        two = mm(a, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_views_other_dtypes_and_bad_shapes():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(40, 9, generator=g), torch.randn(9, 30, generator=g)
    torch.testing.assert_close(mm(a.t()[:, :5], b[:5]), a.t()[:, :5] @ b[:5])  # non-contiguous
    assert torch.equal(mm(a.double(), b.double()), a.double() @ b.double())  # torch.mm serves
    assert mm(torch.empty(0, 9), b).shape == (0, 30)
    assert torch.equal(mm(torch.empty(3, 0), torch.empty(0, 4)), torch.zeros(3, 4))
    with pytest.raises(RuntimeError, match="expected \\(M, K\\) @ \\(K, N\\)"):
        mm(a, a)


def test_the_operator_registration_is_sound():
    # schema, fake (meta) kernel against the real one, dispatch: what torch.compile relies on
    g = torch.Generator().manual_seed(2)
    torch.library.opcheck(torch.ops.nodraft.mm.default,
                          (torch.randn(5, 160, generator=g), torch.randn(160, 480, generator=g)),
                          test_utils=("test_schema", "test_faketensor"))
    packed = gemm.pack(torch.randn(160, 480, generator=g))
    torch.library.opcheck(torch.ops.nodraft.mm.default, (torch.randn(5, 160, generator=g), packed),
                          test_utils=("test_schema", "test_faketensor"))


def test_choose(monkeypatch):
    assert gemm.choose("auto") == "nodraft" and gemm.choose("torch") == "torch"
    monkeypatch.setenv("NODRAFT_GEMM", "torch")
    assert gemm.choose() == "torch"
    with pytest.raises(ValueError, match="gemm must be one of"):
        gemm.choose("mkl")
    assert gemm.matmul("torch") is torch.mm
