// Decode attention over the paged KV cache for XLA:CPU, as an XLA FFI custom call.
//
// For every decode sequence q and KV head k it walks the sequence's pages up to its context
// and keeps, for each of the G query heads that share k, the online-softmax statistics the
// XLA path merges with the step's own keys (`xla.py`): the running max m, the denominator
// d = sum exp(s - m) and the weighted sum w = sum exp(s - m) v. Keys are read once, straight
// from their pages (no gathered copy), with the G query heads dotted against each key while it
// is in cache. Sequences are split over `num_threads` tasks on XLA's intra-op pool
// (`cpu_parallel.h`).
//
// Layout (see reference.py): pages [L, P, Z, 2K, H], keys at 2k and values at 2k + 1 of the
// third axis; an 8-bit pool (int8, float8_e4m3fn, float8_e5m2) has float32 scales
// [L, P, Z, 2K] (value = element * scale).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_half.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define JAXINFER_DECODE_F16C 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define JAXINFER_DECODE_AVX2 1
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxGroup = 16;  // query heads per KV head the stack buffers hold

// The float8 pools' elements, told apart by type so `Widen` picks the decoding.
struct E4M3 { uint8_t bits; };  // float8_e4m3fn: bias 7, no infinities, 0x7f/0xff are NaN
struct E5M2 { uint8_t bits; };  // float8_e5m2: the high byte of an IEEE half

// Every e4m3 value, decoded once: one table load per element instead of bit arithmetic.
struct E4M3Table {
  float values[256];
  E4M3Table() {
    for (int bits = 0; bits < 256; ++bits) {
      const int exponent = (bits >> 3) & 0xf, mantissa = bits & 0x7;
      float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                      : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      if (exponent == 0xf && mantissa == 0x7) magnitude = std::numeric_limits<float>::quiet_NaN();
      values[bits] = (bits & 0x80) ? -magnitude : magnitude;
    }
  }
};
const E4M3Table kE4M3;

inline float Widen(float value) { return value; }
inline float Widen(E4M3 value) { return kE4M3.values[value.bits]; }
inline float Widen(E5M2 value) {  // e5m2 -> half -> float: sign, 5-bit exponent, 2-bit mantissa
  const uint32_t bits = value.bits, sign = (bits & 0x80) << 24, exponent = (bits >> 2) & 0x1f;
  const uint32_t mantissa = bits & 0x3;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -16);  // subnormal: m / 4 * 2^-14
  } else if (exponent == 0x1f) {
    magnitude = mantissa ? std::numeric_limits<float>::quiet_NaN()
                         : std::numeric_limits<float>::infinity();
  } else {
    magnitude = std::ldexp(1.0f + mantissa / 4.0f, static_cast<int>(exponent) - 15);
  }
  return sign ? -magnitude : magnitude;
}
inline float Widen(int8_t value) { return static_cast<float>(value); }
inline float Widen(uint16_t bits) {  // bfloat16: the high half of a float32
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  __builtin_memcpy(&value, &wide, sizeof(value));
  return value;
}

// A whole key or value row of a float8 pool widened to float32 before its dot products:
// the element-wise `Widen` (a table load for e4m3, bit arithmetic for e5m2) kept the loops
// scalar, and float8 KV decoded at 0.17-0.23x float32 KV (`benchmarks/results/
// kv_memory.md`). Both float8 types are halves with fewer bits, so 16 elements become 16
// halves by integer shifts and then floats by F16C's convert, exactly:
//   e5m2: the high byte of a half, h = b << 8 (infinities and NaNs included);
//   e4m3fn: h = sign << 15 | (b & 0x7f) << 7 is the value times 2^-8 (exponent bias 15
//   against 7; subnormals too), so the floats are scaled by 256; 0x7f / 0xff are NaN.
// Other element types return the row itself (float32) or widen in a plain loop (int8,
// bfloat16), which the compiler vectorizes.
template <typename T>
inline const float* WidenRow(const T* row, int64_t n, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
#ifdef JAXINFER_DECODE_F16C
    if constexpr (std::is_same_v<T, E4M3> || std::is_same_v<T, E5M2>) {
      const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row);
      int64_t h = 0;
      for (; h + 16 <= n; h += 16) {
        const __m256i wide = _mm256_cvtepu8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + h)));  // 16 x u16
        __m256i half;
        if constexpr (std::is_same_v<T, E5M2>) {
          half = _mm256_slli_epi16(wide, 8);
        } else {
          const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x80)), 8);
          const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x7f)), 7);
          half = _mm256_or_si256(sign, magnitude);
        }
        __m256 low = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
        __m256 high = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
        if constexpr (std::is_same_v<T, E4M3>) {
          const __m256 scale = _mm256_set1_ps(256.0f);
          // NaN where the magnitude is 0x7f: the halves' 0x3f80 pattern (1.875 * 256 = 480).
          const __m256i nan_bits = _mm256_cmpeq_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x7f)),
                                                      _mm256_set1_epi16(0x7f));
          const __m256 nan = _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN());
          const __m256 low_nan = _mm256_castsi256_ps(
              _mm256_cvtepi16_epi32(_mm256_castsi256_si128(nan_bits)));
          const __m256 high_nan = _mm256_castsi256_ps(
              _mm256_cvtepi16_epi32(_mm256_extracti128_si256(nan_bits, 1)));
          low = _mm256_blendv_ps(_mm256_mul_ps(low, scale), nan, low_nan);
          high = _mm256_blendv_ps(_mm256_mul_ps(high, scale), nan, high_nan);
        }
        _mm256_storeu_ps(buffer + h, low);
        _mm256_storeu_ps(buffer + h + 8, high);
      }
      for (; h < n; ++h) buffer[h] = Widen(row[h]);
      return buffer;
    }
