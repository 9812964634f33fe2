// Weight-quantized matmuls for XLA:CPU at the row counts of decode steps, as XLA FFI custom
// calls: the packed weight is streamed as stored and dequantized in registers.
//
// The XLA path of these formats (`reference.py`) dequantizes the whole weight to float32 and
// then multiplies: every step reads the packed bytes, writes a float32 copy 8x (int4) or 4x
// (int8) their size and reads it back, so a 4-bit model ran slower than its float32 original
// (`benchmarks/results/engine.md`). Here each weight byte is read once per step.
//
//   out[M, N] = x[M, K] @ dequantize(w[layer])
//
// Formats (the registry's layouts, `formats.py`), a stack of L matrices read in place:
//   int4  packed u8 [L, K / 2, N], low nibble row 2i, high nibble row 2i + 1, signed
//         two's-complement nibbles q; scales f32 [L, C, N], zeros f32 or s8 [L, C, N] or none;
//         w = (q - z) * s per group of `group_size` rows (GGUF Q4_0 / Q4_1, GPTQ, RTN).
//   int8  s8 [L, K, N]; scales f32 [L, C, N] (C = 1: per channel, the "int8" format; C = K /
//         group_size: "int8_grouped", GGUF Q8_0); w = q * s.
//
// Within a group the products are summed on the integer levels and scaled once at the group's
// end: sum_k x_k (q_k - z) s = s (sum_k x_k u_k - (z + 8) sum_k x_k) with u = q + 8 in
// [0, 15] (the nibble with its sign bit flipped), so the inner loop is convert-and-FMA only.
//
// Work split: column tiles of 64 (one cache line of int8, two of int4 row pairs) shared over
// `num_threads` tasks on XLA's pool (`cpu_parallel.h`). A tile walks its group's rows in
// sub-blocks of 16 columns, each with R <= 4 rows of x in 2R accumulators; the group's lines
// stay in L1 across the sub-blocks. int8 weights times int8 activations of one or two rows
// stream four stored rows at a time instead (`StreamInt8Groups`). Built with AVX2 + FMA (every x86 CPU of the last decade,
// AVX-512 ones included); elsewhere a scalar loop computes the same sums
// (`JaxinferQuantMatmulVectorized` says which, and the Python side keeps XLA's path there).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_panel.h"
#include "cpu_parallel.h"

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define JAXINFER_QUANT_AVX2 1
#endif

namespace ffi = xla::ffi;

extern "C" int JaxinferQuantMatmulVectorized() {
#ifdef JAXINFER_QUANT_AVX2
  return 1;
#else
  return 0;
#endif
}

namespace {

constexpr int64_t kBlock = 32;  // features per int8 activation scale (llama.cpp's Q8 block)
static_assert(kBlock == 32, "QuantizeActivations packs a block as four 8-lane vectors");
constexpr int64_t kTile = 64;  // output columns per task
constexpr int64_t kSub = 32;   // output columns per register block (four 8-float vectors)
// Rows per walk group of a per-channel int8 weight (see Problem::group).
constexpr int64_t kWalkRows = 32;

// Inputs of one product, the layer's matrices already located.
struct Problem {
  const float* x;        // [M, K]
  const uint8_t* w;      // int4: [K / 2, N] packed; int8: [K, N] as bytes
  const float* scales;   // [C, N]
  const float* zeros;    // [C, N] float32, or nullptr
  const int8_t* zeros8;  // [C, N] int8 (RTN's), or nullptr: read and widened in registers
  const float* sums;     // [M, C] sum of x over each group
  float* out;            // [M, N]
  // `group`: rows summed before one scaling (the walk's unit, and the threads' split);
  // `scale_group`: rows per stored scale, a multiple of `group` (per-channel int8 walks in
  // groups of kWalkRows under its one scale row, so its rows can be split over threads too).
  int64_t rows, depth, columns, group, scale_group;
  // With int8 activations: x per row and block of kBlock features as int8 levels and scales.
  const int8_t* x_levels = nullptr;  // [M, K]
  const float* x_scales = nullptr;   // [M, K / kBlock]
};

#ifdef JAXINFER_QUANT_AVX2

// Bytes ahead, along the stored row being read, that are prefetched. A group's rows are
// read left to right in 32-byte steps, 16-32 rows (streams) at once, `columns` bytes apart:
// more streams than the hardware prefetchers followed (the loads stalled on L3 and DRAM).
// The float walk prefetches kAhead bytes along the row; the int8-activation walk the same
// bytes of the next group (the next stored rows, contiguous): a row of SmolLM2's layers is
// 192-1536 bytes, so 512 bytes ahead fell mostly within the group already being read. One
// group ahead read its int4 layers at ~19 GB/s instead of ~16 (2-vCPU EPYC, ~30 GB/s).
constexpr int64_t kAhead = 512;

// acc[r][v] += x[r] * level(bytes[8v .. 8v + 8)) for R rows of x and 32 columns (bytes
// holds one stored row's 32 levels). Each 8-column part is widened and used at once, so
// the levels never occupy registers beyond the one in flight (16 vector registers hold the
// 8 accumulators, the masks and the part).
template <int R, bool kSigned>
inline void Accumulate(__m256i bytes, const float* x, int64_t ldx, __m256 acc[R][4]) {
  __m256 xv[R];
  for (int r = 0; r < R; ++r) xv[r] = _mm256_broadcast_ss(x + r * ldx);
  for (int v = 0; v < 4; ++v) {
    const __m128i half = v < 2 ? _mm256_castsi256_si128(bytes) : _mm256_extracti128_si256(bytes, 1);
    const __m128i part = (v % 2 == 0) ? half : _mm_srli_si128(half, 8);
    const __m256 level = _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(part)
                                                    : _mm256_cvtepu8_epi32(part));
    for (int r = 0; r < R; ++r) acc[r][v] = _mm256_fmadd_ps(xv[r], level, acc[r][v]);
  }
}

