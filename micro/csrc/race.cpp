// nodraft::race -- the sampling race of engine/sampling.py, one row in one pass of C++.
//
// For each row r of ``logits`` (R, V) float32 (-inf: a token removed beforehand) divided by
// ``temps[r]``, with the row's race named by (``seeds[r]``, ``positions[r]``):
//
//   w(v)  = exp(l(v) / T - max_u l(u) / T)          the weights (zero where removed)
//   m(g)  = sum of w over group g                     ``groups`` blocks of ``width`` ids
//   g*    = argmax_g m(g) / E(g)                      E: the exponentials of the stream
//                                                       "race:<seed>:<t>"
//   x     = g* * width + argmax_i w(g*, i) / E'(i)    E': those of "race:<seed>:<t>:<g*>"
//
// The streams are SHAKE256 output, 64 bits per entry: the top 53 a uniform U, E = -log(1 -
// U), raised to the smallest normal double if zero -- the same bits, the same exponentials
// as the numpy race (engine/sampling.py ``exponentials``; tests/engine/test_race_kernel.py
// checks the two agree). The weights are computed here with a polynomial exponential (a
// few units in the last place of float32's) and summed in another order than numpy's, so
// where two ratios tie to float32 rounding the two races can pick differently: each is
// exact sampling from its own weights.
//
// Top-k and top-p (``top_ks[r]``, ``top_ps[r]``; 0 and 1 keep every token) remove tokens
// from the row before the race, top-k first, by the rule of engine/verify.py ``kept``: a
// token v is kept iff the tokens whose scaled logit is strictly above v's number fewer than
// k (top-k), and weigh less than top_p of the row's weight (top-p, over what top-k kept).
// Tokens of equal logits are kept or removed together, and the most likely are always
// kept. ``keep_from`` finds that threshold by a radix select, with no sort.
//
// Rows are independent: a row's token does not depend on the others in the call.
//
// ``nodraft::kept`` returns the kept tokens themselves, (R, V) bool, for the paths that
// need the distribution rather than a race (verification with a draft's q).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "simd.h"