#endif
#pragma omp simd
    for (int64_t h = 0; h < n; ++h) buffer[h] = Widen(row[h]);
    return buffer;
  }
}

#ifdef JAXINFER_DECODE_AVX2
// --- AVX2 page update: head_dim a multiple of 8 -----------------------------------------
//
// The scalar walk dotted each key with each query head through a 64-lane reduction ending
// in a horizontal sum, took one libm exp per score and added each value row into the
// weighted sums in memory: at 64 sequences of ~270 keys (SmolLM2-135M's decode step) a
// layer's attention took ~4 ms, a third of the step, against ~1 ms to read its keys and
// values. Here eight keys' dots are summed across lanes together (one transpose-add per 8
// scores), the exponentials are a vector polynomial, and each query head's weighted sums
// stay in registers across the page's value rows.

// exp(x) for x <= 0 (scores minus their running max), Cephes' single-precision scheme:
// x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-5 polynomial (~1 ulp), times 2^n.
// Below -87 the result flushes to 0 (exp(-87) ~ 1.6e-38, nothing a softmax sum can see).
inline __m256 ExpNonPositive(__m256 x) {
  const __m256 floor_value = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, floor_value, _CMP_LT_OQ);
  x = _mm256_max_ps(x, floor_value);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
  return _mm256_andnot_ps(underflow, result);
}

// The 8 lane sums of a[0 .. 8), in order, as one vector.
inline __m256 SumLanes8(const __m256 a[8]) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // s0123 = [a0 a1 a2 a3 | a0 a1 a2 a3] halves (low lanes' and high lanes' partial sums).
  const __m256 low = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 high = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(low, high);
}

// One page's keys [count] of KV head k for the G query heads: scores into
// scores[g * 64 + t] (t < count; up to the next multiple of 8 written), unscaled.
inline void PageScores(const float* keys, int64_t key_stride, int64_t count,
                       const float* query, int64_t group, int64_t head_dim, float* scores) {
  for (int64_t g = 0; g < group; ++g) {
    const float* query_row = query + g * head_dim;
    for (int64_t t0 = 0; t0 < count; t0 += 8) {
      const int64_t n = std::min<int64_t>(8, count - t0);
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t h = 0; h < head_dim; h += 8) {
        const __m256 q = _mm256_loadu_ps(query_row + h);
        for (int i = 0; i < 8; ++i) {
          if (i < n) {
            acc[i] = _mm256_fmadd_ps(q, _mm256_loadu_ps(keys + (t0 + i) * key_stride + h), acc[i]);
          }
        }
      }
      _mm256_storeu_ps(scores + g * 64 + t0, SumLanes8(acc));
    }
  }
}