// Group sums over one group of rows for R rows of x and 32 columns: into a[R][4] (even
// weight rows) and b[R][4] (odd ones), two independent sets of chains.
template <int R, bool kInt4>
inline void GroupSums(const Problem& p, int64_t r0, int64_t k0, int64_t c0, __m256 a[R][4],
                      __m256 b[R][4]) {
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) a[r][v] = b[r][v] = _mm256_setzero_ps();
  }
  const float* x = p.x + r0 * p.depth + k0;
  if (kInt4) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x88));
    const __m256i low_mask = _mm256_set1_epi8(0x0F);
    const uint8_t* row = p.w + (k0 / 2) * p.columns + c0;
    for (int64_t i = 0; i < p.group / 2; ++i, row += p.columns) {
      _mm_prefetch(reinterpret_cast<const char*>(row + kAhead), _MM_HINT_T0);
      const __m256i packed = _mm256_xor_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)), flip);
      Accumulate<R, false>(_mm256_and_si256(packed, low_mask), x + 2 * i, p.depth, a);
      Accumulate<R, false>(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low_mask),
                           x + 2 * i + 1, p.depth, b);
    }
  } else {
    const uint8_t* row = p.w + k0 * p.columns + c0;
    for (int64_t i = 0; i < p.group; i += 2, row += 2 * p.columns) {
      _mm_prefetch(reinterpret_cast<const char*>(row + kAhead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row + p.columns + kAhead), _MM_HINT_T0);
      Accumulate<R, true>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)), x + i,
                          p.depth, a);
      Accumulate<R, true>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + p.columns)),
                          x + i + 1, p.depth, b);
    }
  }
}

// out[r0 .. r0 + R, c0 .. c0 + 32) (+)= group g's sums[r][v] (sum_k x_k level_k of 8 columns
// each), scaled, and for int4 offset by (z + 8) sum_k x_k (u = q + 8).
template <int R, bool kInt4>
inline void ApplyGroup(const Problem& p, int64_t r0, int64_t g, int64_t c0, bool first,
                       const __m256 sums[R][4]) {
  const int64_t groups = p.depth / p.group;
  const int64_t stored = g * p.group / p.scale_group;  // the scale (and zero) row
  const float* scale = p.scales + stored * p.columns + c0;
  const float* zero = p.zeros != nullptr ? p.zeros + stored * p.columns + c0 : nullptr;
  const int8_t* zero8 = p.zeros8 != nullptr ? p.zeros8 + stored * p.columns + c0 : nullptr;
  for (int v = 0; v < 4; ++v) {
    const __m256 s = _mm256_loadu_ps(scale + 8 * v);
    __m256 z = _mm256_setzero_ps();
    if (zero != nullptr) {
      z = _mm256_loadu_ps(zero + 8 * v);
    } else if (zero8 != nullptr) {
      z = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(zero8 + 8 * v))));
    }
    const __m256 offset = kInt4 ? _mm256_add_ps(_mm256_set1_ps(8.0f), z) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m256 sum = sums[r][v];
      if (kInt4) sum = _mm256_fnmadd_ps(offset, _mm256_set1_ps(p.sums[(r0 + r) * groups + g]), sum);
      float* out = p.out + (r0 + r) * p.columns + c0 + 8 * v;
      const __m256 total = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out);
      _mm256_storeu_ps(out, _mm256_fmadd_ps(s, sum, total));
    }
  }
}

// Group g's contribution with float activations.
template <int R, bool kInt4>
inline void GroupBlock(const Problem& p, int64_t r0, int64_t g, int64_t c0, bool first) {
  __m256 a[R][4], b[R][4];
  GroupSums<R, kInt4>(p, r0, g * p.group, c0, a, b);
  __m256 sums[R][4];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) sums[r][v] = _mm256_add_ps(a[r][v], b[r][v]);
  }
  ApplyGroup<R, kInt4>(p, r0, g, c0, first, sums);
}

// --- int8 activations: integer products (maddubs), as llama.cpp's Q4 x Q8 dots ---------
//
// x is quantized per row and block of 32 features to int8 levels xq with a scale dx, and
// each block's products are summed exactly in integers: sum_k xq_k u_k (int4, u = q + 8 in
// [0, 15]) or sum_k xq_k q_k (int8), then scaled by dx in float. Four consecutive features
// of one column sit in four consecutive bytes ("quads", built from two packed rows or four
// int8 rows by byte and word interleaves), so `maddubs` multiplies them by the block's four
// activation levels and adds pairs into int16. For int4 the int16 sums of a block's 8 quads
// stay below 8 * 2 * 15 * 127 = 30480 and are widened once per block; int8 pairs reach
// 2 * 128 * 127 and are widened per quad. The interleaves leave a register's 8 int32 lanes
// holding columns {0-3, 16-19}, {4-7, 20-23}, {8-11, 24-27}, {12-15, 28-31} of the 32; the
// group's float sums are put back in column order once per group (`Unpermute`).

