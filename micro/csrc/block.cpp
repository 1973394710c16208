// nodraft::block and nodraft::packed_block -- a pass through a range of micro's layers (and
// the final norm and head) in one call: ``block``, one sequence's block of T rows (a decode
// step, a draft's verification, a prompt's prefill: micro/compiled.py, ``run``);
// ``packed_block``, several sequences' blocks at once, each in its own KV slot (a batch's
// pass: ``CompiledPasses.packed_block``).
//
// A compiled graph of the same pass spends as long around its products as in them (buffer
// allocation, views, one dispatcher call per product and per fused loop); here the whole
// pass is C++: the products over every row at once by nodraft::mm's kernel (gemm.h), the
// norms, rotations, attention and SwiGLU in loops over scratch buffers each thread keeps.
//
//   h (T, C) float32: the block's residual stream before layer ``lo``;
//   pos (T,) int64: each row's rotary position (a tree's nodes at one depth share one);
//   cos, sin (P, D): the rotary tables (micro/ops.py, ``rope_tables``: sin's first half
//   negated, so a rotation is x * cos + roll(x, D / 2) * sin);
//   norms: per layer its attention norm's and feed-forward norm's weights (C,), then the
//   final norm's weight when there is a head;
//   mats: per layer wqkv (C, 3C), wo (C, C), w13 (C, 2F), w2 (F, C) in (in, out) layout,
//   (K, N) or packed as (N / 16, K, 16) (gemm.h), then the head (C, V) if any;
//   kc, vc (L, S, H, M, D) contiguous, float32 or float16 alike: the KV cache; the block's
//   keys and values are written to rows [start, start + T) of ``slot`` in layers [lo, lo +
//   n) (rounded to the nearest half in a float16 cache), and every row's attention reads
//   them back from there;
//   mask (T, T) additive or None: which of the block's rows each row sees besides the
//   cached rows [0, start) (None: causal).
//
// Returns the residual stream after the last layer (T, C) and the logits (T, V) (an empty
// tensor without a head). ``packed_block`` takes the same per segment (below).
//
// **Batch-invariant.** A row's every sum runs in one order whatever else the pass carries:
// the products are nodraft::mm's (one sum over k in order per element, whatever the row
// count), the norms and attention are per row, and a row attends to the rows it sees in
// the order they sit in its slot (its block's rows are written there first). So a token
// gives the same bits whether its pass is a lone decode step, a chain of drafts behind it,
// or a batch beside other sequences' blocks, and a tree node the same as the path it lies
// on, once accepted, would: speculative decoding equals plain decoding, and batched
// decoding lone decoding, bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "gemm.h"
#include "simd.h"

namespace {

using nodraft_simd::exp_sum;
using nodraft_simd::exp_nonpositive;
using nodraft_simd::lanes;
using nodraft_simd::load;
using nodraft_simd::store_scaled;
using nodraft_simd::sum;

// A cache row's element: float32, or IEEE half (``half_t``, its bits; F16C converts), which
// halves the bytes a batch's attention reads (a head's rows must then be whole vectors of 8)
using half_t = uint16_t;

// vector i of a cache row of NV vectors, as float32: the last under ``last`` (float32 rows;
// half rows are whole vectors)
template <int NV>
inline __m256 row_vector(const float* p, int i, __m256i last) {
  return load<NV>(p, i, last);
}
template <int NV>
inline __m256 row_vector(const half_t* p, int i, __m256i) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * i)));
}

// q . r over a cache row, q held in NV registers (``dot``'s order, either element)
template <int NV, typename KV>
inline float row_dot(const __m256 (&q)[NV], const KV* r, __m256i last) {
  __m256 acc = _mm256_mul_ps(q[0], row_vector<NV>(r, 0, last));
#pragma GCC unroll 16
  for (int i = 1; i < NV; ++i) acc = _mm256_fmadd_ps(q[i], row_vector<NV>(r, i, last), acc);
  return sum(acc);
}


constexpr int64_t kMaxVectors = 16;  // heads up to 128 wide
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// a thread's scratch: grown as needed, never shrunk (a server's passes reuse it)
struct Scratch {
  std::vector<float> f;
  float* get(size_t n) {
    if (f.size() < n) f.resize(n);
    return f.data();
  }
};