// weighted[g] = weighted[g] * rescale[g] + sum_t probability[g][t] * scale_t * value_t for
// the G query heads, 64 dims at a time in 8 registers.
inline void PageValues(const float* values, int64_t value_stride, const float* value_scales,
                       int64_t scale_stride, int64_t count, const float* probability,
                       const float* rescale, int64_t group, int64_t head_dim, float* weighted) {
  for (int64_t g = 0; g < group; ++g) {
    float* out = weighted + g * head_dim;
    const __m256 factor = _mm256_set1_ps(rescale[g]);
    for (int64_t h0 = 0; h0 < head_dim; h0 += 64) {
      const int64_t width = std::min<int64_t>(64, head_dim - h0) / 8;
      __m256 acc[8];
      for (int v = 0; v < 8; ++v) {
        if (v < width) acc[v] = _mm256_mul_ps(factor, _mm256_loadu_ps(out + h0 + 8 * v));
      }
      for (int64_t t = 0; t < count; ++t) {
        const float scale = value_scales != nullptr ? value_scales[t * scale_stride] : 1.0f;
        const __m256 weight = _mm256_set1_ps(probability[g * 64 + t] * scale);
        const float* value = values + t * value_stride + h0;
        for (int v = 0; v < 8; ++v) {
          if (v < width) acc[v] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(value + 8 * v), acc[v]);
        }
      }
      for (int v = 0; v < 8; ++v) {
        if (v < width) _mm256_storeu_ps(out + h0 + 8 * v, acc[v]);
      }
    }
  }
}

// Every KV head's update for one page of `count` visible rows (head_dim a multiple of 8).
template <typename T>
void VectorPage(const T* rows, const float* row_scales, int64_t count, int64_t row_stride,
                int64_t combined, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                float soft_cap, const float* all_queries, float* all_max,
                float* all_denominator, float* all_weighted) {
  // A page's key and value rows of one head widened to float32 (non-float32 pools), per
  // thread running this task.
  static thread_local std::vector<float> widened_keys, widened_values;
  alignas(32) float scores[kMaxGroup * 64];       // [G, Z]
  alignas(32) float probability[kMaxGroup * 64];  // [G, Z]
  float rescale[kMaxGroup];
  for (int64_t k = 0; k < num_kv_heads; ++k) {
    const float* query = all_queries + k * group * head_dim;  // [G, H]
    float* m = all_max + k * group;                           // [G]
    float* d = all_denominator + k * group;                   // [G]
    float* w = all_weighted + k * group * head_dim;           // [G, H]
    const float* keys;
    const float* values;
    int64_t stride;
    if constexpr (std::is_same_v<T, float>) {
      keys = rows + 2 * k * head_dim;
      values = rows + (2 * k + 1) * head_dim;
      stride = row_stride;
    } else {
      widened_keys.resize(count * head_dim);
      widened_values.resize(count * head_dim);
      for (int64_t t = 0; t < count; ++t) {
        float* key = widened_keys.data() + t * head_dim;
        float* value = widened_values.data() + t * head_dim;
        const float* got = WidenRow(rows + t * row_stride + 2 * k * head_dim, head_dim, key);
        if (got != key) std::copy(got, got + head_dim, key);
        got = WidenRow(rows + t * row_stride + (2 * k + 1) * head_dim, head_dim, value);
        if (got != value) std::copy(got, got + head_dim, value);
      }
      keys = widened_keys.data();
      values = widened_values.data();
      stride = head_dim;
    }
    PageScores(keys, stride, count, query, group, head_dim, scores);
    for (int64_t g = 0; g < group; ++g) {
      float* row = scores + g * 64;
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < count; ++t) {
        float dot = row[t];
        if (row_scales != nullptr) dot *= row_scales[t * combined + 2 * k];
        if (soft_cap > 0.0f) dot = soft_cap * std::tanh(dot / soft_cap);
        row[t] = dot;
        block_max = std::max(block_max, dot);
      }
      const float new_max = std::max(m[g], block_max);
      rescale[g] = std::exp(m[g] - new_max);  // exp(-inf) = 0 on the first page
      const __m256 top = _mm256_set1_ps(new_max);
      __m256 total = _mm256_setzero_ps();
      for (int64_t t0 = 0; t0 < count; t0 += 8) {
        __m256 p = ExpNonPositive(_mm256_sub_ps(_mm256_load_ps(row + t0), top));
        if (count - t0 < 8) {  // lanes past the page's last row count nothing
          const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
          const __m256i live = _mm256_cmpgt_epi32(
              _mm256_set1_epi32(static_cast<int32_t>(count - t0)), lane);
          p = _mm256_and_ps(p, _mm256_castsi256_ps(live));
        }
        _mm256_store_ps(probability + g * 64 + t0, p);
        total = _mm256_add_ps(total, p);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, total);
      float sum = 0.0f;
      for (int i = 0; i < 8; ++i) sum += lanes[i];
      d[g] = d[g] * rescale[g] + sum;
      m[g] = new_max;
    }
    PageValues(values, stride, row_scales != nullptr ? row_scales + 2 * k + 1 : nullptr,
               combined, count, probability, rescale, group, head_dim, w);
  }
}
#endif  // JAXINFER_DECODE_AVX2

