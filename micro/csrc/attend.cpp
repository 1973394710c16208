// nodraft::attend -- attention for the one-row blocks of a packed pass (micro/compiled.py).
//
//   y[b, h] = softmax_t(s_t) . V_t,  s_t = scale * q[src[b], h] . K_t,  over
//   K_t = kc[b, h, t] for t < starts[b], then the row's own key k[src[b], h] (and V alike)
//
// q, k, v (N, H, D): every row of the pass, its queries, keys and values (rotated where they
// are). kc, vc (B, H, C, D): each slot's cached keys and values, any strides but a unit one
// along D (a view of the cache, read in place). src (B,): the row of the pass each slot
// attends for; a value outside [0, N) marks a slot with no row, whose y is zeros.
// starts (B,): each slot's committed length, at most C.
//
// Each slot reads its own rows only -- no padding to the longest, no mask: where the
// compiled graph's fused loops score every slot up to the longest length, this reads
// sum(starts) rows, the next slot's prefetched while one is computed. Per (slot, head): the scores, one dot product a row; their maximum;
// the exponentials (simd.h, eight at a time); the weighted sum of values, held in
// registers along D. float32 only; D at most 128 (16 vectors of 8).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

using nodraft_simd::dot;
using nodraft_simd::exp_sum;
using nodraft_simd::lanes;
using nodraft_simd::load;
using nodraft_simd::store_scaled;
using nodraft_simd::sum;

constexpr int64_t kMaxVectors = 16;

// a row of D floats: NV vectors, the last one's lanes under ``last``
// One (slot, head): ``s`` holds at least n + 9 floats.
template <int NV>
void attend_one(const float* q, const float* k, const float* v, const float* kc, int64_t kst,
                const float* vc, int64_t vst, int64_t n, float scale, __m256i last, float* s,
                float* y) {
  __m256 qv[NV];
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) qv[i] = _mm256_mul_ps(load<NV>(q, i, last), _mm256_set1_ps(scale));
  float top = s[n] = dot<NV>(qv, k, last);
  for (int64_t t = 0; t < n; ++t) {
    s[t] = dot<NV>(qv, kc + t * kst, last);
    top = std::max(top, s[t]);
  }
  const float total = exp_sum(s, n + 1, top);
  __m256 acc[NV];
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) acc[i] = _mm256_mul_ps(_mm256_set1_ps(s[n]), load<NV>(v, i, last));
  for (int64_t t = 0; t < n; ++t) {
    const __m256 p = _mm256_set1_ps(s[t]);
    const float* r = vc + t * vst;
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) acc[i] = _mm256_fmadd_ps(p, load<NV>(r, i, last), acc[i]);
  }
  store_scaled<NV>(acc, 1.0f / total, y, last);
}

// A hint: rows [0, n) of D floats, ``stride`` apart, towards L2 (the hardware prefetcher
// restarts at every page; a slot's rows are short runs far apart).
inline void prefetch_rows(const float* p, int64_t n, int64_t stride, int64_t D) {
  if (n <= 0) return;
  const char* c = reinterpret_cast<const char*>(p);
  if (stride == D) {  // contiguous: every line of the run
    for (int64_t o = 0, bytes = 4 * n * D; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T1);
  } else {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t o = 0; o < 4 * D; o += 64) _mm_prefetch(c + 4 * t * stride + o, _MM_HINT_T1);
  }
}

using Kernel = void (*)(const float*, const float*, const float*, const float*, int64_t,
                        const float*, int64_t, int64_t, float, __m256i, float*, float*);

template <int NV>
Kernel pick(int64_t nv) {
  if constexpr (NV > kMaxVectors) {
    return nullptr;
  } else {
    return nv == NV ? &attend_one<NV> : pick<NV + 1>(nv);
  }
}

