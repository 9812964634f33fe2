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
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define JAXINFER_DECODE_F16C 1
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

template <typename T>
void Walk(ffi::ThreadPool& pool, const T* pages, const float* scales, const int32_t* page_indices,
          const float* queries, const int32_t* context, const int32_t* position,
          int64_t num_seqs, int64_t pages_per_seq, int64_t page_size, int64_t num_kv_heads,
          int64_t group, int64_t head_dim, int32_t window, float soft_cap, int32_t num_threads,
          float* out_max,
          float* out_denominator, float* out_weighted) {
  const int64_t combined = 2 * num_kv_heads;
  const int64_t page_stride = page_size * combined * head_dim;
  const int64_t row_stride = combined * head_dim;
  const float negative_infinity = -std::numeric_limits<float>::infinity();
  // One task per sequence, and each page's K heads in turn while the page is in cache: the
  // rows of a page interleave every head's keys and values, so walking (sequence, head) pairs
  // separately would pull each row from memory K times.
  jaxinfer::ParallelFor(pool, num_seqs, num_threads, [&](int64_t q) {
    // One widened key or value row (`WidenRow`), per thread running this task.
    static thread_local std::vector<float> widened;
    widened.resize(head_dim);
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
    float scores[kMaxGroup * 64];  // [G, Z] one page of scores
    for (int64_t start = first - first % page_size; start < keys; start += page_size) {
      const int64_t page = page_indices[q * pages_per_seq + start / page_size];
      const int64_t begin = std::max(start, first);
      const int64_t end = std::min(start + page_size, keys);
      const int64_t count = end - begin;
      const T* rows = pages + page * page_stride + (begin - start) * row_stride;
      const float* row_scales =
          scales != nullptr ? scales + (page * page_size + (begin - start)) * combined : nullptr;
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
  });
}

// Kind: the buffer's XLA type; Element: how its elements decode (the float8 pools come as U8,
// since this jaxlib's FFI takes no float8 buffers, and are told apart by Element).
template <ffi::DataType Kind, typename Element>
ffi::Error DecodeImpl(ffi::ThreadPool threads, ffi::Buffer<Kind> pages, ffi::Buffer<ffi::F32> scales,
                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> page_indices,
                      ffi::Buffer<ffi::F32> queries, ffi::Buffer<ffi::S32> context,
                      ffi::Buffer<ffi::S32> position, int32_t window, float soft_cap,
                      bool quantized, int32_t num_threads, ffi::ResultBuffer<ffi::F32> out_max,
                      ffi::ResultBuffer<ffi::F32> out_denominator,
                      ffi::ResultBuffer<ffi::F32> out_weighted) {
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
  const Element* base = reinterpret_cast<const Element*>(pages.typed_data()) +
                        index * num_pages * page_size * 2 * num_kv_heads * head_dim;
  const float* scale_base =
      quantized ? scales.typed_data() + index * num_pages * page_size * 2 * num_kv_heads
                : nullptr;
  Walk<Element>(threads, base, scale_base, page_indices.typed_data(), queries.typed_data(),
                context.typed_data(), position.typed_data(), num_seqs,
                page_indices.dimensions()[1], page_size, num_kv_heads, group, head_dim, window,
                soft_cap, std::max<int32_t>(1, num_threads), out_max->typed_data(), out_denominator->typed_data(),
                out_weighted->typed_data());
  return ffi::Error::Success();
}

#define DEFINE_DECODE(name, kind, element)                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (DecodeImpl<kind, element>),    \
                                ffi::Ffi::Bind()                      \
                                    .Ctx<ffi::ThreadPool>()           \
                                    .Arg<ffi::Buffer<kind>>()         \
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

DEFINE_DECODE(DecodeAttentionF32, ffi::DataType::F32, float)
DEFINE_DECODE(DecodeAttentionBF16, ffi::DataType::BF16, uint16_t)
DEFINE_DECODE(DecodeAttentionS8, ffi::DataType::S8, int8_t)
DEFINE_DECODE(DecodeAttentionF8E4M3, ffi::DataType::U8, E4M3)
DEFINE_DECODE(DecodeAttentionF8E5M2, ffi::DataType::U8, E5M2)