namespace {

using nodraft_simd::exp_nonpositive;

// -- SHAKE256 (FIPS 202): Keccak-f[1600], rate 136 bytes, domain suffix 0x1F --------------
constexpr uint64_t kRoundConstants[24] = {
    0x0000000000000001ULL, 0x0000000000008082ULL, 0x800000000000808aULL,
    0x8000000080008000ULL, 0x000000000000808bULL, 0x0000000080000001ULL,
    0x8000000080008081ULL, 0x8000000000008009ULL, 0x000000000000008aULL,
    0x0000000000000088ULL, 0x0000000080008009ULL, 0x000000008000000aULL,
    0x000000008000808bULL, 0x800000000000008bULL, 0x8000000000008089ULL,
    0x8000000000008003ULL, 0x8000000000008002ULL, 0x8000000000000080ULL,
    0x000000000000800aULL, 0x800000008000000aULL, 0x8000000080008081ULL,
    0x8000000000008080ULL, 0x0000000080000001ULL, 0x8000000080008008ULL};
constexpr int kRotations[24] = {1,  3,  6,  10, 15, 21, 28, 36, 45, 55, 2,  14,
                                27, 41, 56, 8,  25, 43, 62, 18, 39, 61, 20, 44};
constexpr int kLanes[24] = {10, 7,  11, 17, 18, 3, 5,  16, 8,  21, 24, 4,
                            15, 23, 19, 13, 12, 2, 20, 14, 22, 9,  6,  1};

inline uint64_t rotl(uint64_t x, int s) { return (x << s) | (x >> (64 - s)); }

void keccak_f(uint64_t st[25]) {
#pragma GCC unroll 2
  for (int round = 0; round < 24; ++round) {
    uint64_t c[5], d[5];
#pragma GCC unroll 5
    for (int i = 0; i < 5; ++i) c[i] = st[i] ^ st[i + 5] ^ st[i + 10] ^ st[i + 15] ^ st[i + 20];
#pragma GCC unroll 5
    for (int i = 0; i < 5; ++i) d[i] = c[(i + 4) % 5] ^ rotl(c[(i + 1) % 5], 1);
#pragma GCC unroll 25
    for (int j = 0; j < 25; ++j) st[j] ^= d[j % 5];
    uint64_t t = st[1];
#pragma GCC unroll 24
    for (int i = 0; i < 24; ++i) {
      const int j = kLanes[i];
      const uint64_t next = st[j];
      st[j] = rotl(t, kRotations[i]);
      t = next;
    }
#pragma GCC unroll 5
    for (int j = 0; j < 25; j += 5) {
      const uint64_t a0 = st[j], a1 = st[j + 1], a2 = st[j + 2], a3 = st[j + 3], a4 = st[j + 4];
      st[j] = a0 ^ (~a1 & a2);
      st[j + 1] = a1 ^ (~a2 & a3);
      st[j + 2] = a2 ^ (~a3 & a4);
      st[j + 3] = a3 ^ (~a4 & a0);
      st[j + 4] = a4 ^ (~a0 & a1);
    }
    st[0] ^= kRoundConstants[round];
  }
}

// The first ``n`` 64-bit little-endian words of SHAKE256(msg).
void shake256_words(const char* msg, size_t len, uint64_t* out, int64_t n) {
  constexpr size_t kRate = 136, kWords = kRate / 8;
  uint64_t st[25] = {0};
  unsigned char block[kRate];
  while (len >= kRate) {
    for (size_t i = 0; i < kWords; ++i) {
      uint64_t w;
      std::memcpy(&w, msg + 8 * i, 8);
      st[i] ^= w;
    }
    keccak_f(st);
    msg += kRate;
    len -= kRate;
  }
  std::memset(block, 0, kRate);
  std::memcpy(block, msg, len);
  block[len] ^= 0x1F;
  block[kRate - 1] ^= 0x80;
  for (size_t i = 0; i < kWords; ++i) {
    uint64_t w;
    std::memcpy(&w, block + 8 * i, 8);
    st[i] ^= w;
  }
  keccak_f(st);
  for (int64_t o = 0;;) {
    for (size_t i = 0; i < kWords && o < n; ++i) out[o++] = st[i];
    if (o >= n) break;
    keccak_f(st);
  }
}

// E ~ Exp(1) from a word: the top 53 bits a uniform U, E = -log(1 - U), at least DBL_MIN.
inline double exponential(uint64_t word) {
  const double e = -std::log1p(static_cast<double>(word >> 11) * -0x1p-53);
  return e < DBL_MIN ? DBL_MIN : e;
}

// argmax_i w[i] / E_i over the stream ``name``'s first n exponentials (the first on ties).
// E_i = -log(1 - U_i) >= U_i, so w_i / U_i bounds the ratio from above: only the entries
// whose bound reaches the ratio of the entry with the largest bound need their logarithm
// (most weights are far below the largest), taken in order, so ties go to the first.
int64_t race_stream(const char* name, size_t len, const float* w, int64_t n,
                    std::vector<uint64_t>& words, std::vector<double>& bound) {
  shake256_words(name, len, words.data(), n);
  int64_t lead = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double u = static_cast<double>(words[i] >> 11) * 0x1p-53;
    bound[i] = static_cast<double>(w[i]) / u;  // +inf for u = 0; 0 for a zero weight
    if (bound[i] > bound[lead]) lead = i;
  }
  const double floor = static_cast<double>(w[lead]) / exponential(words[lead]) * (1 - 1e-9);
  int64_t best = 0;
  double top = -1.0;
  for (int64_t i = 0; i < n; ++i) {
    if (bound[i] < floor) continue;  // its ratio is below the lead's: never the argmax
    const double ratio = static_cast<double>(w[i]) / exponential(words[i]);
    if (ratio > top) top = ratio, best = i;
  }
  return best;
}

float exp_nonpositive(float x) {
  alignas(32) float lane[8] = {x};
  _mm256_store_ps(lane, exp_nonpositive(_mm256_load_ps(lane)));
  return lane[0];
}