// y = x / sqrt(mean(x^2) + eps) * w, one row of C
inline void rms_norm(const float* x, const float* w, int64_t C, float eps, float* y) {
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= C; c += 8) {
    const __m256 v = _mm256_loadu_ps(x + c);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = sum(acc);
  for (; c < C; ++c) ss += x[c] * x[c];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(C) + eps);
  for (int64_t i = 0; i < C; ++i) y[i] = x[i] * r * w[i];
}

// x * cos + roll(x, D / 2) * sin, one head's D floats
inline void rotate(const float* x, const float* cos, const float* sin, int64_t D, float* y) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const int64_t e = d < half ? d + half : d - half;
    y[d] = x[d] * cos[d] + x[e] * sin[d];
  }
}

// silu(gate) * up over n floats: gate * sigmoid(gate), sigmoid from exp(-|gate|) (simd.h's
// exponential takes arguments <= 0)
inline void swiglu(const float* gate, const float* up, int64_t n, float* y) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp_nonpositive(_mm256_or_ps(g, sign));  // exp(-|g|)
    const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 sg = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), g);  // g < 0: e / (1 + e)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(g, sg), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) y[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// D floats into a cache row: copied, or rounded to the nearest half
inline void to_row(const float* x, int64_t D, float* y) { std::memcpy(y, x, D * sizeof(float)); }
inline void to_row(const float* x, int64_t D, half_t* y) {
  for (int64_t i = 0; i < D; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
}

// a key rotated into its cache row: straight in, or through ``scratch`` (D floats) rounded
inline void rotate_to_row(const float* x, const float* cos, const float* sin, int64_t D,
                          float* y, float*) {
  rotate(x, cos, sin, D, y);
}
inline void rotate_to_row(const float* x, const float* cos, const float* sin, int64_t D,
                          half_t* y, float* scratch) {
  rotate(x, cos, sin, D, scratch);
  to_row(scratch, D, y);
}

// One row's attention in one head: q (D,), over the cache rows [0, start) of k, v (M, D)
// and the block's rows start + j its ``mask`` row allows (null: j <= t), in cache order.
// ``s`` holds at least start + T + 8 floats, ``rows`` T.
//
// ``next_k``, ``next_v``: the next task's keys and values (``next_lines`` 64-byte lines
// each, or 0), hinted towards L2 a few lines per row as this one's rows are read: a slot's
// rows are a run of their own, far from the last one's, where the hardware prefetcher
// starts over. Spread, not in a burst at the task's start: hundreds of hints at once
// stalled the pass (docs/BENCHMARKS.md, "The attention's prefetch, spread over the rows").
template <int NV, typename KV>
void attend_row(const float* q, const KV* k, const KV* v, int64_t D, int64_t start,
                int64_t T, int64_t t, const float* mask, float scale, __m256i last, float* s,
                int64_t* rows, float* y, const char* next_k, const char* next_v,
                int64_t next_lines) {
  const int64_t per_row = (next_lines + start + T - 1) / std::max<int64_t>(1, start + T);
  auto ahead = [&](const char* p, int64_t row) {
    for (int64_t e = row * per_row, end = std::min(e + per_row, next_lines); e < end; ++e)
      _mm_prefetch(p + 64 * e, _MM_HINT_T1);
  };
  __m256 qv[NV];
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) qv[i] = _mm256_mul_ps(load<NV>(q, i, last), _mm256_set1_ps(scale));
  float top = kNegInf;
  for (int64_t r = 0; r < start; ++r) {
    ahead(next_k, r);
    s[r] = row_dot<NV>(qv, k + r * D, last);
    top = std::max(top, s[r]);
  }
  for (int64_t r = start; r < start + T; ++r) ahead(next_k, r);
  int64_t n = start, m = 0;
  for (int64_t j = 0; j < T; ++j) {
    const float add = mask ? mask[j] : (j <= t ? 0.0f : kNegInf);
    if (add == kNegInf) continue;
    const int64_t r = start + j;
    s[n] = row_dot<NV>(qv, k + r * D, last) + add;
    top = std::max(top, s[n]);
    rows[m++] = r;
    ++n;
  }
  const float total = exp_sum(s, n, top);
  __m256 acc[NV];
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    ahead(next_v, i);
    const __m256 p = _mm256_set1_ps(s[i]);
    const KV* vr = v + (i < start ? i : rows[i - start]) * D;
#pragma GCC unroll 16
    for (int u = 0; u < NV; ++u) acc[u] = _mm256_fmadd_ps(p, row_vector<NV>(vr, u, last), acc[u]);
  }
  for (int64_t i = n; i < start + T; ++i) ahead(next_v, i);
  store_scaled<NV>(acc, 1.0f / total, y, last);
}