// The 4 quads (32 columns x 4 features) of two packed int4 rows (features k .. k + 3).
inline void Int4Quads(const uint8_t* row, int64_t columns, __m256i quads[4]) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x88));
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i first = _mm256_xor_si256(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)), flip);
  const __m256i second = _mm256_xor_si256(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + columns)), flip);
  const __m256i k0 = _mm256_and_si256(first, low_mask);
  const __m256i k1 = _mm256_and_si256(_mm256_srli_epi16(first, 4), low_mask);
  const __m256i k2 = _mm256_and_si256(second, low_mask);
  const __m256i k3 = _mm256_and_si256(_mm256_srli_epi16(second, 4), low_mask);
  const __m256i pairs01_low = _mm256_unpacklo_epi8(k0, k1), pairs01_high = _mm256_unpackhi_epi8(k0, k1);
  const __m256i pairs23_low = _mm256_unpacklo_epi8(k2, k3), pairs23_high = _mm256_unpackhi_epi8(k2, k3);
  quads[0] = _mm256_unpacklo_epi16(pairs01_low, pairs23_low);
  quads[1] = _mm256_unpackhi_epi16(pairs01_low, pairs23_low);
  quads[2] = _mm256_unpacklo_epi16(pairs01_high, pairs23_high);
  quads[3] = _mm256_unpackhi_epi16(pairs01_high, pairs23_high);
}

// The 4 quads of four int8 rows.
inline void Int8Quads(const uint8_t* row, int64_t columns, __m256i quads[4]) {
  __m256i r[4];
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i * columns));
  }
  const __m256i pairs01_low = _mm256_unpacklo_epi8(r[0], r[1]), pairs01_high = _mm256_unpackhi_epi8(r[0], r[1]);
  const __m256i pairs23_low = _mm256_unpacklo_epi8(r[2], r[3]), pairs23_high = _mm256_unpackhi_epi8(r[2], r[3]);
  quads[0] = _mm256_unpacklo_epi16(pairs01_low, pairs23_low);
  quads[1] = _mm256_unpackhi_epi16(pairs01_low, pairs23_low);
  quads[2] = _mm256_unpacklo_epi16(pairs01_high, pairs23_high);
  quads[3] = _mm256_unpackhi_epi16(pairs01_high, pairs23_high);
}