// -- top-k and top-p ----------------------------------------------------------------------
// A float's bits as an unsigned key in the float's order (-inf lowest; NaN aside).
inline uint32_t order_key(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct Select {
  std::vector<int32_t> cand, next;
  double measure[2048];
  uint64_t filled[32];  // a bit per bin that a candidate falls in
};

// The smallest kept key: token i is kept iff measure({j : key[j] > key[i]}) < target, where
// the measure of j is w[j] (w null: 1), over the tokens ``s.cand[0, m)`` -- every other
// token must be below all of them and removed (``row_weights`` leaves out only such). A
// radix select over the key's digits (11, 11 and 10 bits): at each digit, the first bin
// from the top whose measure brings the measure above it to the target holds the
// threshold -- every token in a higher bin is kept (what is above it weighs less), every
// token in a lower one removed -- and only that bin's tokens are read at the next digit.
// At the last digit a bin is one key, so tokens of equal keys are kept together. For a
// target <= 0 only the highest key is kept; a target the candidates do not reach keeps
// them all.
uint32_t keep_from(const uint32_t* key, const float* w, int64_t m, double target, Select& s) {
  if (target <= 0.0) {
    uint32_t most = 0;
    for (int64_t j = 0; j < m; ++j) most = key[s.cand[j]] > most ? key[s.cand[j]] : most;
    return most;
  }
  constexpr int kShift[3] = {21, 10, 0};
  constexpr uint32_t kBins[3] = {2048, 2048, 1024};
  double above = 0.0;
  uint32_t base = 0;  // the digits fixed so far, the rest zero
  for (int level = 0; level < 3; ++level) {
    const int shift = kShift[level];
    const uint32_t bins = kBins[level];
    std::memset(s.measure, 0, sizeof(double) * bins);
    std::memset(s.filled, 0, sizeof s.filled);
    for (int64_t j = 0; j < m; ++j) {
      const int32_t i = s.cand[j];
      const uint32_t bin = (key[i] >> shift) & (bins - 1);
      s.measure[bin] += w ? static_cast<double>(w[i]) : 1.0;
      s.filled[bin >> 6] |= uint64_t{1} << (bin & 63);
    }
    // the filled bins from the top (an empty bin never crosses a target above 0)
    int64_t b = -1;
    for (int64_t word = (bins - 1) >> 6; word >= 0 && b < 0; --word) {
      for (uint64_t bits = s.filled[word]; bits;) {
        const int top = 63 - __builtin_clzll(bits);
        const int64_t at = word * 64 + top;
        if (above + s.measure[at] >= target) {
          b = at;
          break;
        }
        above += s.measure[at];
        bits &= ~(uint64_t{1} << top);
      }
    }
    if (b < 0) return base;  // the target is not reached: keep every candidate
    base |= static_cast<uint32_t>(b) << shift;
    if (level == 2) break;
    int64_t k = 0;  // without a branch: most candidates leave, at random
    for (int64_t j = 0; j < m; ++j) {
      const int32_t i = s.cand[j];
      s.next[k] = i;
      k += ((key[i] >> shift) & (bins - 1)) == static_cast<uint32_t>(b);
    }
    std::swap(s.cand, s.next);
    m = k;
  }
  return base;
}

// The sum of w[0, n) in float64: four sums of every fourth group of four floats, then
// theirs, as pairs (the order differs from a running sum's in the last places only).
double weight_sum(const float* w, int64_t n) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
  int64_t v = 0;
  for (; v + 16 <= n; v += 16)
    for (int j = 0; j < 4; ++j)
      acc[j] = _mm256_add_pd(acc[j], _mm256_cvtps_pd(_mm_loadu_ps(w + v + 4 * j)));
  alignas(32) double lane[4];
  _mm256_store_pd(lane, _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]),
                                      _mm256_add_pd(acc[2], acc[3])));
  double total = (lane[0] + lane[1]) + (lane[2] + lane[3]);
  for (; v < n; ++v) total += w[v];
  return total;
}

// Row scratch: the scaled logits' keys and the weights (``groups * width`` of them, the
// padding zero), the row's largest scaled logit.
struct Row {
  std::vector<float> w;
  std::vector<uint32_t> key;
  Select select;
};