template <typename KV>
using RowKernel = void (*)(const float*, const KV*, const KV*, int64_t, int64_t, int64_t,
                           int64_t, const float*, float, __m256i, float*, int64_t*, float*,
                           const char*, const char*, int64_t);

template <int NV, typename KV>
RowKernel<KV> pick(int64_t nv) {
  if constexpr (NV > kMaxVectors) {
    return nullptr;
  } else {
    return nv == NV ? &attend_row<NV, KV> : pick<NV + 1, KV>(nv);
  }
}

// a weight as gemm.h takes it: (pointer, K, N, packed)
struct Mat {
  const float* p;
  int64_t K, N;
  bool packed;
};

Mat mat(const at::Tensor& w, const char* what) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && (w.dim() == 2 || w.dim() == 3),
              "nodraft::block: ", what, " must be a contiguous float32 (K, N) or packed "
              "(N / 16, K, 16) weight, got ", w.sizes());
  if (w.dim() == 3) {
    TORCH_CHECK(w.size(2) == 16, "nodraft::block: a packed weight is (N / 16, K, 16), got ",
                w.sizes());
    return {w.data_ptr<float>(), w.size(1), w.size(0) * 16, true};
  }
  return {w.data_ptr<float>(), w.size(0), w.size(1), false};
}

// One sequence's rows in a pass: rows [off, off + T) of the pass, cache rows [start,
// start + T) of ``slot``; ``mask`` (T, T) additive or null (causal); logits or not.
struct Segment {
  int64_t off, T, slot, start;
  const float* mask;
  bool logits;
};

// The weights of layers [lo, lo + n) (and the head), checked against a width of C.
struct Weights {
  std::vector<const float*> norms;
  std::vector<Mat> mats;
  int64_t n = 0, F = 0, V = 0;
  bool head = false;
};

Weights weights(at::TensorList norms, at::TensorList mats, int64_t C) {
  Weights w;
  w.n = static_cast<int64_t>(mats.size()) / 4;
  w.head = static_cast<int64_t>(mats.size()) == 4 * w.n + 1;
  TORCH_CHECK(w.n >= 1 && static_cast<int64_t>(mats.size()) - 4 * w.n <= 1 &&
                  static_cast<int64_t>(norms.size()) == 2 * w.n + (w.head ? 1 : 0),
              "nodraft::block: expected 4 matrices and 2 norms a layer (and the head and the "
              "final norm), got ", mats.size(), " and ", norms.size());
  for (const at::Tensor& t : norms) {
    TORCH_CHECK(t.numel() == C && t.is_contiguous() && t.scalar_type() == at::kFloat,
                "nodraft::block: a norm's weight must be (", C, ",) float32");
    w.norms.push_back(t.data_ptr<float>());
  }
  for (const at::Tensor& t : mats) w.mats.push_back(mat(t, "a weight"));
  for (int64_t i = 0; i < w.n; ++i) {
    const Mat &qkv = w.mats[4 * i], &o = w.mats[4 * i + 1], &up = w.mats[4 * i + 2],
              &down = w.mats[4 * i + 3];
    w.F = down.K;
    TORCH_CHECK(qkv.K == C && qkv.N == 3 * C && o.K == C && o.N == C && up.K == C &&
                    up.N == 2 * w.F && down.N == C,
                "nodraft::block: layer ", i, "'s weights do not fit a width of ", C);
  }
  TORCH_CHECK(!w.head || w.mats.back().K == C, "nodraft::block: the head's input is not ", C,
              " wide");
  w.V = w.head ? w.mats.back().N : 0;
  return w;
}