// Float sums of one group for R rows and 32 columns (permuted order): sum over the group's
// blocks of dx_b * (integer block sum).
template <int R, bool kInt4>
inline void IntegerGroupSums(const Problem& p, int64_t r0, int64_t k0, int64_t c0,
                             __m256 sums[R][4]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) sums[r][j] = _mm256_setzero_ps();
  }
  const int64_t blocks_per_row = p.depth / kBlock;
  const int64_t ahead = (kInt4 ? p.group / 2 : p.group) * p.columns;  // one group on
  for (int64_t kb = k0; kb < k0 + p.group; kb += kBlock) {
    __m256i block[R][4];  // int16 (int4) or int32 (int8) sums of this block
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < 4; ++j) block[r][j] = _mm256_setzero_si256();
    }
    for (int64_t k = kb; k < kb + kBlock; k += 4) {
      __m256i quads[4];
      if (kInt4) {
        const uint8_t* row = p.w + (k / 2) * p.columns + c0;
        _mm_prefetch(reinterpret_cast<const char*>(row + ahead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(row + p.columns + ahead), _MM_HINT_T0);
        Int4Quads(row, p.columns, quads);
      } else {
        const uint8_t* row = p.w + k * p.columns + c0;
        for (int i = 0; i < 4; ++i) {
          _mm_prefetch(reinterpret_cast<const char*>(row + i * p.columns + ahead), _MM_HINT_T0);
        }
        Int8Quads(row, p.columns, quads);
      }
      for (int r = 0; r < R; ++r) {
        int32_t packed;
        std::memcpy(&packed, p.x_levels + (r0 + r) * p.depth + k, sizeof(packed));
        const __m256i xv = _mm256_set1_epi32(packed);
        for (int j = 0; j < 4; ++j) {
          if (kInt4) {
            block[r][j] = _mm256_add_epi16(block[r][j], _mm256_maddubs_epi16(quads[j], xv));
          } else {
            const __m256i product = _mm256_maddubs_epi16(_mm256_abs_epi8(quads[j]),
                                                         _mm256_sign_epi8(xv, quads[j]));
            block[r][j] = _mm256_add_epi32(block[r][j], _mm256_madd_epi16(product, ones));
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_set1_ps(p.x_scales[(r0 + r) * blocks_per_row + kb / kBlock]);
      for (int j = 0; j < 4; ++j) {
        const __m256i wide = kInt4 ? _mm256_madd_epi16(block[r][j], ones) : block[r][j];
        sums[r][j] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(wide), sums[r][j]);
      }
    }
  }
}

// Column order from the interleaved lanes (see above).
inline void Unpermute(const __m256 permuted[4], __m256 ordered[4]) {
  ordered[0] = _mm256_permute2f128_ps(permuted[0], permuted[1], 0x20);
  ordered[1] = _mm256_permute2f128_ps(permuted[2], permuted[3], 0x20);
  ordered[2] = _mm256_permute2f128_ps(permuted[0], permuted[1], 0x31);
  ordered[3] = _mm256_permute2f128_ps(permuted[2], permuted[3], 0x31);
}

// GroupBlock with int8 activations.
template <int R, bool kInt4>
inline void IntegerGroupBlock(const Problem& p, int64_t r0, int64_t g, int64_t c0, bool first) {
  __m256 permuted[R][4];
  IntegerGroupSums<R, kInt4>(p, r0, g * p.group, c0, permuted);
  __m256 sums[R][4];
  for (int r = 0; r < R; ++r) Unpermute(permuted[r], sums[r]);
  ApplyGroup<R, kInt4>(p, r0, g, c0, first, sums);
}

// --- int8 weights, int8 activations, wide matrices: four stored rows at a time -----------
//
// A group's 32-column register block reads all of the group's rows at once (32 streams of
// an int8 group), more than the prefetchers follow: an LM head ([576, 49152]) read at
// ~14 GB/s where the machine streams ~23. Here each thread reads one quad of rows (4
// streams) across a chunk of kStreamColumns columns at a time, adding the quads' integer
// sums into an int32 row of the chunk in L1, and scales them once per group: the head at
// ~26 GB/s. Rows of x: one or two (the latency case; more would re-read the weight per pair,
// where the register walk reads it once).
constexpr int64_t kStreamColumns = 2048;
constexpr int64_t kStreamRows = 2;

template <int R>
void StreamInt8Groups(const Problem& p, int64_t g0, int64_t g1) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t blocks_per_row = p.depth / kBlock;
  alignas(32) int32_t acc[R][kStreamColumns];  // this group's integer sums, permuted lanes
  for (int64_t n0 = 0; n0 < p.columns; n0 += kStreamColumns) {
    const int64_t width = std::min(kStreamColumns, p.columns - n0);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t k0 = g * p.group;
      for (int64_t k = k0; k < k0 + p.group; k += 4) {
        const uint8_t* row = p.w + k * p.columns + n0;
        __m256i xv[R];
        for (int r = 0; r < R; ++r) {
          int32_t packed;
          std::memcpy(&packed, p.x_levels + r * p.depth + k, sizeof(packed));
          xv[r] = _mm256_set1_epi32(packed);
        }
        const bool first = k == k0;
        for (int64_t c = 0; c < width; c += kSub) {
          if (k + 4 < k0 + p.group) {
            for (int i = 0; i < 4; ++i) {
              _mm_prefetch(reinterpret_cast<const char*>(row + (4 + i) * p.columns + c),
                           _MM_HINT_T0);
            }
          }
          __m256i quads[4];
          Int8Quads(row + c, p.columns, quads);
          __m256i magnitudes[4];
          for (int j = 0; j < 4; ++j) magnitudes[j] = _mm256_abs_epi8(quads[j]);
          for (int r = 0; r < R; ++r) {
            __m256i* sums = reinterpret_cast<__m256i*>(acc[r] + c);
            for (int j = 0; j < 4; ++j) {
              const __m256i product = _mm256_madd_epi16(
                  _mm256_maddubs_epi16(magnitudes[j], _mm256_sign_epi8(xv[r], quads[j])), ones);
              sums[j] = first ? product : _mm256_add_epi32(sums[j], product);
            }
          }
        }
      }
      // Integer sums to floats, once per group: out += s * dx * sum (column order restored).
      const int64_t stored = k0 / p.scale_group;
      const float* scale = p.scales + stored * p.columns + n0;
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(p.x_scales[r * blocks_per_row + k0 / kBlock]);
        float* out = p.out + r * p.columns + n0;
        for (int64_t c = 0; c < width; c += kSub) {
          __m256 permuted[4], ordered[4];
          for (int j = 0; j < 4; ++j) {
            permuted[j] = _mm256_cvtepi32_ps(
                _mm256_load_si256(reinterpret_cast<const __m256i*>(acc[r] + c) + j));
          }
          Unpermute(permuted, ordered);
          for (int v = 0; v < 4; ++v) {
            const __m256 scaled = _mm256_mul_ps(dx, _mm256_loadu_ps(scale + c + 8 * v));
            const __m256 total = g == g0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + c + 8 * v);
            _mm256_storeu_ps(out + c + 8 * v, _mm256_fmadd_ps(scaled, ordered[v], total));
          }
        }
      }
    }
  }
}

// --- float activations, many rows: a dequantized panel under a register-blocked product ---
//
// The register walk decodes the weight again for every pair of rows of x: at 64 rows (a
// decode step of 64 sequences) it spent its time widening bytes and ran at half XLA's
// float32 rate. From `panel_rows` rows each task dequantizes a [K, 16] panel, w = (q - z) * s
// exactly as the reference does, once, and `cpu_panel.h`'s register tile multiplies it into
// every row.
using jaxinfer::kPanelColumns;