// Every KV head's update for one page of `count` visible rows, in plain loops (any head_dim;
// the AVX2 build takes `VectorPage` where head_dim is a multiple of 8).
template <typename T>
void ScalarPage(const T* rows, const float* row_scales, int64_t count, int64_t row_stride,
                int64_t combined, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                float soft_cap, const float* all_queries, float* all_max,
                float* all_denominator, float* all_weighted) {
  // One widened key or value row (`WidenRow`), per thread running this task.
  static thread_local std::vector<float> widened;
  widened.resize(head_dim);
  const float negative_infinity = -std::numeric_limits<float>::infinity();
  float scores[kMaxGroup * 64];  // [G, Z] one page of scores
  for (int64_t k = 0; k < num_kv_heads; ++k) {
    const float* query = all_queries + k * group * head_dim;  // [G, H]
    float* m = all_max + k * group;                           // [G]
    float* d = all_denominator + k * group;                   // [G]
    float* w = all_weighted + k * group * head_dim;           // [G, H]
    // Scores of this page's visible keys for every query head: each key is loaded once and
    // dotted with the G queries while it is in registers.
    float block_max[kMaxGroup];
    for (int64_t g = 0; g < group; ++g) block_max[g] = negative_infinity;
    for (int64_t t = 0; t < count; ++t) {
      const float* key = WidenRow(rows + t * row_stride + 2 * k * head_dim, head_dim,
                                  widened.data());
      const float key_scale = row_scales != nullptr ? row_scales[t * combined + 2 * k] : 1.0f;
      for (int64_t g = 0; g < group; ++g) {
        const float* query_row = query + g * head_dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t h = 0; h < head_dim; ++h) dot += query_row[h] * key[h];
        dot *= key_scale;
        if (soft_cap > 0.0f) dot = soft_cap * std::tanh(dot / soft_cap);
        scores[g * 64 + t] = dot;
        block_max[g] = std::max(block_max[g], dot);
      }
    }
    // One online-softmax update per page: rescale the running sums once, then add the
    // page's probabilities and weighted values.
    float probability[kMaxGroup * 64];
    for (int64_t g = 0; g < group; ++g) {
      const float new_max = std::max(m[g], block_max[g]);
      const float rescale = std::exp(m[g] - new_max);  // exp(-inf) = 0 on the first page
      float* weighted = w + g * head_dim;
      d[g] *= rescale;
#pragma omp simd
      for (int64_t h = 0; h < head_dim; ++h) weighted[h] *= rescale;
      float sum = 0.0f;
      for (int64_t t = 0; t < count; ++t) {
        probability[g * 64 + t] = std::exp(scores[g * 64 + t] - new_max);
        sum += probability[g * 64 + t];
      }
      d[g] += sum;
      m[g] = new_max;
    }
    for (int64_t t = 0; t < count; ++t) {
      const float* value = WidenRow(rows + t * row_stride + (2 * k + 1) * head_dim, head_dim,
                                    widened.data());
      const float value_scale =
          row_scales != nullptr ? row_scales[t * combined + 2 * k + 1] : 1.0f;
      for (int64_t g = 0; g < group; ++g) {
        const float weight = probability[g * 64 + t] * value_scale;
        float* weighted = w + g * head_dim;
#pragma omp simd
        for (int64_t h = 0; h < head_dim; ++h) weighted[h] += weight * value[h];
      }
    }
  }
}

// One page's update, by the fastest path this build has for the head size.
template <typename T>
void UpdatePage(const T* rows, const float* row_scales, int64_t count, int64_t row_stride,
                int64_t combined, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                float soft_cap, const float* all_queries, float* all_max,
                float* all_denominator, float* all_weighted) {
#ifdef JAXINFER_DECODE_AVX2
  if (head_dim % 8 == 0) {
    VectorPage(rows, row_scales, count, row_stride, combined, num_kv_heads, group, head_dim,
               soft_cap, all_queries, all_max, all_denominator, all_weighted);
    return;
  }
#endif
  ScalarPage(rows, row_scales, count, row_stride, combined, num_kv_heads, group, head_dim,
             soft_cap, all_queries, all_max, all_denominator, all_weighted);
}

// Where a page's first visible row is: `rows` of the pool's element type (rows `row_stride`
// apart, every head's key and value interleaved as in the pool) and their per-row scales
// (`combined` apart) or null.
template <typename T>
struct PageRows {
  const T* rows;
  const float* scales;
};