// Layers [lo, lo + w.n) over the pass's N rows x (N, C), in place: every segment's keys and
// values written to its rows of the cache (L, S, H, M, D), each of its rows attending to
// its slot's rows [0, start) and the segment's rows its mask allows. Then, with the head,
// the logits of the segments that want them, their rows in order, into ``logits``.
template <typename KV>
void layers(float* px, int64_t N, int64_t C, const int64_t* pp, const std::vector<Segment>& segs,
            const Weights& w, KV* kcp, KV* vcp, int64_t S, int64_t H, int64_t M,
            int64_t D, int64_t lo, const float* pcos, const float* psin, float eps,
            float* logits) {
  const int64_t F = w.F;
  int64_t ctx = 0, T = 0;
  for (const Segment& g : segs) {
    ctx = std::max(ctx, g.start + g.T);
    T = std::max(T, g.T);
  }
  thread_local Scratch scratch;
  const int64_t widest = std::max<int64_t>(3 * C, 2 * F), FC = std::max(F, C);
  float* buf = scratch.get(static_cast<size_t>(N * (C + widest + C + C + FC)));
  float* xn = buf;                  // (N, C) a norm's output
  float* wide = xn + N * C;         // (N, 3C) q, k, v; (N, 2F) gate, up
  float* q = wide + N * widest;     // (N, C) rotated queries
  float* y = q + N * C;             // (N, C) attention's output; a product's
  float* act = y + N * C;           // (N, F) the SwiGLU's output; (N, C) a product's

  const int64_t nv = (D + 7) / 8;
  const RowKernel<KV> attend = pick<1, KV>(nv);
  const __m256i last = lanes(D - 8 * (nv - 1));
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // the attention's tasks: (segment, row, head), each ~start + t rows of D
  std::vector<int64_t> seg_of(N);
  for (size_t b = 0; b < segs.size(); ++b)
    for (int64_t t = 0; t < segs[b].T; ++t) seg_of[segs[b].off + t] = static_cast<int64_t>(b);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, 2 * ctx * D));

  for (int64_t i = 0; i < w.n; ++i) {
    const int64_t l = lo + i;
    const Mat &wqkv = w.mats[4 * i], &wo = w.mats[4 * i + 1], &w13 = w.mats[4 * i + 2],
              &w2 = w.mats[4 * i + 3];
    for (int64_t r = 0; r < N; ++r) rms_norm(px + r * C, w.norms[2 * i], C, eps, xn + r * C);
    nodraft_kernels::gemm(xn, N, C, wqkv.p, 3 * C, wqkv.packed, wide);
    for (const Segment& g : segs) {
      KV* kl = kcp + ((l * S + g.slot) * H) * M * D;  // (H, M, D)
      KV* vl = vcp + ((l * S + g.slot) * H) * M * D;
      for (int64_t t = 0; t < g.T; ++t) {
        const int64_t r = g.off + t;
        const float* row = wide + r * 3 * C;
        const float *ct = pcos + pp[r] * D, *st = psin + pp[r] * D;
        for (int64_t hh = 0; hh < H; ++hh) {
          rotate(row + hh * D, ct, st, D, q + r * C + hh * D);
          // scratch for a half row's key: y, which only the attention below writes
          rotate_to_row(row + C + hh * D, ct, st, D, kl + (hh * M + g.start + t) * D,
                        y + r * C + hh * D);
          to_row(row + 2 * C + hh * D, D, vl + (hh * M + g.start + t) * D);
        }
      }
    }
    at::parallel_for(0, N * H, grain, [&](int64_t a, int64_t b) {
      thread_local Scratch scores;
      thread_local std::vector<int64_t> picked;
      if (static_cast<int64_t>(picked.size()) < T) picked.resize(T);
      float* sc = scores.get(static_cast<size_t>(ctx + 8));
      for (int64_t task = a; task < b; ++task) {
        const int64_t r = task / H, hh = task % H;
        const Segment& g = segs[seg_of[r]];
        const int64_t t = r - g.off;
        const KV* kl = kcp + (((l * S + g.slot) * H) + hh) * M * D;
        const KV* vl = vcp + (((l * S + g.slot) * H) + hh) * M * D;
        const char *nk = nullptr, *nv = nullptr;  // the next task's rows, if any
        int64_t lines = 0;
        if (task + 1 < b) {
          const int64_t r1 = (task + 1) / H, h1 = (task + 1) % H;
          const Segment& g1 = segs[seg_of[r1]];
          const int64_t o1 = (((l * S + g1.slot) * H) + h1) * M * D;
          nk = reinterpret_cast<const char*>(kcp + o1);
          nv = reinterpret_cast<const char*>(vcp + o1);
          lines = ((g1.start + g1.T) * D * static_cast<int64_t>(sizeof(KV)) + 63) / 64;
        }
        attend(q + r * C + hh * D, kl, vl, D, g.start, g.T, t,
               g.mask ? g.mask + t * g.T : nullptr, scale, last, sc, picked.data(),
               y + r * C + hh * D, nk, nv, lines);
      }
    });
    nodraft_kernels::gemm(y, N, C, wo.p, C, wo.packed, act);
    for (int64_t e = 0; e < N * C; ++e) px[e] += act[e];
    for (int64_t r = 0; r < N; ++r) rms_norm(px + r * C, w.norms[2 * i + 1], C, eps, xn + r * C);
    nodraft_kernels::gemm(xn, N, C, w13.p, 2 * F, w13.packed, wide);
    for (int64_t r = 0; r < N; ++r) swiglu(wide + r * 2 * F, wide + r * 2 * F + F, F, act + r * F);
    nodraft_kernels::gemm(act, N, F, w2.p, C, w2.packed, y);
    for (int64_t e = 0; e < N * C; ++e) px[e] += y[e];
  }
  if (!w.head) return;
  int64_t R = 0;  // the rows that want logits, gathered (normed) in order
  for (const Segment& g : segs) {
    if (!g.logits) continue;
    for (int64_t t = 0; t < g.T; ++t, ++R)
      rms_norm(px + (g.off + t) * C, w.norms[2 * w.n], C, eps, xn + R * C);
  }
  const Mat& wh = w.mats.back();
  nodraft_kernels::gemm(xn, R, C, wh.p, w.V, wh.packed, logits);
}