at::Tensor attend(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                  const at::Tensor& kc_in, const at::Tensor& vc_in, const at::Tensor& src_in,
                  const at::Tensor& starts_in, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && k_in.sizes() == q_in.sizes() && v_in.sizes() == q_in.sizes(),
              "nodraft::attend: q, k, v must be (N, H, D) alike, got ", q_in.sizes(), ", ",
              k_in.sizes(), ", ", v_in.sizes());
  const int64_t N = q_in.size(0), H = q_in.size(1), D = q_in.size(2);
  TORCH_CHECK(kc_in.dim() == 4 && vc_in.sizes() == kc_in.sizes() && kc_in.size(1) == H &&
                  kc_in.size(3) == D,
              "nodraft::attend: kc, vc must be (B, ", H, ", C, ", D, ") alike, got ",
              kc_in.sizes(), ", ", vc_in.sizes());
  const int64_t B = kc_in.size(0), C = kc_in.size(2);
  TORCH_CHECK(src_in.dim() == 1 && src_in.size(0) == B && starts_in.dim() == 1 &&
                  starts_in.size(0) == B,
              "nodraft::attend: src and starts must be (", B, ",), got ", src_in.sizes(), ", ",
              starts_in.sizes());
  for (const at::Tensor* t : {&q_in, &k_in, &v_in, &kc_in, &vc_in})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "nodraft::attend: float32 only, got ",
                t->scalar_type());
  TORCH_CHECK(D >= 1 && D <= 8 * kMaxVectors, "nodraft::attend: head size ", D,
              " outside [1, ", 8 * kMaxVectors, "]");
  // a unit stride along D is all the loops need; anything else is copied to one
  auto rows = [](const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
  const at::Tensor q = rows(q_in), k = rows(k_in), v = rows(v_in), kc = rows(kc_in),
                   vc = rows(vc_in);
  const at::Tensor src = src_in.to(at::kLong).contiguous();
  const at::Tensor starts = starts_in.to(at::kLong).contiguous();
  const int64_t* ps = src.data_ptr<int64_t>();
  const int64_t* pn = starts.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(pn[b] >= 0 && pn[b] <= C, "nodraft::attend: slot ", b, "'s length ", pn[b],
                " outside [0, ", C, "]");
  at::Tensor y = at::zeros({B, H, D}, q.options());
  if (B == 0 || H == 0) return y;
  const int64_t nv = (D + 7) / 8;
  const Kernel run = pick<1>(nv);
  const __m256i last = lanes(D - 8 * (nv - 1));
  const float *pq = q.data_ptr<float>(), *pk = k.data_ptr<float>(), *pv = v.data_ptr<float>();
  const float *pkc = kc.data_ptr<float>(), *pvc = vc.data_ptr<float>();
  float* py = y.data_ptr<float>();
  // at least ~64K multiply-adds per task: a pass's attention stays on the calling thread
  // unless its contexts are long
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, 2 * C * D));
  at::parallel_for(0, B * H, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> s(C + 9);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = i / H, h = i % H, r = ps[b];
      if (i + 1 < hi) {  // the next (slot, head)'s rows on their way to L2 while this one runs
        const int64_t b1 = (i + 1) / H, h1 = (i + 1) % H;
        prefetch_rows(pkc + b1 * kc.stride(0) + h1 * kc.stride(1), pn[b1], kc.stride(2), D);
        prefetch_rows(pvc + b1 * vc.stride(0) + h1 * vc.stride(1), pn[b1], vc.stride(2), D);
      }
      if (r < 0 || r >= N) continue;  // a slot with no row: zeros
      run(pq + r * q.stride(0) + h * q.stride(1), pk + r * k.stride(0) + h * k.stride(1),
          pv + r * v.stride(0) + h * v.stride(1),
          pkc + b * kc.stride(0) + h * kc.stride(1), kc.stride(2),
          pvc + b * vc.stride(0) + h * vc.stride(1), vc.stride(2), pn[b],
          static_cast<float>(scale), last, s.data(), py + (b * H + h) * D);
    }
  });
  return y;
}

// nodraft::put_rows: a packed pass's new keys (or values) into the cache, in place.
// cache (L, S, H, M, D) contiguous; slots, rows (N,): where each of the pass's rows goes;
// fresh (L, N, H, D): its keys. cache[l, slots[n], h, rows[n]] = fresh[l, n, h], a copy
// of D floats each (advanced indexing into slot and row, two dimensions apart, costs
// ~50 us a call in index machinery at 32 rows; this, a few).
void put_rows(at::Tensor& cache, const at::Tensor& slots_in, const at::Tensor& rows_in,
              const at::Tensor& fresh_in) {
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous(),
              "nodraft::put_rows: the cache must be (L, S, H, M, D) contiguous, got ",
              cache.sizes());
  const int64_t L = cache.size(0), S = cache.size(1), H = cache.size(2), M = cache.size(3),
                D = cache.size(4);
  const int64_t N = slots_in.numel();
  TORCH_CHECK(slots_in.dim() == 1 && rows_in.dim() == 1 && rows_in.numel() == N &&
                  fresh_in.dim() == 4 && fresh_in.size(0) == L && fresh_in.size(1) == N &&
                  fresh_in.size(2) == H && fresh_in.size(3) == D,
              "nodraft::put_rows: slots, rows (N,) and fresh (", L, ", N, ", H, ", ", D,
              ") expected, got ", slots_in.sizes(), ", ", rows_in.sizes(), ", ",
              fresh_in.sizes());
  TORCH_CHECK(fresh_in.scalar_type() == cache.scalar_type(),
              "nodraft::put_rows: fresh is ", fresh_in.scalar_type(), ", the cache ",
              cache.scalar_type());
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  const at::Tensor rows = rows_in.to(at::kLong).contiguous();
  const at::Tensor fresh = fresh_in.contiguous();
  const int64_t* ps = slots.data_ptr<int64_t>();
  const int64_t* pr = rows.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(ps[n] >= 0 && ps[n] < S && pr[n] >= 0 && pr[n] < M, "nodraft::put_rows: (slot ",
                ps[n], ", row ", pr[n], ") outside the cache's (", S, ", ", M, ")");
  const int64_t bytes = D * static_cast<int64_t>(cache.element_size());
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* src = static_cast<const char*>(fresh.data_ptr());
  for (int64_t l = 0; l < L; ++l)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(dst + (((l * S + ps[n]) * H + h) * M + pr[n]) * bytes,
                    src + ((l * N + n) * H + h) * bytes, bytes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nodraft, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor kc, Tensor vc, Tensor src, "
        "Tensor starts, float scale) -> Tensor");
  m.def("put_rows(Tensor(a!) cache, Tensor slots, Tensor rows, Tensor fresh) -> ()");
}
TORCH_LIBRARY_IMPL(nodraft, CPU, m) {
  m.impl("attend", &attend);
  m.impl("put_rows", &put_rows);
}