// panel[k][0 .. 16) = dequantized w[k, c0 .. c0 + 16) for every k (packed rows as stored).
template <bool kInt4>
void DequantizePanel(const Problem& p, int64_t c0, float* panel) {
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x08));
  for (int64_t k0 = 0; k0 < p.depth; k0 += p.scale_group) {
    const int64_t stored = k0 / p.scale_group;
    const float* scale = p.scales + stored * p.columns + c0;
    const __m256 s[2] = {_mm256_loadu_ps(scale), _mm256_loadu_ps(scale + 8)};
    __m256 z[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    if (p.zeros != nullptr) {
      for (int v = 0; v < 2; ++v) z[v] = _mm256_loadu_ps(p.zeros + stored * p.columns + c0 + 8 * v);
    } else if (p.zeros8 != nullptr) {
      for (int v = 0; v < 2; ++v) {
        z[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
            reinterpret_cast<const __m128i*>(p.zeros8 + stored * p.columns + c0 + 8 * v))));
      }
    }
    // One stored row's 16 signed levels (bytes) to 16 floats (q - z) * s.
    auto store = [&](__m128i levels, float* to) {
      for (int v = 0; v < 2; ++v) {
        const __m128i part = v == 0 ? levels : _mm_srli_si128(levels, 8);
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part));
        _mm256_storeu_ps(to + 8 * v, _mm256_mul_ps(_mm256_sub_ps(q, z[v]), s[v]));
      }
    };
    const int64_t k1 = k0 + p.scale_group;
    if (kInt4) {
      for (int64_t k = k0; k < k1; k += 2) {
        const __m128i packed = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(p.w + (k / 2) * p.columns + c0));
        // Nibbles are two's complement: (u ^ 8) - 8 sign-extends a 4-bit level.
        const __m128i low = _mm_sub_epi8(_mm_xor_si128(_mm_and_si128(packed, low_mask), flip), flip);
        const __m128i high = _mm_sub_epi8(
            _mm_xor_si128(_mm_and_si128(_mm_srli_epi16(packed, 4), low_mask), flip), flip);
        store(low, panel + k * kPanelColumns);
        store(high, panel + (k + 1) * kPanelColumns);
      }
    } else {
      for (int64_t k = k0; k < k1; ++k) {
        store(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.w + k * p.columns + c0)),
              panel + k * kPanelColumns);
      }
    }
  }
}

// Every column in panels of 16 shared over the threads. Needs N a multiple of 16.
template <bool kInt4>
void RunPanels(ffi::ThreadPool& pool, const Problem& p, int32_t num_threads) {
  jaxinfer::PanelProduct(pool, p.x, p.rows, p.depth, p.columns, p.out, num_threads,
                         [&](int64_t c0, float* panel) { DequantizePanel<kInt4>(p, c0, panel); });
}

// Columns [first, end) in 32-column blocks over groups [g0, g1), group by group; p.out is
// written at g0 and added to after. Each group's stored rows are read left to right across
// the columns, a few parallel sequential streams the hardware prefetchers follow.
template <bool kInt4>
void VectorColumns(const Problem& p, int64_t first, int64_t end, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t c0 = first; c0 + kSub <= end; c0 += kSub) {
      int64_t r0 = 0;
      if (p.x_levels != nullptr) {
        for (; r0 + 2 <= p.rows; r0 += 2) IntegerGroupBlock<2, kInt4>(p, r0, g, c0, g == g0);
        if (r0 < p.rows) IntegerGroupBlock<1, kInt4>(p, r0, g, c0, g == g0);
        continue;
      }
      for (; r0 + 2 <= p.rows; r0 += 2) GroupBlock<2, kInt4>(p, r0, g, c0, g == g0);
      if (r0 < p.rows) GroupBlock<1, kInt4>(p, r0, g, c0, g == g0);
    }
  }
}

// Every column, the groups split over the threads (each a contiguous run of stored rows,
// read front to back), each thread's partial sums [M, N] added up at the end: the walk that
// reads the weight at the machine's streaming bandwidth. Needs N a multiple of 32.
//
// `count` products of the same x (one model's q, k and v projections, or gate and up) go
// through one split: each thread walks its groups of every weight in turn, so the threads
// are started and joined once, not once per weight (each start and join cost a few
// microseconds against the 83 KB of a SmolLM2 k projection).
template <bool kInt4>
void RunSplitGroups(ffi::ThreadPool& pool, const Problem* problems, int64_t count,
                    int32_t num_threads) {
  const Problem& p = problems[0];  // depth, group and rows are the same for every product
  const int64_t groups = p.depth / p.group;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(num_threads, groups));
  // Per product, its [threads - 1, M, N] partials at offsets[i] of one buffer, kept per
  // calling thread across calls (no allocation per step).
  static thread_local std::vector<float> partials;
  static thread_local std::vector<int64_t> offsets;
  offsets.assign(count + 1, 0);
  for (int64_t i = 0; i < count; ++i) {
    offsets[i + 1] = offsets[i] + (threads - 1) * problems[i].rows * problems[i].columns;
  }
  if (partials.size() < static_cast<size_t>(offsets[count])) partials.resize(offsets[count]);
  // The helpers must see the caller's buffers: a thread_local named inside the lambda would
  // be each helper thread's own.
  float* const partial_sums = partials.data();
  const int64_t* const starts = offsets.data();
  jaxinfer::ParallelFor(pool, threads, threads, [&](int64_t t) {
    const int64_t g0 = groups * t / threads, g1 = groups * (t + 1) / threads;
    for (int64_t i = 0; i < count; ++i) {
      Problem own = problems[i];
      if (t > 0) own.out = partial_sums + starts[i] + (t - 1) * own.rows * own.columns;
      if (!kInt4 && own.x_levels != nullptr && own.group == kBlock && own.rows <= kStreamRows) {
        if (own.rows == 1) StreamInt8Groups<1>(own, g0, g1); else StreamInt8Groups<2>(own, g0, g1);
      } else {
        VectorColumns<kInt4>(own, 0, own.columns, g0, g1);
      }
    }
  });
  for (int64_t i = 0; i < count; ++i) {
    const int64_t size = problems[i].rows * problems[i].columns;
    for (int64_t t = 1; t < threads; ++t) {
      const float* partial = partial_sums + starts[i] + (t - 1) * size;
      for (int64_t j = 0; j < size; ++j) problems[i].out[j] += partial[j];
    }
  }
}