// Reader: `PageRows<T> read(q, page_number, page, row0, count)`, the rows [row0, row0 + count)
// of physical page `page`, the `page_number`-th of sequence q's table.
template <typename T, typename Reader>
void Walk(ffi::ThreadPool& pool, const Reader& read, const int32_t* page_indices,
          const float* queries, const int32_t* context, const int32_t* position,
          int64_t num_seqs, int64_t pages_per_seq, int64_t page_size, int64_t num_kv_heads,
          int64_t group, int64_t head_dim, int32_t window, float soft_cap, int32_t num_threads,
          float* out_max, float* out_denominator, float* out_weighted) {
  const int64_t combined = 2 * num_kv_heads;
  const int64_t row_stride = combined * head_dim;
  const float negative_infinity = -std::numeric_limits<float>::infinity();
  // One task per sequence, and each page's K heads in turn while the page is in cache: the
  // rows of a page interleave every head's keys and values, so walking (sequence, head) pairs
  // separately would pull each row from memory K times.
  jaxinfer::ParallelFor(pool, num_seqs, num_threads, [&](int64_t q) {
    const float* all_queries = queries + q * num_kv_heads * group * head_dim;  // [K, G, H]
    float* all_max = out_max + q * num_kv_heads * group;                     // [K, G]
    float* all_denominator = out_denominator + q * num_kv_heads * group;     // [K, G]
    float* all_weighted = out_weighted + q * num_kv_heads * group * head_dim;  // [K, G, H]
    for (int64_t i = 0; i < num_kv_heads * group; ++i) {
      all_max[i] = negative_infinity;
      all_denominator[i] = 0.0f;
    }
    std::fill(all_weighted, all_weighted + num_kv_heads * group * head_dim, 0.0f);
    const int64_t keys = context[q];
    if (keys <= 0) return;
    // Keys at positions > position - window are visible (window counts the query itself).
    const int64_t first = std::max<int64_t>(0, static_cast<int64_t>(position[q]) - window + 1);
    for (int64_t start = first - first % page_size; start < keys; start += page_size) {
      const int64_t page_number = start / page_size;
      const int64_t page = page_indices[q * pages_per_seq + page_number];
      const int64_t begin = std::max(start, first);
      const int64_t end = std::min(start + page_size, keys);
      const int64_t count = end - begin;
      if (count <= 0) continue;  // a window that starts past the context: no visible key
      const PageRows<T> got = read(q, page_number, page, begin - start, count);
      UpdatePage(got.rows, got.scales, count, row_stride, combined, num_kv_heads, group,
                 head_dim, soft_cap, all_queries, all_max, all_denominator, all_weighted);
    }
  });
}

// --- KIVI pages (`kivi.py`) --------------------------------------------------------------

using jaxinfer::HalfToFloat;

// A KIVI pool's arrays at one layer (shapes as in `kivi.py`, without the layer axis).
struct KiviLayer {
  const uint8_t* packed;         // [P, Z, 2K, H * bits / 8] codes, low bits first
  const uint16_t* key_scales;    // [P, K, H] float16, per page and key channel
  const uint16_t* key_zeros;     // [P, K, H]
  const uint16_t* value_scales;  // [P, Z, K, H / g] float16, per row and value group
  const uint16_t* value_zeros;   // [P, Z, K, H / g]
  const float* residual;         // [R, Z, 2K, H] exact rows of each seat's partial page
  int64_t page_size, num_kv_heads, head_dim, bits, value_group;
};

// One packed head row (element h in byte h / (8 / bits), low bits first) dequantized:
// out[h] = code_h * scale[h] + zero[h] (per-channel scales and zero points, widened).
inline void DequantizeRow(const uint8_t* bytes, int64_t head_dim, int64_t bits,
                          const float* scale, const float* zero, float* out) {
  int64_t h = 0;
#ifdef JAXINFER_DECODE_AVX2
  if (bits == 4) {  // 8 bytes -> 16 codes: low and high nibbles interleaved byte-wise
    const __m128i nibble = _mm_set1_epi8(0x0f);
    for (; h + 16 <= head_dim; h += 16) {
      const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + h / 2));
      const __m128i low = _mm_and_si128(packed, nibble);
      const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
      const __m128i ordered = _mm_unpacklo_epi8(low, high);  // c0 c1 ... c15
      const __m256 first = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ordered));
      const __m256 second = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(ordered, 8)));
      _mm256_storeu_ps(out + h, _mm256_fmadd_ps(first, _mm256_loadu_ps(scale + h),
                                                _mm256_loadu_ps(zero + h)));
      _mm256_storeu_ps(out + h + 8, _mm256_fmadd_ps(second, _mm256_loadu_ps(scale + h + 8),
                                                    _mm256_loadu_ps(zero + h + 8)));
    }
  } else if (bits == 2) {  // 2 bytes -> 8 codes: each byte replicated 4x, shifted per code
    const __m128i replicate = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    for (; h + 8 <= head_dim; h += 8) {
      uint16_t word;
      std::memcpy(&word, bytes + h / 4, sizeof(word));
      const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(word), replicate);
      const __m256i codes = _mm256_and_si256(
          _mm256_srlv_epi32(_mm256_cvtepu8_epi32(spread), shifts), _mm256_set1_epi32(3));
      _mm256_storeu_ps(out + h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes),
                                                _mm256_loadu_ps(scale + h),
                                                _mm256_loadu_ps(zero + h)));
    }
  }
