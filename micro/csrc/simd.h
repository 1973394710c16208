// Vector helpers shared by nodraft's kernels (race.cpp, attend.cpp): eight floats at a time
// (AVX2 and FMA, which both builds have).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace nodraft_simd {

// exp(x) for x <= 0, eight at a time (Cephes' polynomial, a few units in the last place);
// exactly 0 below -87.3 (and at -inf).
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 zero_below = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                             _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(scale)), zero_below);
}

// a mask of the first t lanes (0 < t <= 8) for maskload / maskstore
inline __m256i lanes(int64_t t) {
  alignas(32) static const int32_t m[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + 8 - t));
}

// the sum of x's eight lanes
inline float sum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// a row of D floats as NV vectors of 8, the last one's lanes under ``last``
template <int NV>
inline __m256 load(const float* p, int i, __m256i last) {
  return i < NV - 1 ? _mm256_loadu_ps(p + 8 * i) : _mm256_maskload_ps(p + 8 * i, last);
}

// q . r over such a row, q held in NV registers
template <int NV>
inline float dot(const __m256 (&q)[NV], const float* r, __m256i last) {
  __m256 acc = _mm256_mul_ps(q[0], load<NV>(r, 0, last));
#pragma GCC unroll 16
  for (int i = 1; i < NV; ++i) acc = _mm256_fmadd_ps(q[i], load<NV>(r, i, last), acc);
  return sum(acc);
}

// y = acc * scale over a row of D floats held as NV vectors, the last under ``last``
template <int NV>
inline void store_scaled(const __m256 (&acc)[NV], float scale, float* y, __m256i last) {
  const __m256 s = _mm256_set1_ps(scale);
#pragma GCC unroll 16
  for (int i = 0; i < NV - 1; ++i) _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(acc[i], s));
  _mm256_maskstore_ps(y + 8 * (NV - 1), last, _mm256_mul_ps(acc[NV - 1], s));
}

// Softmax's numerators in place: s[i] = exp(s[i] - top) for i < n, and s[n, n rounded up to
// 8) zeroed (``s`` holds n + 8 floats); returns their sum (eight lanes, then across them).
inline float exp_sum(float* s, int64_t n, float top) {
  const int64_t padded = (n + 7) / 8 * 8;
  for (int64_t i = n; i < padded; ++i) s[i] = -__builtin_inff();  // exp: 0
  const __m256 vtop = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (int64_t i = 0; i < padded; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), vtop));
    _mm256_storeu_ps(s + i, e);
    total = _mm256_add_ps(total, e);
  }
  return sum(total);
}

}  // namespace nodraft_simd