#endif  // JAXINFER_QUANT_AVX2

// The readable loop: every column of [c0, c1), any width (also the tail of a vector tile).
template <bool kInt4>
void ScalarColumns(const Problem& p, int64_t c0, int64_t c1) {
  const int64_t groups = p.depth / p.group;
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* xr = p.x + r * p.depth;
    for (int64_t c = c0; c < c1; ++c) {
      float total = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        float acc = 0.0f;
        for (int64_t k = g * p.group; k < (g + 1) * p.group; ++k) {
          float level;
          if (kInt4) {
            const uint8_t byte = p.w[(k / 2) * p.columns + c];
            const int nibble = (k % 2 == 0) ? (byte & 0xF) : (byte >> 4);
            level = static_cast<float>((nibble ^ 8) - 8);
          } else {
            level = static_cast<float>(static_cast<int8_t>(p.w[k * p.columns + c]));
          }
          acc += xr[k] * level;
        }
        const int64_t stored = g * p.group / p.scale_group;
        const int64_t at = stored * p.columns + c;
        const float zero = p.zeros != nullptr    ? p.zeros[at]
                           : p.zeros8 != nullptr ? static_cast<float>(p.zeros8[at])
                                                 : 0.0f;
        total += p.scales[stored * p.columns + c] * (acc - zero * p.sums[r * groups + g]);
      }
      p.out[r * p.columns + c] = total;
    }
  }
}

// Whether p takes the dequantized panel (float activations, many rows).
bool PanelPath(const Problem& p, int64_t panel_rows) {
#ifdef JAXINFER_QUANT_AVX2
  return p.x_levels == nullptr && p.rows >= panel_rows && p.columns % kPanelColumns == 0;
#else
  return false;
#endif
}

template <bool kInt4>
void RunOne(ffi::ThreadPool& pool, const Problem& p, int32_t num_threads, int64_t panel_rows) {
#ifdef JAXINFER_QUANT_AVX2
  if (PanelPath(p, panel_rows)) {
    RunPanels<kInt4>(pool, p, num_threads);
    return;
  }
  if (p.columns % kSub == 0) {
    RunSplitGroups<kInt4>(pool, &p, 1, num_threads);
    return;
  }
#endif
  const int64_t tiles = (p.columns + kTile - 1) / kTile;
  jaxinfer::ParallelFor(pool, tiles, num_threads, [&](int64_t tile) {
    const int64_t first = tile * kTile;
    const int64_t end = std::min(p.columns, first + kTile);
    int64_t c0 = first;
#ifdef JAXINFER_QUANT_AVX2
    VectorColumns<kInt4>(p, first, end, 0, p.depth / p.group);
    c0 += (end - first) / kSub * kSub;
#endif
    if (c0 < end) ScalarColumns<kInt4>(p, c0, end);
  });
}

// The products of one x: through one group split where every one takes it, else in turn.
template <bool kInt4>
void Run(ffi::ThreadPool& pool, const Problem* problems, int64_t count, int32_t num_threads,
         int64_t panel_rows) {
#ifdef JAXINFER_QUANT_AVX2
  bool split = true;
  for (int64_t i = 0; i < count; ++i) {
    split = split && !PanelPath(problems[i], panel_rows) && problems[i].columns % kSub == 0;
  }
  if (split) {
    RunSplitGroups<kInt4>(pool, problems, count, num_threads);
    return;
  }
#endif
  for (int64_t i = 0; i < count; ++i) RunOne<kInt4>(pool, problems[i], num_threads, panel_rows);
}