#endif
  const int64_t per_byte = 8 / bits;
  const uint32_t mask = (1u << bits) - 1;
  for (; h < head_dim; ++h) {
    const float code =
        static_cast<float>((bytes[h / per_byte] >> ((h % per_byte) * bits)) & mask);
    out[h] = code * scale[h] + zero[h];
  }
}

// n float16 values widened into `out` (8 at a time with F16C).
inline void WidenHalves(const uint16_t* halves, int64_t n, float* out) {
  int64_t i = 0;
#ifdef JAXINFER_DECODE_F16C
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + i))));
  }
#endif
  for (; i < n; ++i) out[i] = HalfToFloat(halves[i]);
}

// Rows [row0, row0 + count) of a quantized page, dequantized to float32 [count, 2K, H] in
// `out` as `kivi.dequantize` does: a key code c is c * scale + zero of its page and channel,
// a value code c * scale + zero of its row and group of g channels (float16 scales, widened).
void DequantizeKiviRows(const KiviLayer& kivi, int64_t page, int64_t row0, int64_t count,
                        float* out) {
  const int64_t num_kv_heads = kivi.num_kv_heads, head_dim = kivi.head_dim;
  const int64_t row_bytes = head_dim * kivi.bits / 8, value_group = kivi.value_group;
  const int64_t groups = head_dim / value_group;
  // Per channel: the page's key scales and zero points, then each row's value group scales
  // spread over their channels (so that one fused multiply-add dequantizes every code).
  static thread_local std::vector<float> buffer;
  buffer.resize(2 * num_kv_heads * head_dim + 2 * head_dim);
  // Thread-local buffers are reached through a call in a shared library: once, here.
  float* const page_scale = buffer.data();                          // [K, H]
  float* const page_zero = page_scale + num_kv_heads * head_dim;    // [K, H]
  float* const value_scale = page_zero + num_kv_heads * head_dim;   // [H]
  float* const value_zero = value_scale + head_dim;                 // [H]
  WidenHalves(kivi.key_scales + page * num_kv_heads * head_dim, num_kv_heads * head_dim,
              page_scale);
  WidenHalves(kivi.key_zeros + page * num_kv_heads * head_dim, num_kv_heads * head_dim,
              page_zero);
  for (int64_t t = 0; t < count; ++t) {
    const int64_t row = page * kivi.page_size + row0 + t;
    const uint8_t* packed_row = kivi.packed + row * 2 * num_kv_heads * row_bytes;
    const uint16_t* value_scales = kivi.value_scales + row * num_kv_heads * groups;
    const uint16_t* value_zeros = kivi.value_zeros + row * num_kv_heads * groups;
    for (int64_t k = 0; k < num_kv_heads; ++k) {
      float* key = out + (t * 2 * num_kv_heads + 2 * k) * head_dim;  // [H]
      DequantizeRow(packed_row + 2 * k * row_bytes, head_dim, kivi.bits,
                    page_scale + k * head_dim, page_zero + k * head_dim, key);
      for (int64_t group = 0; group < groups; ++group) {
        std::fill_n(value_scale + group * value_group, value_group,
                    HalfToFloat(value_scales[k * groups + group]));
        std::fill_n(value_zero + group * value_group, value_group,
                    HalfToFloat(value_zeros[k * groups + group]));
      }
      DequantizeRow(packed_row + (2 * k + 1) * row_bytes, head_dim, kivi.bits, value_scale,
                    value_zero, key + head_dim);
    }
  }
}