struct Cache {
  int64_t L, S, H, M, D;
  bool half;  // float16 rows (else float32)
};

Cache check_cache(const at::Tensor& kc, const at::Tensor& vc, int64_t C) {
  const bool half = kc.scalar_type() == at::kHalf;
  TORCH_CHECK(kc.dim() == 5 && vc.sizes() == kc.sizes() && kc.is_contiguous() &&
                  vc.is_contiguous() && vc.scalar_type() == kc.scalar_type() &&
                  (half || kc.scalar_type() == at::kFloat),
              "nodraft::block: kc, vc must be contiguous float32 or float16 (L, S, H, M, D) "
              "alike, got ", kc.sizes(), " ", kc.scalar_type(), ", ", vc.sizes(), " ",
              vc.scalar_type());
  const Cache c{kc.size(0), kc.size(1), kc.size(2), kc.size(3), kc.size(4), half};
  TORCH_CHECK(c.H * c.D == C, "nodraft::block: ", c.H, " heads of ", c.D, " are not the width ", C);
  TORCH_CHECK(c.D >= 2 && c.D % 2 == 0 && c.D <= 8 * kMaxVectors, "nodraft::block: head size ",
              c.D, " not even or outside [2, ", 8 * kMaxVectors, "]");
  TORCH_CHECK(!half || c.D % 8 == 0, "nodraft::block: a float16 cache needs a head size that "
              "is a multiple of 8, got ", c.D);
  return c;
}

const int64_t* positions(const at::Tensor& pos, int64_t N, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t D) {
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == N, "nodraft::block: pos must be (", N,
              ",), got ", pos.sizes());
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes() &&
                  cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "nodraft::block: cos, sin must be contiguous float32 (P, ", D, ") alike");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < N; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0), "nodraft::block: position ", pp[t],
                " outside the rotary tables' ", cos.size(0));
  return pp;
}

std::tuple<at::Tensor, at::Tensor> packed_block(
    const at::Tensor& h_in, const at::Tensor& pos_in, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList norms, at::TensorList mats, at::Tensor& kc, at::Tensor& vc,
    at::IntArrayRef lengths, at::IntArrayRef slots, at::IntArrayRef starts,
    const c10::List<std::optional<at::Tensor>>& masks, at::IntArrayRef want, int64_t lo,
    double eps);

// nodraft::block: one sequence's block, a batch of one (its mask None: causal)
std::tuple<at::Tensor, at::Tensor> block(const at::Tensor& h_in, const at::Tensor& pos_in,
                                         const at::Tensor& cos, const at::Tensor& sin,
                                         at::TensorList norms, at::TensorList mats,
                                         at::Tensor& kc, at::Tensor& vc, int64_t slot,
                                         int64_t start, int64_t lo,
                                         const std::optional<at::Tensor>& mask_in, double eps) {
  TORCH_CHECK(h_in.dim() == 2, "nodraft::block: h must be (T, C), got ", h_in.sizes());
  const std::vector<int64_t> lengths{h_in.size(0)}, slots{slot}, starts{start}, want{1};
  c10::List<std::optional<at::Tensor>> masks;
  masks.push_back(mask_in);
  return packed_block(h_in, pos_in, cos, sin, norms, mats, kc, vc, lengths, slots, starts,
                      masks, want, lo, eps);
}

