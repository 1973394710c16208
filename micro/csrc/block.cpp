// nodraft::block -- one sequence's block of T rows through a range of micro's layers (and the
// final norm and head), in one call: what a decode step, a draft's verification and a
// short prompt's prefill run when one sequence is alone (micro/compiled.py, ``run``).
//
// A compiled graph of the same pass spends as long around its products as in them (buffer
// allocation, views, one dispatcher call per product and per fused loop); here the whole
// pass is C++: the products by nodraft::mm's kernel (gemm.h), the norms, rotations,
// attention and SwiGLU in loops over scratch buffers the thread keeps.
//
//   h (T, C) float32: the block's residual stream before layer ``lo``;
//   pos (T,) int64: each row's rotary position (a tree's nodes at one depth share one);
//   cos, sin (P, D): the rotary tables (micro/ops.py, ``rope_tables``: sin's first half
//   negated, so a rotation is x * cos + roll(x, D / 2) * sin);
//   norms: per layer its attention norm's and feed-forward norm's weights (C,), then the
//   final norm's weight when there is a head;
//   mats: per layer wqkv (C, 3C), wo (C, C), w13 (C, 2F), w2 (F, C) in (in, out) layout
//   (on the AVX2 build packed as (N / 16, K, 16), gemm.h), then the head (C, V) if any;
//   kc, vc (L, S, H, M, D) contiguous: the KV cache; the block's keys and values are
//   written to rows [start, start + T) of ``slot`` in layers [lo, lo + n);
//   mask (T, T) additive or None: which of the block's rows each row sees besides the
//   cached rows [0, start) (None: causal).
//
// Returns the residual stream after the last layer (T, C) and the logits (T, V) (an empty
// tensor without a head).
//
// **Batch-invariant.** A row's every sum runs in one order whatever T is: the products are
// nodraft::mm's (one sum over k in order per element), the norms and attention are per
// row, and a row attends to the rows it sees in the order they sit in the cache (its
// block's rows are written there first). So a token gives the same bits whether its pass
// is a lone decode step or a chain of drafts behind it, and a tree node the same as the
// path it lies on, once accepted, would: speculative decoding of a lone sequence equals
// plain decoding bit for bit.
#include <ATen/ATen.h>
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

using nodraft_simd::exp_nonpositive;
using nodraft_simd::lanes;
using nodraft_simd::sum;

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

template <int NV>
inline __m256 load(const float* p, int i, __m256i last) {
  return i < NV - 1 ? _mm256_loadu_ps(p + 8 * i) : _mm256_maskload_ps(p + 8 * i, last);
}

template <int NV>
inline float dot(const __m256 (&q)[NV], const float* r, __m256i last) {
  __m256 acc = _mm256_mul_ps(q[0], load<NV>(r, 0, last));
#pragma GCC unroll 16
  for (int i = 1; i < NV; ++i) acc = _mm256_fmadd_ps(q[i], load<NV>(r, i, last), acc);
  return sum(acc);
}

// One row's attention in one head: q (D,), over the cache rows [0, start) of k, v (M, D)
// and the block's rows start + j its ``mask`` row allows (null: j <= t), in cache order.
// ``s`` holds at least start + T + 8 floats, ``rows`` T.
template <int NV>
void attend_row(const float* q, const float* k, const float* v, int64_t D, int64_t start,
                int64_t T, int64_t t, const float* mask, float scale, __m256i last, float* s,
                int64_t* rows, float* y) {
  __m256 qv[NV];
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) qv[i] = _mm256_mul_ps(load<NV>(q, i, last), _mm256_set1_ps(scale));
  float top = kNegInf;
  for (int64_t r = 0; r < start; ++r) {
    s[r] = dot<NV>(qv, k + r * D, last);
    top = std::max(top, s[r]);
  }
  int64_t n = start, m = 0;
  for (int64_t j = 0; j < T; ++j) {
    const float add = mask ? mask[j] : (j <= t ? 0.0f : kNegInf);
    if (add == kNegInf) continue;
    const int64_t r = start + j;
    s[n] = dot<NV>(qv, k + r * D, last) + add;
    top = std::max(top, s[n]);
    rows[m++] = r;
    ++n;
  }
  const int64_t padded = (n + 7) / 8 * 8;
  std::fill(s + n, s + padded, kNegInf);  // exp: 0
  const __m256 vtop = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (int64_t i = 0; i < padded; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), vtop));
    _mm256_storeu_ps(s + i, e);
    total = _mm256_add_ps(total, e);
  }
  __m256 acc[NV];
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const __m256 p = _mm256_set1_ps(s[i]);
    const float* vr = v + (i < start ? i : rows[i - start]) * D;
#pragma GCC unroll 16
    for (int u = 0; u < NV; ++u) acc[u] = _mm256_fmadd_ps(p, load<NV>(vr, u, last), acc[u]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / sum(total));
#pragma GCC unroll 16
  for (int u = 0; u < NV - 1; ++u) _mm256_storeu_ps(y + 8 * u, _mm256_mul_ps(acc[u], inv));
  _mm256_maskstore_ps(y + 8 * (NV - 1), last, _mm256_mul_ps(acc[NV - 1], inv));
}