// Decode attention over a KIVI pool: quantized pages are dequantized a page at a time into a
// float32 buffer the page update reads while it is in cache; a sequence's partial last page
// (page number kv_len / Z, kv_len = position + 1) is its residual seat's exact rows.
ffi::Error DecodeKiviImpl(ffi::ThreadPool threads, ffi::Buffer<ffi::U8> pages,
                          ffi::Buffer<ffi::F16> key_scales, ffi::Buffer<ffi::F16> key_zeros,
                          ffi::Buffer<ffi::F16> value_scales, ffi::Buffer<ffi::F16> value_zeros,
                          ffi::Buffer<ffi::F32> residual, ffi::Buffer<ffi::S32> seats,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> page_indices,
                          ffi::Buffer<ffi::F32> queries, ffi::Buffer<ffi::S32> context,
                          ffi::Buffer<ffi::S32> position, int32_t window, float soft_cap,
                          int32_t num_threads, ffi::ResultBuffer<ffi::F32> out_max,
                          ffi::ResultBuffer<ffi::F32> out_denominator,
                          ffi::ResultBuffer<ffi::F32> out_weighted) {
  auto pool = pages.dimensions();            // [L, P, Z, 2K, H * bits / 8]
  auto exact = residual.dimensions();        // [L, R, Z, 2K, H]
  auto value_shape = value_scales.dimensions();  // [L, P, Z, K, H / g]
  auto query_shape = queries.dimensions();   // [Q, K, G, H]
  if (pool.size() != 5 || exact.size() != 5 || value_shape.size() != 5 ||
      query_shape.size() != 4) {
    return ffi::Error::InvalidArgument("KIVI pool, residual, value scales or queries of the wrong rank");
  }
  const int64_t num_layers = pool[0], num_pages = pool[1], page_size = pool[2];
  const int64_t num_seats = exact[1], head_dim = exact[4];
  const int64_t num_seqs = query_shape[0], num_kv_heads = query_shape[1];
  const int64_t group = query_shape[2];
  if (page_size > 64) return ffi::Error::InvalidArgument("page size above 64");
  if (group > kMaxGroup) return ffi::Error::InvalidArgument("more than 16 query heads per KV head");
  if (pool[4] <= 0 || (8 * pool[4]) % head_dim != 0 || value_shape[4] <= 0 ||
      head_dim % value_shape[4] != 0) {
    return ffi::Error::InvalidArgument("packed rows or value groups do not fit head_dim");
  }
  const int64_t bits = 8 * pool[4] / head_dim;
  if (bits != 1 && bits != 2 && bits != 4 && bits != 8) {
    return ffi::Error::InvalidArgument("KIVI codes of 1, 2, 4 or 8 bits");
  }
  const int64_t index = std::clamp<int64_t>(layer.typed_data()[0], 0, num_layers - 1);
  const int64_t combined = 2 * num_kv_heads, row_stride = combined * head_dim;
  const int64_t layer_keys = num_pages * num_kv_heads * head_dim;
  const int64_t layer_values = num_pages * page_size * value_shape[3] * value_shape[4];
  const KiviLayer kivi{
      pages.typed_data() + index * num_pages * page_size * combined * pool[4],
      key_scales.typed_data() + index * layer_keys, key_zeros.typed_data() + index * layer_keys,
      value_scales.typed_data() + index * layer_values,
      value_zeros.typed_data() + index * layer_values,
      residual.typed_data() + index * num_seats * page_size * row_stride,
      page_size, num_kv_heads, head_dim, bits, head_dim / value_shape[4]};
  const int32_t* seat = seats.typed_data();
  const int32_t* query_position = position.typed_data();
  auto read = [&](int64_t q, int64_t page_number, int64_t page, int64_t row0, int64_t count) {
    const int64_t kv_len = static_cast<int64_t>(query_position[q]) + 1;
    if (page_number == kv_len / page_size) {
      const int64_t chosen = std::clamp<int64_t>(seat[q], 0, num_seats - 1);
      return PageRows<float>{kivi.residual + (chosen * page_size + row0) * row_stride, nullptr};
    }
    static thread_local std::vector<float> rows;  // [count, 2K, H], per thread
    rows.resize(count * row_stride);
    DequantizeKiviRows(kivi, page, row0, count, rows.data());
    return PageRows<float>{rows.data(), nullptr};
  };
  Walk<float>(threads, read, page_indices.typed_data(), queries.typed_data(),
              context.typed_data(), query_position, num_seqs, page_indices.dimensions()[1],
              page_size, num_kv_heads, group, head_dim, window, soft_cap,
              std::max<int32_t>(1, num_threads), out_max->typed_data(),
              out_denominator->typed_data(), out_weighted->typed_data());
  return ffi::Error::Success();
}