// The weights w(v) = exp(l(v) / T - max l / T) of one row, zero where top-k or top-p removed
// v; with ``keys``, each token's order key of l(v) / T (filled whenever a filter applies).
// Returns the smallest kept key (0: every token kept).
uint32_t row_weights(const float* row, int64_t V, int64_t padded, float temp, int64_t top_k,
                     double top_p, Row& s) {
  float* w = s.w.data();
  // the scaled row's largest value: the largest logit over the temperature (a correctly
  // rounded division keeps the order), then the weights relative to it
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(row + v));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float top = -INFINITY;
  for (float lane : lanes) top = lane > top ? lane : top;
  for (; v < V; ++v) top = row[v] > top ? row[v] : top;
  top /= temp;
  const __m256 vt = _mm256_set1_ps(temp), vtop = _mm256_set1_ps(top);
  const bool filters = (top_k > 0 && top_k < V) || top_p < 1.0;
  uint32_t* key = s.key.data();  // written only where a filter reads it
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  for (v = 0; v + 8 <= V; v += 8) {
    const __m256 y = _mm256_div_ps(_mm256_loadu_ps(row + v), vt);
    _mm256_storeu_ps(w + v, exp_nonpositive(_mm256_sub_ps(y, vtop)));
    if (filters) {  // order_key, eight at a time
      const __m256i bits = _mm256_castps_si256(y);
      const __m256i flip = _mm256_or_si256(_mm256_srai_epi32(bits, 31), sign);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(key + v), _mm256_xor_si256(bits, flip));
    }
  }
  for (; v < V; ++v) {
    const float y = row[v] / temp;
    w[v] = exp_nonpositive(y - top);
    if (filters) key[v] = order_key(y);
  }
  for (; v < padded; ++v) w[v] = 0.0f;
  if (!filters) return 0;
  std::vector<int32_t>& cand = s.select.cand;
  cand.resize(V + 16);  // room for a whole vector's store past the last candidate
  s.select.next.resize(V + 16);
  uint32_t least = 0;
  if (top_k > 0 && top_k < V) {
    for (v = 0; v < V; ++v) cand[v] = static_cast<int32_t>(v);
    least = keep_from(key, nullptr, V, static_cast<double>(top_k), s.select);
    for (v = 0; v < V; ++v) w[v] = key[v] >= least ? w[v] : 0.0f;
  }
  if (top_p < 1.0) {
    const double total = weight_sum(w, V);
    // a token whose scaled logit is below top + log(c), c = (1 - top_p) * total / (2V),
    // weighs under c, and so do all below it: together under (1 - top_p) * total, so what
    // is above it reaches top_p * total and it is removed. Only the rest are candidates,
    // gathered without a branch (which of them pass is data, not a pattern).
    const double c = (1.0 - top_p) * total / (2.0 * static_cast<double>(V));
    const uint32_t floor = c > 0.0 ? order_key(top + static_cast<float>(std::log(c))) : 0;
    const uint32_t lowest = floor > least ? floor : least;
    int64_t m = 0;
    v = 0;
#ifdef __AVX512F__
    const __m512i vlow = _mm512_set1_epi32(static_cast<int>(lowest));
    const __m512i step = _mm512_set1_epi32(16);
    __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; v + 16 <= V; v += 16, ids = _mm512_add_epi32(ids, step)) {
      const __mmask16 pass = _mm512_cmpge_epu32_mask(
          _mm512_loadu_si512(reinterpret_cast<const void*>(key + v)), vlow);
      _mm512_storeu_si512(reinterpret_cast<void*>(cand.data() + m),
                          _mm512_maskz_compress_epi32(pass, ids));
      m += __builtin_popcount(static_cast<unsigned>(pass));
    }
#endif
    for (; v < V; ++v) {
      cand[m] = static_cast<int32_t>(v);
      m += key[v] >= lowest;
    }
    const uint32_t nucleus = keep_from(key, w, m, top_p * total, s.select);
    if (nucleus > least) {
      least = nucleus;
      for (v = 0; v < V; ++v) w[v] = key[v] >= least ? w[v] : 0.0f;
    }
  }
  return least;
}

void check_rows(const at::Tensor& logits, int64_t R, size_t temps, size_t top_ks,
                size_t top_ps, const char* op) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, op,
              ": logits must be (R, V) float32");
  TORCH_CHECK(static_cast<int64_t>(temps) == R && static_cast<int64_t>(top_ks) == R &&
                  static_cast<int64_t>(top_ps) == R,
              op, ": one temperature, top-k and top-p per row");
}

at::Tensor kept(const at::Tensor& logits, c10::ArrayRef<double> temps,
                c10::ArrayRef<int64_t> top_ks, c10::ArrayRef<double> top_ps) {
  const int64_t R = logits.dim() == 2 ? logits.size(0) : 0, V = logits.size(-1);
  check_rows(logits, R, temps.size(), top_ks.size(), top_ps.size(), "nodraft::kept");
  const at::Tensor x = logits.contiguous();
  at::Tensor out = at::empty({R, V}, logits.options().dtype(at::kBool));
  bool* keep = out.data_ptr<bool>();
  Row s;
  s.w.resize(V + 8);
  s.key.resize(V + 8);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t k = top_ks[r];
    const double p = top_ps[r];
    const bool filters = (k > 0 && k < V) || p < 1.0;
    const float* row = x.data_ptr<float>() + r * V;
    const uint32_t least = row_weights(row, V, V, static_cast<float>(temps[r]), k, p, s);
    for (int64_t v = 0; v < V; ++v) keep[r * V + v] = !filters || s.key[v] >= least;
  }
  return out;
}

