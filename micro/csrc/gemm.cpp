// nodraft::mm -- C = A @ B for the few rows a decode or verification pass carries.
//
// A (M, K) float32, row-major; B a weight in (in, out) layout: (K, N) row-major, or packed
// as (N / 16, K, 16), each block of 16 columns contiguous (micro/gemm.py, ``pack``). A
// tile of a few rows by a block of columns keeps its sums in vector registers while it
// walks k = 0 .. K-1 once, reading each row of the block's B columns once for all of its
// rows. MKL's sgemm, tuned for large M, costs ~2x more than this at 2-5 rows on micro's
// shapes (benchmarks/passes.py; micro/gemm.py has the figures). Two builds:
//
// - AVX-512 (-mavx512f): tiles of up to 6 rows by 64 columns, 24 registers of sums;
// - AVX2 (-mavx2 -mfma): tiles of up to 6 rows by 16 columns, 12 registers of sums.
//
// Read from a (K, N) weight, each k of a tile's block is a piece of a row N floats long: a
// stride the hardware prefetcher does not follow across pages, so a weight not in cache is
// read at memory latency. Packed, each 16-column block is K * 64 contiguous bytes, read in
// order (the AVX-512 tile reads its four blocks as four such streams).
//
// Every C element is one sum over k in order 0 .. K-1 (one fused multiply-add per k),
// whatever M is, however the columns are split between threads: a row's result does not
// depend on the other rows of the call. So a token's products are bit-identical whether
// it is verified alone or in a block of drafted tokens.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>

#include "gemm.h"
#include "simd.h"