using RowKernel = void (*)(const float*, const float*, const float*, int64_t, int64_t, int64_t,
                           int64_t, const float*, float, __m256i, float*, int64_t*, float*);

template <int NV>
RowKernel pick(int64_t nv) {
  if constexpr (NV > kMaxVectors) {
    return nullptr;
  } else {
    return nv == NV ? &attend_row<NV> : pick<NV + 1>(nv);
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
#ifdef __AVX512F__
  TORCH_CHECK(w.dim() == 2, "nodraft::block: packed weights are the AVX2 build's");
#endif
  if (w.dim() == 3) {
    TORCH_CHECK(w.size(2) == 16, "nodraft::block: a packed weight is (N / 16, K, 16), got ",
                w.sizes());
    return {w.data_ptr<float>(), w.size(1), w.size(0) * 16, true};
  }
  return {w.data_ptr<float>(), w.size(0), w.size(1), false};
}

std::tuple<at::Tensor, at::Tensor> block(const at::Tensor& h_in, const at::Tensor& pos_in,
                                         const at::Tensor& cos, const at::Tensor& sin,
                                         at::TensorList norms, at::TensorList mats,
                                         at::Tensor& kc, at::Tensor& vc, int64_t slot,
                                         int64_t start, int64_t lo,
                                         const std::optional<at::Tensor>& mask_in, double eps) {
  TORCH_CHECK(h_in.dim() == 2 && h_in.scalar_type() == at::kFloat,
              "nodraft::block: h must be (T, C) float32, got ", h_in.sizes(), " ",
              h_in.scalar_type());
  const int64_t T = h_in.size(0), C = h_in.size(1);
  TORCH_CHECK(kc.dim() == 5 && vc.sizes() == kc.sizes() && kc.is_contiguous() &&
                  vc.is_contiguous() && kc.scalar_type() == at::kFloat &&
                  vc.scalar_type() == at::kFloat,
              "nodraft::block: kc, vc must be contiguous float32 (L, S, H, M, D) alike, got ",
              kc.sizes(), ", ", vc.sizes());
  const int64_t L = kc.size(0), S = kc.size(1), H = kc.size(2), M = kc.size(3), D = kc.size(4);
  TORCH_CHECK(H * D == C, "nodraft::block: ", H, " heads of ", D, " are not the width ", C);
  TORCH_CHECK(D >= 2 && D % 2 == 0 && D <= 8 * kMaxVectors,
              "nodraft::block: head size ", D, " not even or outside [2, ", 8 * kMaxVectors, "]");
  const int64_t n = static_cast<int64_t>(mats.size()) / 4;
  const bool head = static_cast<int64_t>(mats.size()) == 4 * n + 1;
  TORCH_CHECK(n >= 1 && static_cast<int64_t>(mats.size()) - 4 * n <= 1 &&
                  static_cast<int64_t>(norms.size()) == 2 * n + (head ? 1 : 0),
              "nodraft::block: expected 4 matrices and 2 norms a layer (and the head and the "
              "final norm), got ", mats.size(), " and ", norms.size());
  TORCH_CHECK(lo >= 0 && lo + n <= L && slot >= 0 && slot < S && start >= 0 && T >= 1 &&
                  start + T <= M,
              "nodraft::block: layers [", lo, ", ", lo + n, "), slot ", slot, ", rows [", start,
              ", ", start + T, ") outside the cache's (", L, ", ", S, ", ", M, ")");
  TORCH_CHECK(pos_in.dim() == 1 && pos_in.size(0) == T, "nodraft::block: pos must be (", T,
              ",), got ", pos_in.sizes());
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes() &&
                  cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "nodraft::block: cos, sin must be contiguous float32 (P, ", D, ") alike");
  const at::Tensor pos = pos_in.to(at::kLong).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0), "nodraft::block: position ", pp[t],
                " outside the rotary tables' ", cos.size(0));
  at::Tensor mask;
  if (mask_in.has_value()) {
    mask = mask_in->to(at::kFloat).contiguous();
    TORCH_CHECK(mask.dim() == 2 && mask.size(0) == T && mask.size(1) == T,
                "nodraft::block: mask must be (", T, ", ", T, "), got ", mask.sizes());
  }
  std::vector<const float*> nw(norms.size());
  for (size_t i = 0; i < norms.size(); ++i) {
    TORCH_CHECK(norms[i].numel() == C && norms[i].is_contiguous() &&
                    norms[i].scalar_type() == at::kFloat,
                "nodraft::block: a norm's weight must be (", C, ",) float32");
    nw[i] = norms[i].data_ptr<float>();
  }
  std::vector<Mat> mw(mats.size());
  for (size_t i = 0; i < mats.size(); ++i) mw[i] = mat(mats[i], "a weight");
  int64_t F = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Mat &qkv = mw[4 * i], &o = mw[4 * i + 1], &up = mw[4 * i + 2], &down = mw[4 * i + 3];
    F = down.K;
    TORCH_CHECK(qkv.K == C && qkv.N == 3 * C && o.K == C && o.N == C && up.K == C &&
                    up.N == 2 * F && down.N == C,
                "nodraft::block: layer ", lo + i, "'s weights do not fit a width of ", C);
  }
  TORCH_CHECK(!head || mw.back().K == C, "nodraft::block: the head's input is not ", C, " wide");

  const at::Tensor h0 = h_in.contiguous();
  at::Tensor x = h0.clone();
  const int64_t V = head ? mw.back().N : 0;
  at::Tensor logits = at::empty({head ? T : 0, V}, h0.options());

  thread_local Scratch scratch;
  const int64_t ctx = start + T;
  const int64_t widest = std::max<int64_t>(3 * C, 2 * F);
  thread_local std::vector<int64_t> picked;
  if (static_cast<int64_t>(picked.size()) < T) picked.resize(T);
  const int64_t FC = std::max(F, C);
  float* buf = scratch.get(static_cast<size_t>(T * (C + widest + C + C + FC) + ctx + 8));
  float* xn = buf;                  // (T, C) a norm's output
  float* wide = xn + T * C;         // (T, 3C) q, k, v; (T, 2F) gate, up
  float* q = wide + T * widest;     // (T, C) rotated queries
  float* y = q + T * C;             // (T, C) attention's output; a product's
  float* act = y + T * C;           // (T, F) the SwiGLU's output; (T, C) a product's
  float* s = act + T * FC;          // (ctx + 8) scores
  int64_t* rows = picked.data();    // (T) the block's rows a row sees

  const int64_t nv = (D + 7) / 8;
  const RowKernel attend = pick<1>(nv);
  const __m256i last = lanes(D - 8 * (nv - 1));
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float fe = static_cast<float>(eps);
  float* px = x.data_ptr<float>();
  const float *pcos = cos.data_ptr<float>(), *psin = sin.data_ptr<float>();
  const float* pm = mask.defined() ? mask.data_ptr<float>() : nullptr;

  for (int64_t i = 0; i < n; ++i) {
    const int64_t l = lo + i;
    const Mat &wqkv = mw[4 * i], &wo = mw[4 * i + 1], &w13 = mw[4 * i + 2], &w2 = mw[4 * i + 3];
    float* kl = kc.data_ptr<float>() + ((l * S + slot) * H) * M * D;  // (H, M, D)
    float* vl = vc.data_ptr<float>() + ((l * S + slot) * H) * M * D;
    for (int64_t t = 0; t < T; ++t) rms_norm(px + t * C, nw[2 * i], C, fe, xn + t * C);
    nodraft_kernels::gemm(xn, T, C, wqkv.p, 3 * C, wqkv.packed, wide);
    for (int64_t t = 0; t < T; ++t) {
      const float* r = wide + t * 3 * C;
      const float *ct = pcos + pp[t] * D, *st = psin + pp[t] * D;
      for (int64_t hh = 0; hh < H; ++hh) {
        rotate(r + hh * D, ct, st, D, q + t * C + hh * D);
        rotate(r + C + hh * D, ct, st, D, kl + (hh * M + start + t) * D);
        std::memcpy(vl + (hh * M + start + t) * D, r + 2 * C + hh * D, D * sizeof(float));
      }
    }
    for (int64_t t = 0; t < T; ++t)
      for (int64_t hh = 0; hh < H; ++hh)
        attend(q + t * C + hh * D, kl + hh * M * D, vl + hh * M * D, D, start, T, t,
               pm ? pm + t * T : nullptr, scale, last, s, rows, y + t * C + hh * D);
    nodraft_kernels::gemm(y, T, C, wo.p, C, wo.packed, act);
    for (int64_t e = 0; e < T * C; ++e) px[e] += act[e];
    for (int64_t t = 0; t < T; ++t) rms_norm(px + t * C, nw[2 * i + 1], C, fe, xn + t * C);
    nodraft_kernels::gemm(xn, T, C, w13.p, 2 * F, w13.packed, wide);
    for (int64_t t = 0; t < T; ++t) swiglu(wide + t * 2 * F, wide + t * 2 * F + F, F, act + t * F);
    nodraft_kernels::gemm(act, T, F, w2.p, C, w2.packed, y);
    for (int64_t e = 0; e < T * C; ++e) px[e] += y[e];
  }
  if (head) {
    for (int64_t t = 0; t < T; ++t) rms_norm(px + t * C, nw[2 * n], C, fe, xn + t * C);
    const Mat& wh = mw.back();
    nodraft_kernels::gemm(xn, T, C, wh.p, V, wh.packed, logits.data_ptr<float>());
  }
  return {x, logits};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nodraft, m) {
  m.def("block(Tensor h, Tensor pos, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] mats, "
        "Tensor(a!) kc, Tensor(b!) vc, int slot, int start, int lo, Tensor? mask, float eps) "
        "-> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(nodraft, CPU, m) { m.impl("block", &block); }