// Validates shapes and the layer index; locates the layer's matrices.
ffi::Error Prepare(ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& weights, ffi::Buffer<ffi::F32>& scales,
                   ffi::AnyBuffer& zeros, ffi::Buffer<ffi::S32>& layer, bool int4,
                   bool has_zeros, int64_t group_size, ffi::ResultBuffer<ffi::F32>& out,
                   Problem* p) {
  // (sums, and x_levels / x_scales, are filled by SumGroups or QuantizeActivations after.)
  auto x_shape = x.dimensions();        // [M, K]
  auto w_shape = weights.dimensions();  // [L, K / 2, N] or [L, K, N]
  auto s_shape = scales.dimensions();   // [L, C, N]
  if (x_shape.size() != 2 || w_shape.size() != 3 || s_shape.size() != 3) {
    return ffi::Error::InvalidArgument("x must be [M, K], the weight [L, K', N], scales [L, C, N]");
  }
  const int64_t rows = x_shape[0], depth = x_shape[1], columns = w_shape[2];
  if (w_shape[1] * (int4 ? 2 : 1) != depth) {
    return ffi::Error::InvalidArgument("x and the weight disagree on the contracted size");
  }
  if (group_size <= 0 || depth % group_size != 0 || (int4 && group_size % 2 != 0)) {
    return ffi::Error::InvalidArgument("group_size must divide K (and be even for int4)");
  }
  const int64_t groups = depth / group_size;
  if (s_shape[0] != w_shape[0] || s_shape[1] != groups || s_shape[2] != columns) {
    return ffi::Error::InvalidArgument("scales must be [L, K / group_size, N]");
  }
  if (has_zeros && (zeros.element_count() != static_cast<size_t>(scales.element_count()) ||
                    (zeros.element_type() != ffi::DataType::F32 &&
                     zeros.element_type() != ffi::DataType::S8))) {
    return ffi::Error::InvalidArgument("zeros must be float32 or int8 of the shape of scales");
  }
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= w_shape[0]) {
    return ffi::Error::InvalidArgument("layer index out of range");
  }
  const float* xs = x.typed_data();
  // Per-channel int8 (one scale row) walks in groups of kWalkRows, which the threads split.
  const int64_t walk = (!int4 && groups == 1 && depth > kWalkRows && depth % kWalkRows == 0)
                           ? kWalkRows : group_size;
  const int64_t matrix_bytes = w_shape[1] * columns;
  const int64_t scale_count = groups * columns;
  const float* zero_points = nullptr;
  const int8_t* narrow_zero_points = nullptr;
  if (has_zeros && zeros.element_type() == ffi::DataType::F32) {
    zero_points = static_cast<const float*>(zeros.untyped_data()) + index * scale_count;
  } else if (has_zeros) {
    narrow_zero_points = static_cast<const int8_t*>(zeros.untyped_data()) + index * scale_count;
  }
  *p = Problem{xs,
               static_cast<const uint8_t*>(weights.untyped_data()) + index * matrix_bytes,
               scales.typed_data() + index * scale_count,
               zero_points,
               narrow_zero_points,
               nullptr,
               out->typed_data(),
               rows, depth, columns, walk, group_size};
  return ffi::Error::Success();
}

// sums[r, g] = the sum of x[r] over the features of group g (`Problem::sums`, float
// activations).
void SumGroups(Problem* p, std::vector<float>* sums) {
  const int64_t groups = p->depth / p->group;
  sums->assign(p->rows * groups, 0.0f);  // [M, K / group]
  for (int64_t r = 0; r < p->rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float total = 0.0f;
      for (int64_t k = g * p->group; k < (g + 1) * p->group; ++k) total += p->x[r * p->depth + k];
      (*sums)[r * groups + g] = total;
    }
  }
  p->sums = sums->data();
}

// Whether the int8-activation path applies: asked for, vectorized, every column in 32-column
// blocks and every group whole 32-feature blocks.
bool IntegerPath(const Problem& p, bool int8_activations) {
#ifdef JAXINFER_QUANT_AVX2
  return int8_activations && p.columns % kSub == 0 && p.group % kBlock == 0;
#else
  return false;
#endif
}

// x per row and block of kBlock features to int8 levels round(x / d), d = max |x| / 127 (0
// for a block of zeros): the rule `reference.quantize_activations_per_block` states. The
// product is then exactly that of the dequantized activations d * level, so the groups'
// sums for int4 offsets become sums of those (`sums`, rewritten), as llama.cpp's Q8_1 keeps.
void QuantizeActivations(Problem* p, std::vector<int8_t>* levels, std::vector<float>* scales,
                         std::vector<float>* sums) {
  const int64_t blocks = p->depth / kBlock;
  const int64_t groups = p->depth / p->group;
  levels->resize(p->rows * p->depth);
  scales->resize(p->rows * blocks);
  sums->assign(p->rows * groups, 0.0f);
  for (int64_t r = 0; r < p->rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* x = p->x + r * p->depth + b * kBlock;
      int8_t* out = levels->data() + r * p->depth + b * kBlock;
      float scale;
      int32_t total;
#ifdef JAXINFER_QUANT_AVX2
      // Eight lanes at a time; x / scale rounded to nearest even as nearbyint does (the
      // division kept: x * (1 / scale) rounds differently near halves).
      const __m256 sign = _mm256_set1_ps(-0.0f);
      __m256 values[kBlock / 8];
      __m256 largest8 = _mm256_setzero_ps();
      for (int v = 0; v < kBlock / 8; ++v) {
        values[v] = _mm256_loadu_ps(x + 8 * v);
        largest8 = _mm256_max_ps(largest8, _mm256_andnot_ps(sign, values[v]));
      }
      __m128 largest4 = _mm_max_ps(_mm256_castps256_ps128(largest8),
                                   _mm256_extractf128_ps(largest8, 1));
      largest4 = _mm_max_ps(largest4, _mm_movehl_ps(largest4, largest4));
      largest4 = _mm_max_ss(largest4, _mm_shuffle_ps(largest4, largest4, 1));
      scale = _mm_cvtss_f32(largest4) / 127.0f;
      __m256i integers[kBlock / 8];
      __m256i total8 = _mm256_setzero_si256();
      const __m256 divisor = _mm256_set1_ps(scale > 0.0f ? scale : 1.0f);
      const __m256 limit = _mm256_set1_ps(127.0f);
      for (int v = 0; v < kBlock / 8; ++v) {
        __m256 level = _mm256_round_ps(_mm256_div_ps(values[v], divisor),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        level = _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), limit),
                              _mm256_min_ps(limit, level));
        if (scale == 0.0f) level = _mm256_setzero_ps();
        integers[v] = _mm256_cvtps_epi32(level);
        total8 = _mm256_add_epi32(total8, integers[v]);
      }
      // int32 lanes to bytes: packs interleave the two 128-bit halves, the permute restores
      // feature order.
      const __m256i words01 = _mm256_packs_epi32(integers[0], integers[1]);
      const __m256i words23 = _mm256_packs_epi32(integers[2], integers[3]);
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words01, words23),
                                                        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bytes);
      __m128i total4 = _mm_add_epi32(_mm256_castsi256_si128(total8),
                                     _mm256_extracti128_si256(total8, 1));
      total4 = _mm_hadd_epi32(total4, total4);
      total4 = _mm_hadd_epi32(total4, total4);
      total = _mm_cvtsi128_si32(total4);