namespace {

#ifdef __AVX512F__

// The sums live in MR x NV registers: a one-dimensional array, fully unrolled -- GCC 12
// keeps a two-dimensional one on the stack and stores it back every k (2x slower at 2 rows).
// Vector v of row k of B's block is at b + v * vs + k * ldb: (K, N) row-major, vs 16 and
// ldb N; packed, vs K * 16 and ldb 16 (four streams read in order).
template <int MR, int NV>
inline void tile(const float* a, int64_t K, const float* b, int64_t ldb, int64_t vs, float* c,
                 int64_t N, __mmask16 last) {
  __m512 acc[MR * NV];
#pragma GCC unroll 32
  for (int i = 0; i < MR * NV; ++i) acc[i] = _mm512_setzero_ps();
  const float* bv0[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) bv0[v] = b + v * vs;
  for (int64_t k = 0; k < K; ++k) {
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) bv[v] = _mm512_loadu_ps(bv0[v] + k * ldb);
    bv[NV - 1] = _mm512_maskz_loadu_ps(last, bv0[NV - 1] + k * ldb);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 av = _mm512_set1_ps(a[m * K + k]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[m * NV + v] = _mm512_fmadd_ps(av, bv[v], acc[m * NV + v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) _mm512_storeu_ps(c + m * N + 16 * v, acc[m * NV + v]);
    _mm512_mask_storeu_ps(c + m * N + 16 * (NV - 1), last, acc[m * NV + NV - 1]);
  }
}

template <int NV>
void rows(int64_t mr, const float* a, int64_t K, const float* b, int64_t ldb, int64_t vs,
          float* c, int64_t N, __mmask16 last) {
  switch (mr) {
    case 6: tile<6, NV>(a, K, b, ldb, vs, c, N, last); break;
    case 5: tile<5, NV>(a, K, b, ldb, vs, c, N, last); break;
    case 4: tile<4, NV>(a, K, b, ldb, vs, c, N, last); break;
    case 3: tile<3, NV>(a, K, b, ldb, vs, c, N, last); break;
    case 2: tile<2, NV>(a, K, b, ldb, vs, c, N, last); break;
    default: tile<1, NV>(a, K, b, ldb, vs, c, N, last); break;
  }
}

// One block of columns for all M rows: ceil(M / 6) tiles of near-equal height (7 rows as
// 4 + 3, not 6 + 1: a short tile reads the block's weights for too few rows).
template <int NV>
void column(const float* a, int64_t M, int64_t K, const float* b, int64_t ldb, int64_t vs,
            float* c, int64_t N, __mmask16 last) {
  const int64_t tiles = (M + 5) / 6;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t mr = (M - m) / (tiles - t);
    rows<NV>(mr, a + m * K, K, b, ldb, vs, c + m * N, N, last);
    m += mr;
  }
}

#else  // AVX2

constexpr int64_t W = 16;  // columns per block: two vectors of 8

using nodraft_simd::lanes;

// MR rows by NV vectors of columns; B's rows are ldb floats apart, C's N
template <int MR, int NV>
inline void tile(const float* a, int64_t K, const float* b, int64_t ldb, float* c, int64_t N,
                 __m256i last) {
  __m256 acc[MR * NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR * NV; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = b + k * ldb;
    __m256 bv[NV];
    if constexpr (NV == 2) bv[0] = _mm256_loadu_ps(bk);
    bv[NV - 1] = _mm256_maskload_ps(bk + 8 * (NV - 1), last);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 av = _mm256_broadcast_ss(a + m * K + k);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[m * NV + v] = _mm256_fmadd_ps(av, bv[v], acc[m * NV + v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    if constexpr (NV == 2) _mm256_storeu_ps(c + m * N, acc[m * NV]);
    _mm256_maskstore_ps(c + m * N + 8 * (NV - 1), last, acc[m * NV + NV - 1]);
  }
}

template <int NV>
void rows(int64_t mr, const float* a, int64_t K, const float* b, int64_t ldb, float* c,
          int64_t N, __m256i last) {
  switch (mr) {
    case 6: tile<6, NV>(a, K, b, ldb, c, N, last); break;
    case 5: tile<5, NV>(a, K, b, ldb, c, N, last); break;
    case 4: tile<4, NV>(a, K, b, ldb, c, N, last); break;
    case 3: tile<3, NV>(a, K, b, ldb, c, N, last); break;
    case 2: tile<2, NV>(a, K, b, ldb, c, N, last); break;
    default: tile<1, NV>(a, K, b, ldb, c, N, last); break;
  }
}

// One block of columns for all M rows: ceil(M / 6) tiles of near-equal height.
template <int NV>
void column(const float* a, int64_t M, int64_t K, const float* b, int64_t ldb, float* c,
            int64_t N, __m256i last) {
  const int64_t tiles = (M + 5) / 6;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t mr = (M - m) / (tiles - t);
    rows<NV>(mr, a + m * K, K, b, ldb, c + m * N, N, last);
    m += mr;
  }
}

// MR rows by G whole packed blocks (each K * W contiguous floats, ``bs`` apart): the same
// sums as ``tile`` over each block, in the same order, but MR * G * 2 of them in flight. A
// sum's every multiply-add waits on the one before it, so one row by one block (two sums)
// runs at one k per multiply-add latency; four blocks keep both FMA units busy and the
// loads, not the latency, set the pace.
template <int MR, int G>
inline void wide(const float* a, int64_t K, const float* b, int64_t bs, float* c, int64_t N) {
  __m256 acc[MR * G * 2];
#pragma GCC unroll 16
  for (int i = 0; i < MR * G * 2; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 av[MR];
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) av[m] = _mm256_broadcast_ss(a + m * K + k);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const float* bk = b + g * bs + k * W;
      const __m256 b0 = _mm256_loadu_ps(bk), b1 = _mm256_loadu_ps(bk + 8);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        acc[(m * G + g) * 2] = _mm256_fmadd_ps(av[m], b0, acc[(m * G + g) * 2]);
        acc[(m * G + g) * 2 + 1] = _mm256_fmadd_ps(av[m], b1, acc[(m * G + g) * 2 + 1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      _mm256_storeu_ps(c + m * N + g * W, acc[(m * G + g) * 2]);
      _mm256_storeu_ps(c + m * N + g * W + 8, acc[(m * G + g) * 2 + 1]);
    }
  }
}

// how many whole packed blocks ``wide`` takes at once for M rows (0: ``tile`` serves)
constexpr int64_t wide_blocks(int64_t M) { return M == 1 ? 4 : M <= 3 ? 2 : 0; }
#endif

}  // namespace

namespace nodraft_kernels {

void gemm(const float* pa, int64_t M, int64_t K, const float* pb, int64_t N, bool packed,
          float* pc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    std::fill(pc, pc + M * N, 0.0f);
    return;
  }
#ifdef __AVX512F__
  const int64_t blocks = (N + 63) / 64;
  // at least ~256K multiply-adds per task: small products stay on the calling thread
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, M * K * 64));
  at::parallel_for(0, blocks, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      const int64_t n0 = j * 64, w = std::min<int64_t>(64, N - n0);
      const int64_t nv = (w + 15) / 16, tail = w - 16 * (nv - 1);
      const __mmask16 last = static_cast<__mmask16>(tail == 16 ? 0xFFFF : (1u << tail) - 1);
      // packed: the block's four 16-column pieces, each K * 16 contiguous floats
      const float* bj = packed ? pb + n0 * K : pb + n0;
      const int64_t ldb = packed ? 16 : N, vs = packed ? K * 16 : 16;
      switch (nv) {
        case 4: column<4>(pa, M, K, bj, ldb, vs, pc + n0, N, last); break;
        case 3: column<3>(pa, M, K, bj, ldb, vs, pc + n0, N, last); break;
        case 2: column<2>(pa, M, K, bj, ldb, vs, pc + n0, N, last); break;
        default: column<1>(pa, M, K, bj, ldb, vs, pc + n0, N, last); break;
      }
    }
  });