// Kind: the pool's XLA type; Element: how its elements decode. The pool comes as an AnyBuffer,
// read through `untyped_data`: this FFI maps no C++ type to its float8 kinds, and taking the
// float8 pool as itself (not a uint8 bitcast of it, which XLA:CPU materializes) is what keeps
// XLA from copying the whole pool every call.
template <ffi::DataType Kind, typename Element>
ffi::Error DecodeImpl(ffi::ThreadPool threads, ffi::AnyBuffer pages, ffi::Buffer<ffi::F32> scales,
                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> page_indices,
                      ffi::Buffer<ffi::F32> queries, ffi::Buffer<ffi::S32> context,
                      ffi::Buffer<ffi::S32> position, int32_t window, float soft_cap,
                      bool quantized, int32_t num_threads, ffi::ResultBuffer<ffi::F32> out_max,
                      ffi::ResultBuffer<ffi::F32> out_denominator,
                      ffi::ResultBuffer<ffi::F32> out_weighted) {
  if (pages.element_type() != Kind) return ffi::Error::InvalidArgument("pages of another dtype");
  auto pool = pages.dimensions();  // [L, P, Z, 2K, H]
  auto query_shape = queries.dimensions();  // [Q, K, G, H]
  if (pool.size() != 5 || query_shape.size() != 4) {
    return ffi::Error::InvalidArgument("pages must be [L, P, Z, 2K, H], queries [Q, K, G, H]");
  }
  const int64_t num_pages = pool[1], page_size = pool[2], head_dim = pool[4];
  const int64_t num_seqs = query_shape[0], num_kv_heads = query_shape[1];
  const int64_t group = query_shape[2];
  if (page_size > 64) return ffi::Error::InvalidArgument("page size above 64");
  if (group > kMaxGroup) return ffi::Error::InvalidArgument("more than 16 query heads per KV head");
  const int64_t index = layer.typed_data()[0];
  const Element* base = static_cast<const Element*>(pages.untyped_data()) +
                        index * num_pages * page_size * 2 * num_kv_heads * head_dim;
  const float* scale_base =
      quantized ? scales.typed_data() + index * num_pages * page_size * 2 * num_kv_heads
                : nullptr;
  const int64_t combined = 2 * num_kv_heads;
  const int64_t row_stride = combined * head_dim, page_stride = page_size * row_stride;
  auto read = [&](int64_t, int64_t, int64_t page, int64_t row0, int64_t) {
    return PageRows<Element>{
        base + page * page_stride + row0 * row_stride,
        scale_base != nullptr ? scale_base + (page * page_size + row0) * combined : nullptr};
  };
  Walk<Element>(threads, read, page_indices.typed_data(), queries.typed_data(),
                context.typed_data(), position.typed_data(), num_seqs,
                page_indices.dimensions()[1], page_size, num_kv_heads, group, head_dim, window,
                soft_cap, std::max<int32_t>(1, num_threads), out_max->typed_data(),
                out_denominator->typed_data(), out_weighted->typed_data());
  return ffi::Error::Success();
}

#define DEFINE_DECODE(name, kind, element)                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (DecodeImpl<kind, element>),    \
                                ffi::Ffi::Bind()                      \
                                    .Ctx<ffi::ThreadPool>()           \
                                    .Arg<ffi::AnyBuffer>()            \
                                    .Arg<ffi::Buffer<ffi::F32>>()     \
                                    .Arg<ffi::Buffer<ffi::S32>>()     \
                                    .Arg<ffi::Buffer<ffi::S32>>()     \
                                    .Arg<ffi::Buffer<ffi::F32>>()     \
                                    .Arg<ffi::Buffer<ffi::S32>>()     \
                                    .Arg<ffi::Buffer<ffi::S32>>()     \
                                    .Attr<int32_t>("window")          \
                                    .Attr<float>("soft_cap")          \
                                    .Attr<bool>("quantized")          \
                                    .Attr<int32_t>("num_threads")     \
                                    .Ret<ffi::Buffer<ffi::F32>>()     \
                                    .Ret<ffi::Buffer<ffi::F32>>()     \
                                    .Ret<ffi::Buffer<ffi::F32>>());

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionKivi, DecodeKiviImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("num_threads")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
DEFINE_DECODE(DecodeAttentionF32, ffi::DataType::F32, float)
DEFINE_DECODE(DecodeAttentionBF16, ffi::DataType::BF16, uint16_t)
DEFINE_DECODE(DecodeAttentionS8, ffi::DataType::S8, int8_t)
DEFINE_DECODE(DecodeAttentionF8E4M3, ffi::DataType::F8E4M3FN, E4M3)
DEFINE_DECODE(DecodeAttentionF8E5M2, ffi::DataType::F8E5M2, E5M2)