#else
      float largest = 0.0f;
      for (int64_t i = 0; i < kBlock; ++i) largest = std::max(largest, std::fabs(x[i]));
      scale = largest / 127.0f;
      total = 0;
      for (int64_t i = 0; i < kBlock; ++i) {
        const float level = scale > 0.0f ? std::nearbyint(x[i] / scale) : 0.0f;
        out[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, level)));
        total += out[i];
      }
#endif
      (*scales)[r * blocks + b] = scale;
      (*sums)[r * groups + b * kBlock / p->group] += scale * static_cast<float>(total);
    }
  }
  p->x_levels = levels->data();
  p->x_scales = scales->data();
  p->sums = sums->data();
}

// Fills the activation side of every problem (one x) and runs them: int8 levels where every
// product takes the integer path, else float group sums.
ffi::Error Compute(ffi::ThreadPool& pool, Problem* problems, int64_t count, bool int4,
                   bool int8_activations, int32_t num_threads, int64_t panel_rows) {
  // Scratch kept per calling thread across calls: a decode step makes ~200 of these calls,
  // and allocating per call showed in its profile.
  static thread_local std::vector<float> sums, x_scales;
  static thread_local std::vector<int8_t> x_levels;
  bool integer = true;
  for (int64_t i = 0; i < count; ++i) integer = integer && IntegerPath(problems[i], int8_activations);
  if (integer) {
    QuantizeActivations(&problems[0], &x_levels, &x_scales, &sums);
  } else {
    SumGroups(&problems[0], &sums);
  }
  for (int64_t i = 1; i < count; ++i) {
    problems[i].x_levels = problems[0].x_levels;
    problems[i].x_scales = problems[0].x_scales;
    problems[i].sums = problems[0].sums;
  }
  const int32_t threads = std::max<int32_t>(1, num_threads);
  if (int4) {
    Run<true>(pool, problems, count, threads, panel_rows);
  } else {
    Run<false>(pool, problems, count, threads, panel_rows);
  }
  return ffi::Error::Success();
}

ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer weights,
                           ffi::Buffer<ffi::F32> scales, ffi::AnyBuffer zeros,
                           ffi::Buffer<ffi::S32> layer, bool int4, bool has_zeros,
                           int64_t group_size, bool int8_activations, int32_t num_threads,
                           int64_t panel_rows, ffi::ResultBuffer<ffi::F32> out) {
  Problem p;
  ffi::Error error = Prepare(x, weights, scales, zeros, layer, int4, has_zeros, group_size, out,
                             &p);
  if (error.failure()) return error;
  return Compute(pool, &p, 1, int4, int8_activations, num_threads, panel_rows);
}

// Several weights of one format and group size times the same x (q, k and v; gate and up):
// arrays (values, scales, zeros) per weight, one result each.
ffi::Error QuantMatmulManyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                               ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs arrays,
                               ffi::RemainingRets outs, bool int4, bool has_zeros,
                               int64_t group_size, bool int8_activations, int32_t num_threads,
                               int64_t panel_rows) {
  const size_t count = outs.size();
  if (count == 0 || arrays.size() != 3 * count) {
    return ffi::Error::InvalidArgument("give (values, scales, zeros) for each result");
  }
  static thread_local std::vector<Problem> problems;
  problems.resize(count);
  for (size_t i = 0; i < count; ++i) {
    auto weights = arrays.get<ffi::AnyBuffer>(3 * i);
    auto scales = arrays.get<ffi::Buffer<ffi::F32>>(3 * i + 1);
    auto zeros = arrays.get<ffi::AnyBuffer>(3 * i + 2);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (weights.has_error()) return weights.error();
    if (scales.has_error()) return scales.error();
    if (zeros.has_error()) return zeros.error();
    if (out.has_error()) return out.error();
    ffi::Error error = Prepare(x, *weights, *scales, *zeros, layer, int4, has_zeros, group_size,
                               *out, &problems[i]);
    if (error.failure()) return error;
  }
  return Compute(pool, problems.data(), static_cast<int64_t>(count), int4, int8_activations,
                 num_threads, panel_rows);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantMatmul, QuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // weights [L, K', N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [L, C, N]
                                  .Arg<ffi::AnyBuffer>()         // zeros [L, C, N] or [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Attr<bool>("int4")
                                  .Attr<bool>("has_zeros")
                                  .Attr<int64_t>("group_size")
                                  .Attr<bool>("int8_activations")
                                  .Attr<int32_t>("num_threads")
                                  .Attr<int64_t>("panel_rows")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantMatmulMany, QuantMatmulManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .RemainingArgs()               // (values, scales, zeros) each
                                  .RemainingRets()               // out [M, N_i] each
                                  .Attr<bool>("int4")
                                  .Attr<bool>("has_zeros")
                                  .Attr<int64_t>("group_size")
                                  .Attr<bool>("int8_activations")
                                  .Attr<int32_t>("num_threads")
                                  .Attr<int64_t>("panel_rows"));