#else
  const int64_t blocks = (N + W - 1) / W;
  // a few rows of a packed weight: its whole blocks G at a time (``wide``), the rest below
  int64_t first = 0;
  if (const int64_t G = packed ? wide_blocks(M) : 0; G && N / W >= G) {
    const int64_t groups = N / W / G;
    first = groups * G;
    const int64_t grain =
        std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, M * K * W * G));
    at::parallel_for(0, groups, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t j = lo; j < hi; ++j) {
        const float* bj = pb + j * G * K * W;
        float* cj = pc + j * G * W;
        switch (M) {
          case 1: wide<1, 4>(pa, K, bj, K * W, cj, N); break;
          case 2: wide<2, 2>(pa, K, bj, K * W, cj, N); break;
          default: wide<3, 2>(pa, K, bj, K * W, cj, N); break;
        }
      }
    });
  }
  if (first == blocks) return;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, M * K * W));
  at::parallel_for(first, blocks, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      const int64_t n0 = j * W, w = std::min<int64_t>(W, N - n0);
      const int64_t nv = (w + 7) / 8;
      const __m256i last = lanes(w - 8 * (nv - 1));
      const float* bj = packed ? pb + j * K * W : pb + n0;  // block j's first row
      const int64_t ldb = packed ? W : N;
      if (nv == 2) column<2>(pa, M, K, bj, ldb, pc + n0, N, last);
      else column<1>(pa, M, K, bj, ldb, pc + n0, N, last);
    }
  });
#endif
}

}  // namespace nodraft_kernels

namespace {

at::Tensor mm(const at::Tensor& a_in, const at::Tensor& b_in) {
  const bool packed = b_in.dim() == 3;
  TORCH_CHECK(a_in.dim() == 2 && (b_in.dim() == 2 || packed) &&
                  a_in.size(1) == b_in.size(packed ? 1 : 0),
              "nodraft::mm: expected (M, K) @ (K, N), got ", a_in.sizes(), " @ ", b_in.sizes());
  TORCH_CHECK(!packed || b_in.size(2) == 16, "nodraft::mm: a packed weight is (N / 16, K, 16), got ",
              b_in.sizes());
  if (packed && (a_in.scalar_type() != at::kFloat || b_in.scalar_type() != at::kFloat))
    return at::mm(a_in, b_in.permute({1, 0, 2}).reshape({b_in.size(1), -1}));
  if (a_in.scalar_type() != at::kFloat || b_in.scalar_type() != at::kFloat)
    return at::mm(a_in, b_in);
  const at::Tensor a = a_in.contiguous();
  const at::Tensor b = b_in.contiguous();
  const int64_t M = a.size(0), K = a.size(1);
  const int64_t N = packed ? b.size(0) * b.size(2) : b.size(1);
  at::Tensor c = at::empty({M, N}, a.options());
  nodraft_kernels::gemm(a.data_ptr<float>(), M, K, b.data_ptr<float>(), N, packed,
                        c.data_ptr<float>());
  return c;
}

}  // namespace

TORCH_LIBRARY(nodraft, m) { m.def("mm(Tensor a, Tensor b) -> Tensor"); }
TORCH_LIBRARY_IMPL(nodraft, CPU, m) { m.impl("mm", &mm); }