std::vector<int64_t> race(const at::Tensor& logits, c10::ArrayRef<double> temps,
                          c10::ArrayRef<int64_t> seeds, c10::ArrayRef<int64_t> positions,
                          int64_t groups, int64_t width, c10::ArrayRef<int64_t> top_ks,
                          c10::ArrayRef<double> top_ps) {
  const int64_t R = logits.dim() == 2 ? logits.size(0) : 0, V = logits.size(-1);
  check_rows(logits, R, temps.size(), top_ks.size(), top_ps.size(), "nodraft::race");
  TORCH_CHECK(groups * width >= V && width > 0 && groups > 0,
              "nodraft::race: groups * width must cover the vocabulary");
  TORCH_CHECK(static_cast<int64_t>(seeds.size()) == R &&
                  static_cast<int64_t>(positions.size()) == R,
              "nodraft::race: one seed and position per row");
  const at::Tensor x = logits.contiguous();
  std::vector<int64_t> out(R);
  static thread_local Row s;  // the scratch a thread's calls share, warm in its caches
  s.w.resize(groups * width + 8);
  s.key.resize(V + 8);
  std::vector<float> mass(groups);
  std::vector<uint64_t> words(groups > width ? groups : width);
  std::vector<double> bound(words.size());
  char name[96];
  for (int64_t r = 0; r < R; ++r) {
    const float* row = x.data_ptr<float>() + r * V;
    row_weights(row, V, groups * width, static_cast<float>(temps[r]), top_ks[r], top_ps[r], s);
    const float* w = s.w.data();
    for (int64_t g = 0; g < groups; ++g) {  // eight partial sums a group, then theirs
      const float* wg = w + g * width;
      __m256 acc = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= width; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(wg + i));
      alignas(32) float part[8];
      _mm256_store_ps(part, acc);
      float sum = ((part[0] + part[1]) + (part[2] + part[3])) +
                  ((part[4] + part[5]) + (part[6] + part[7]));
      for (; i < width; ++i) sum += wg[i];
      mass[g] = sum;
    }
    const auto seed = static_cast<unsigned long long>(seeds[r]);
    const auto pos = static_cast<long long>(positions[r]);
    int len = std::snprintf(name, sizeof name, "race:%llu:%lld", seed, pos);
    const int64_t g = race_stream(name, len, mass.data(), groups, words, bound);
    len += std::snprintf(name + len, sizeof name - len, ":%lld", static_cast<long long>(g));
    out[r] = g * width + race_stream(name, len, w + g * width, width, words, bound);
  }
  return out;
}

// nodraft::argmax: each row's greedy token, the first index of its largest logit -- what
// torch.argmax gives, as a list. (torch's argmax reduction is scalar on CPU: 32 rows of
// 4096 took ~115 us, their max alone ~8.) A row with a NaN is torch's to answer.
std::vector<int64_t> argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "nodraft::argmax: logits must be (R, V) float32, got ", logits.sizes(), " ",
              logits.scalar_type());
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 || R == 0, "nodraft::argmax: rows of no logits");
  const at::Tensor x = logits.contiguous();
  std::vector<int64_t> out(R);
  for (int64_t r = 0; r < R; ++r) {
    const float* row = x.data_ptr<float>() + r * V;
    __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) {
      const __m256 v = _mm256_loadu_ps(row + i);
      top = _mm256_max_ps(top, v);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    alignas(32) float lane[8];
    _mm256_store_ps(lane, top);
    float best = lane[0];
    for (int j = 1; j < 8; ++j) best = lane[j] > best ? lane[j] : best;
    bool has_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t j = i; j < V; ++j) {
      has_nan = has_nan || std::isnan(row[j]);
      best = row[j] > best ? row[j] : best;
    }
    if (has_nan) {
      out[r] = x[r].argmax().item<int64_t>();
      continue;
    }
    const __m256 b = _mm256_set1_ps(best);
    int64_t k = 0;
    for (; k + 8 <= V; k += 8) {
      const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + k), b, _CMP_EQ_OQ));
      if (hit) {
        k += __builtin_ctz(static_cast<unsigned>(hit));
        break;
      }
    }
    while (k < V && row[k] != best) ++k;  // the tail, past the last eight
    out[r] = k;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nodraft, m) {
  m.def("argmax(Tensor logits) -> int[]");
  m.def("race(Tensor logits, float[] temps, int[] seeds, int[] positions, int groups, "
        "int width, int[] top_ks, float[] top_ps) -> int[]");
  m.def("kept(Tensor logits, float[] temps, int[] top_ks, float[] top_ps) -> Tensor");
}
TORCH_LIBRARY_IMPL(nodraft, CPU, m) {
  m.impl("argmax", &argmax);
  m.impl("race", &race);
  m.impl("kept", &kept);
}