// nodraft::chain: a lone sequence's chain of tokens -- a decode step's one token, or its
// last token and a chain of drafts -- from their ids: their rows of ``emb`` (V, C), at
// consecutive positions from ``start``, causal, through every layer given and the head.
// What ``block`` computes over ``torch.embedding(emb, ids)`` at those positions (the same
// rows copied, the same sums: the same bits), without a tensor of ids, one of positions and
// the embedding's own call around it, which a decode step otherwise makes for one token.
std::tuple<at::Tensor, at::Tensor> chain(at::IntArrayRef ids, const at::Tensor& emb,
                                         const at::Tensor& cos, const at::Tensor& sin,
                                         at::TensorList norms, at::TensorList mats,
                                         at::Tensor& kc, at::Tensor& vc, int64_t slot,
                                         int64_t start, double eps) {
  TORCH_CHECK(emb.dim() == 2 && emb.scalar_type() == at::kFloat && emb.is_contiguous(),
              "nodraft::chain: emb must be a contiguous float32 (V, C) table, got ",
              emb.sizes(), " ", emb.scalar_type());
  const int64_t T = static_cast<int64_t>(ids.size()), V = emb.size(0), C = emb.size(1);
  TORCH_CHECK(T >= 1, "nodraft::chain: no ids");
  at::Tensor h = at::empty({T, C}, emb.options());
  at::Tensor pos = at::empty({T}, emb.options().dtype(at::kLong));
  const float* pe = emb.data_ptr<float>();
  float* ph = h.data_ptr<float>();
  int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(ids[t] >= 0 && ids[t] < V, "nodraft::chain: token id ", ids[t],
                " outside the table's ", V);
    std::memcpy(ph + t * C, pe + ids[t] * C, C * sizeof(float));
    pp[t] = start + t;
  }
  return block(h, pos, cos, sin, norms, mats, kc, vc, slot, start, 0, std::nullopt, eps);
}

// nodraft::packed_block: several sequences' blocks in one pass through every layer given
// and the head: the products over all their rows at once, each block's attention over its
// own slot. ``lengths``, ``slots``, ``starts``: each segment's rows (in order in h), slot
// and first cache row; ``masks``: each one's (T, T) additive mask or None (causal);
// ``logits``: whether its rows get logits. Returns the final residual stream (N, C) and the
// logits of the segments that want them, their rows in order.
std::tuple<at::Tensor, at::Tensor> packed_block(
    const at::Tensor& h_in, const at::Tensor& pos_in, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList norms, at::TensorList mats, at::Tensor& kc, at::Tensor& vc,
    at::IntArrayRef lengths, at::IntArrayRef slots, at::IntArrayRef starts,
    const c10::List<std::optional<at::Tensor>>& masks, at::IntArrayRef want, int64_t lo,
    double eps) {
  TORCH_CHECK(h_in.dim() == 2 && h_in.scalar_type() == at::kFloat,
              "nodraft::block: h must be (N, C) float32, got ", h_in.sizes(), " ",
              h_in.scalar_type());
  const int64_t N = h_in.size(0), C = h_in.size(1);
  const Cache c = check_cache(kc, vc, C);
  const Weights w = weights(norms, mats, C);
  const size_t B = lengths.size();
  TORCH_CHECK(slots.size() == B && starts.size() == B && masks.size() == B && want.size() == B,
              "nodraft::block: lengths, slots, starts, masks and logits must be alike long");
  TORCH_CHECK(lo >= 0 && lo + w.n <= c.L, "nodraft::block: layers [", lo, ", ", lo + w.n,
              ") outside the cache's ", c.L);
  std::vector<Segment> segs;
  std::vector<at::Tensor> kept;  // the masks as float32, contiguous, alive for the call
  std::vector<bool> used(c.S, false);
  int64_t off = 0, R = 0;
  for (size_t b = 0; b < B; ++b) {
    const int64_t T = lengths[b], slot = slots[b], start = starts[b];
    TORCH_CHECK(T >= 1 && slot >= 0 && slot < c.S && !used[slot] && start >= 0 &&
                    start + T <= c.M,
                "nodraft::block: segment ", b, ": slot ", slot, ", rows [", start, ", ",
                start + T, ") outside the cache's (", c.S, ", ", c.M, ") or its slot taken twice");
    used[slot] = true;
    const float* pm = nullptr;
    const std::optional<at::Tensor> m = masks.get(b);
    if (m.has_value()) {
      kept.push_back(m->to(at::kFloat).contiguous());
      TORCH_CHECK(kept.back().dim() == 2 && kept.back().size(0) == T && kept.back().size(1) == T,
                  "nodraft::block: segment ", b, "'s mask must be (", T, ", ", T, "), got ",
                  kept.back().sizes());
      pm = kept.back().data_ptr<float>();
    }
    segs.push_back({off, T, slot, start, pm, want[b] != 0});
    off += T;
    if (want[b]) R += T;
  }
  TORCH_CHECK(off == N, "nodraft::block: the segments' lengths add up to ", off, ", not ", N);
  const at::Tensor pos = pos_in.to(at::kLong).contiguous();
  const int64_t* pp = positions(pos, N, cos, sin, c.D);
  at::Tensor x = h_in.contiguous().clone();
  at::Tensor logits = at::empty({w.head ? R : 0, w.V}, x.options());
  auto run = [&](auto* k, auto* v) {  // over the cache's element
    layers(x.data_ptr<float>(), N, C, pp, segs, w, k, v, c.S, c.H, c.M, c.D, lo,
           cos.data_ptr<float>(), sin.data_ptr<float>(), static_cast<float>(eps),
           w.head ? logits.data_ptr<float>() : nullptr);
  };
  if (N > 0 && c.half)
    run(reinterpret_cast<half_t*>(kc.data_ptr<at::Half>()),
        reinterpret_cast<half_t*>(vc.data_ptr<at::Half>()));
  else if (N > 0)
    run(kc.data_ptr<float>(), vc.data_ptr<float>());
  return {x, logits};
}

// nodraft::head: the final norm and the head over rows h (T, C) between passes (a prompt's
// last row once its prefill is done): norm (C,), head (C, V) or packed (V / 16, C, 16) --
// the matrix a pass's head reads (so it is in the caches after a batch's pass), the same
// sums, so the same bits as a pass's head gives those rows.
at::Tensor head(const at::Tensor& h_in, const at::Tensor& norm, const at::Tensor& head_w,
                double eps) {
  TORCH_CHECK(h_in.dim() == 2 && h_in.scalar_type() == at::kFloat,
              "nodraft::head: h must be (T, C) float32, got ", h_in.sizes(), " ",
              h_in.scalar_type());
  const int64_t T = h_in.size(0), C = h_in.size(1);
  TORCH_CHECK(norm.numel() == C && norm.is_contiguous() && norm.scalar_type() == at::kFloat,
              "nodraft::head: the norm's weight must be (", C, ",) float32");
  const Mat wh = mat(head_w, "the head");
  TORCH_CHECK(wh.K == C, "nodraft::head: the head's input is not ", C, " wide");
  const at::Tensor x = h_in.contiguous();
  at::Tensor xn = at::empty({T, C}, x.options());
  at::Tensor logits = at::empty({T, wh.N}, x.options());
  const float *px = x.data_ptr<float>(), *pw = norm.data_ptr<float>();
  float* pn = xn.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) rms_norm(px + t * C, pw, C, static_cast<float>(eps), pn + t * C);
  if (T > 0) nodraft_kernels::gemm(pn, T, C, wh.p, wh.N, wh.packed, logits.data_ptr<float>());
  return logits;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nodraft, m) {
  m.def("head(Tensor h, Tensor norm, Tensor head, float eps) -> Tensor");
  m.def("block(Tensor h, Tensor pos, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] mats, "
        "Tensor(a!) kc, Tensor(b!) vc, int slot, int start, int lo, Tensor? mask, float eps) "
        "-> (Tensor, Tensor)");
  m.def("chain(int[] ids, Tensor emb, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] mats, "
        "Tensor(a!) kc, Tensor(b!) vc, int slot, int start, float eps) -> (Tensor, Tensor)");
  m.def("packed_block(Tensor h, Tensor pos, Tensor cos, Tensor sin, Tensor[] norms, "
        "Tensor[] mats, Tensor(a!) kc, Tensor(b!) vc, int[] lengths, int[] slots, "
        "int[] starts, Tensor?[] masks, int[] logits, int lo, float eps) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(nodraft, CPU, m) {
  m.impl("head", &head);
  m.impl("block", &block);
  m.impl("chain", &chain);
  m.impl("packed_block", &packed_block);
}
