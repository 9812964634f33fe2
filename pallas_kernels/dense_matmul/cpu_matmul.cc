// Float matmul for XLA:CPU at the row counts of decode steps, as an XLA FFI custom call.
//
// out[M, N] = a[M, K] @ b[layer], with b[layer] either [K, N] (a linear layer's weight as the
// model stores it) or [N, K] (a tied embedding table used as the LM head); b is a stack of L
// such matrices (L = 1 outside a scan over layers), read in place. XLA:CPU runs such products at
// 20-60% of the machine's rate when M is small (a decode step's M is its number of sequences),
// so a decode step spent most of its time below its roofline (`benchmarks/results/engine.md`).
// The weight is float32 or bfloat16; a bfloat16 weight is widened in registers (its bits
// shifted into a float32's upper half) and multiplied in float32, so a bfloat16 model reads
// half a float32 model's bytes per token. (XLA:CPU's own bfloat16 dot converts both operands
// element by element and ran a bfloat16 SmolLM2 20-25x slower than its float32 copy.)
//
// AVX-512, float32 weights: [K, N] weights: the columns are cut into tiles of 64 (four
// 16-lane vectors) shared over `num_threads` tasks on XLA's intra-op pool (`cpu_parallel.h`);
// each tile walks the rows of `a` six at a time, keeping the 6 x 64 outputs in 24 vector
// registers while it streams the tile's weight rows, in depth blocks of 128 rows so the
// 32 KiB weight panel stays in L1 across the row blocks; at most 16 rows each thread
// streams its own block of weight rows instead. [N, K] weights: each task takes four weight
// rows and dots them with six rows of `a` at a time, 24 accumulators reduced at the end.
//
// AVX2 + FMA (every x86 CPU of the last decade; the bfloat16 weights of AVX-512 CPUs too):
// the same two walks at the sizes where they beat XLA there (`kAvx2MaxRows` rows): the
// streaming walk for [K, N], and four weight rows dotted with two rows of `a` for [N, K].
//
// `JaxinferMatmulVectorized` says which paths were compiled (2: AVX-512 and AVX2, 1: AVX2
// only, 0: neither); the Python side keeps XLA's dot where none applies.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_panel.h"
#include "cpu_parallel.h"

#include "xla/ffi/api/ffi.h"

#ifdef __AVX512F__
#define JAXINFER_MATMUL_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define JAXINFER_MATMUL_AVX2 1
#endif
#if defined(JAXINFER_MATMUL_AVX512) || defined(JAXINFER_MATMUL_AVX2)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

extern "C" int JaxinferMatmulVectorized() {
#if defined(JAXINFER_MATMUL_AVX512) && defined(JAXINFER_MATMUL_AVX2)
  return 2;
#elif defined(JAXINFER_MATMUL_AVX2)
  return 1;
#else
  return 0;
#endif
}

namespace {

constexpr int64_t kRows = 6;       // rows of `a` per register tile
constexpr int64_t kColumns = 64;   // output columns per tile of a [K, N] weight
constexpr int64_t kDepth = 128;    // weight rows per L1 panel of a [K, N] weight
constexpr int64_t kWeightRows = 4;  // weight rows per tile of an [N, K] weight
constexpr int64_t kWeightRowsPerTask = 64;  // [N, K] weight rows per task
// Rows of `a` up to which a [K, N] product streams the weight (each thread its own block of
// weight rows) rather than tiling the columns.
constexpr int64_t kStreamRows = 16;
constexpr int64_t kStreamSums = 16384;  // partial sums (R x columns) held in L1/L2 at a time

#ifdef JAXINFER_MATMUL_AVX512

inline __mmask16 LaneMask(int64_t remaining) {
  if (remaining >= 16) return 0xFFFF;
  if (remaining <= 0) return 0;
  return static_cast<__mmask16>((1u << remaining) - 1u);
}

// out[R, width] (+)= a[R, depth] @ b[depth, width] for one register tile; width <= 64.
template <int R>
void TileKN(const float* a, int64_t lda, const float* b, int64_t ldb, float* out,
            int64_t ldo, int64_t depth, int64_t width, bool accumulate) {
  __mmask16 mask[4];
  for (int v = 0; v < 4; ++v) mask[v] = LaneMask(width - 16 * v);
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) {
      acc[r][v] = accumulate ? _mm512_maskz_loadu_ps(mask[v], out + r * ldo + 16 * v)
                             : _mm512_setzero_ps();
    }
  }
  if (width == kColumns) {
    for (int64_t k = 0; k < depth; ++k) {
      const float* row = b + k * ldb;
      const __m512 b0 = _mm512_loadu_ps(row), b1 = _mm512_loadu_ps(row + 16);
      const __m512 b2 = _mm512_loadu_ps(row + 32), b3 = _mm512_loadu_ps(row + 48);
      for (int r = 0; r < R; ++r) {
        const __m512 x = _mm512_set1_ps(a[r * lda + k]);
        acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(x, b2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(x, b3, acc[r][3]);
      }
    }
  } else {
    for (int64_t k = 0; k < depth; ++k) {
      const float* row = b + k * ldb;
      __m512 bv[4];
      for (int v = 0; v < 4; ++v) bv[v] = _mm512_maskz_loadu_ps(mask[v], row + 16 * v);
      for (int r = 0; r < R; ++r) {
        const __m512 x = _mm512_set1_ps(a[r * lda + k]);
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(x, bv[v], acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) _mm512_mask_storeu_ps(out + r * ldo + 16 * v, mask[v], acc[r][v]);
  }
}

using TileKNFunction = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t,
                                int64_t, int64_t, bool);
constexpr TileKNFunction kTilesKN[kRows + 1] = {nullptr,      TileKN<1>, TileKN<2>, TileKN<3>,
                                                TileKN<4>,    TileKN<5>, TileKN<6>};

// out[R, N] = a[R, depth] @ b[depth, N] for R <= kStreamRows (decode steps: a few rows),
// each thread streaming its own contiguous block of weight rows front to back, four rows at
// a time (long runs of whole rows, the order DRAM and the hardware prefetchers serve
// fastest), into partial sums that stay in L1, added up at the end. Each weight vector is
// loaded once and used for every row of `a`. The column-tiled walk below reads only 256
// bytes of a weight row before jumping to the next row, which at a few rows ran the weight
// in at a fraction of the machine's bandwidth.
constexpr int64_t kGroup = 8;  // rows of `a` unrolled together

// sums[r, :width] += x[r, 0:4] @ w[0:4, :width] for the G rows of one group, w being four
// consecutive weight rows (`ldw` apart, zero past `step`).
template <int G>
void StreamGroup(const float (*x)[4], const float* w, int64_t ldw, int64_t step,
                 float* sums, int64_t ldsum, int64_t width) {
  __m512 xs[G][4];
  for (int r = 0; r < G; ++r) {
    for (int i = 0; i < 4; ++i) xs[r][i] = _mm512_set1_ps(x[r][i]);
  }
  for (int64_t n = 0; n < width; n += 16) {
    const __mmask16 mask = LaneMask(width - n);
    __m512 weights[4];
    for (int64_t i = 0; i < 4; ++i) {
      weights[i] = i < step ? _mm512_maskz_loadu_ps(mask, w + i * ldw + n) : _mm512_setzero_ps();
    }
    for (int r = 0; r < G; ++r) {
      __m512 total = _mm512_maskz_loadu_ps(mask, sums + r * ldsum + n);
      for (int i = 0; i < 4; ++i) total = _mm512_fmadd_ps(xs[r][i], weights[i], total);
      _mm512_mask_storeu_ps(sums + r * ldsum + n, mask, total);
    }
  }
}

using StreamGroupFunction = void (*)(const float (*)[4], const float*, int64_t, int64_t,
                                     float*, int64_t, int64_t);
constexpr StreamGroupFunction kStreamGroups[kGroup + 1] = {
    nullptr, StreamGroup<1>, StreamGroup<2>, StreamGroup<3>, StreamGroup<4>,
    StreamGroup<5>, StreamGroup<6>, StreamGroup<7>, StreamGroup<8>};

void MatmulKNStream(ffi::ThreadPool& pool, const float* a, const float* b, float* out,
                    int64_t rows, int64_t depth, int64_t columns, int32_t num_threads) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(num_threads, depth / 64));
  const int64_t chunk = std::max<int64_t>(64, (kStreamSums / rows) / 16 * 16);
  std::vector<float> partial_sums(threads * rows * columns);  // [threads, R, N]
  float* partials = partial_sums.data();
  jaxinfer::ParallelFor(pool, threads, threads, [&](int64_t t) {
    // Whole groups of four weight rows per thread (the last takes the remainder).
    const int64_t k_begin = depth * t / threads / 4 * 4;
    const int64_t k_end = t + 1 == threads ? depth : depth * (t + 1) / threads / 4 * 4;
    float* partial = partials + t * rows * columns;  // [R, N]
    std::fill(partial, partial + rows * columns, 0.0f);
    float x[kStreamRows][4];  // [R, 4] this quad's activations (zero past the depth)
    for (int64_t n0 = 0; n0 < columns; n0 += chunk) {
      const int64_t width = std::min(chunk, columns - n0);
      for (int64_t k = k_begin; k < k_end; k += 4) {
        const int64_t step = std::min<int64_t>(4, k_end - k);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t i = 0; i < 4; ++i) x[r][i] = i < step ? a[r * depth + k + i] : 0.0f;
        }
        const float* row = b + k * columns + n0;
        for (int64_t r0 = 0; r0 < rows; r0 += kGroup) {
          kStreamGroups[std::min(kGroup, rows - r0)](x + r0, row, columns, step,
                                                     partial + r0 * columns + n0, columns,
                                                     width);
        }
      }
    }
  });
  for (int64_t i = 0; i < rows * columns; ++i) {
    float total = partials[i];
    for (int64_t t = 1; t < threads; ++t) total += partials[t * rows * columns + i];
    out[i] = total;
  }
}

void MatmulKN(ffi::ThreadPool& pool, const float* a, const float* b, float* out,
              int64_t rows, int64_t depth, int64_t columns, int32_t num_threads) {
  if (rows <= kStreamRows) {
    MatmulKNStream(pool, a, b, out, rows, depth, columns, num_threads);
    return;
  }
  const int64_t tiles = (columns + kColumns - 1) / kColumns;
  jaxinfer::ParallelFor(pool, tiles, num_threads, [&](int64_t tile) {
    const int64_t first = tile * kColumns;
    const int64_t width = std::min(kColumns, columns - first);
    for (int64_t k0 = 0; k0 < depth; k0 += kDepth) {
      const int64_t block = std::min(kDepth, depth - k0);
      for (int64_t m0 = 0; m0 < rows; m0 += kRows) {
        const int64_t count = std::min(kRows, rows - m0);
        kTilesKN[count](a + m0 * depth + k0, depth, b + k0 * columns + first, columns,
                        out + m0 * columns + first, columns, block, width, k0 > 0);
      }
    }
  });
}

// out[R, C] = a[R, depth] @ w[C, depth]^T for one register tile; C <= 4.
template <int R>
void TileNK(const float* a, int64_t lda, const float* w, int64_t ldw, float* out, int64_t ldo,
            int64_t depth, int64_t count) {
  __m512 acc[R][kWeightRows];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < kWeightRows; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < depth; k += 16) {
    const __mmask16 mask = LaneMask(depth - k);
    __m512 wv[kWeightRows];
    for (int c = 0; c < kWeightRows; ++c) {
      wv[c] = c < count ? _mm512_maskz_loadu_ps(mask, w + c * ldw + k) : _mm512_setzero_ps();
    }
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_maskz_loadu_ps(mask, a + r * lda + k);
      for (int c = 0; c < kWeightRows; ++c) acc[r][c] = _mm512_fmadd_ps(x, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < count; ++c) out[r * ldo + c] = _mm512_reduce_add_ps(acc[r][c]);
  }
}

using TileNKFunction = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t,
                                int64_t, int64_t);
constexpr TileNKFunction kTilesNK[kRows + 1] = {nullptr,   TileNK<1>, TileNK<2>, TileNK<3>,
                                                TileNK<4>, TileNK<5>, TileNK<6>};

void MatmulNK(ffi::ThreadPool& pool, const float* a, const float* w, float* out, int64_t rows,
              int64_t depth, int64_t columns, int32_t num_threads) {
  const int64_t tasks = (columns + kWeightRowsPerTask - 1) / kWeightRowsPerTask;
  jaxinfer::ParallelFor(pool, tasks, num_threads, [&](int64_t task) {
    const int64_t end = std::min(columns, (task + 1) * kWeightRowsPerTask);
    for (int64_t first = task * kWeightRowsPerTask; first < end; first += kWeightRows) {
      const int64_t count = std::min(kWeightRows, end - first);
      for (int64_t m0 = 0; m0 < rows; m0 += kRows) {
        const int64_t block = std::min(kRows, rows - m0);
        kTilesNK[block](a + m0 * depth, depth, w + first * depth, depth,
                        out + m0 * columns + first, columns, depth, count);
      }
    }
  });
}

#endif  // JAXINFER_MATMUL_AVX512

// A stored weight element as float32: bfloat16 is the upper half of a float32's bits.
inline float ToFloat(float value) { return value; }
inline float ToFloat(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// The readable loops: every size and weight dtype, where no vector path applies.
template <typename W>
void ScalarKN(ffi::ThreadPool& pool, const float* a, const W* b, float* out, int64_t rows,
              int64_t depth, int64_t columns, int32_t num_threads) {
  jaxinfer::ParallelFor(pool, rows, num_threads, [&](int64_t m) {
    float* row = out + m * columns;
    std::fill(row, row + columns, 0.0f);
    for (int64_t k = 0; k < depth; ++k) {
      const float x = a[m * depth + k];
      for (int64_t n = 0; n < columns; ++n) row[n] += x * ToFloat(b[k * columns + n]);
    }
  });
}

template <typename W>
void ScalarNK(ffi::ThreadPool& pool, const float* a, const W* w, float* out, int64_t rows,
              int64_t depth, int64_t columns, int32_t num_threads) {
  jaxinfer::ParallelFor(pool, rows, num_threads, [&](int64_t m) {
    for (int64_t n = 0; n < columns; ++n) {
      float total = 0.0f;
      for (int64_t k = 0; k < depth; ++k) total += a[m * depth + k] * ToFloat(w[n * depth + k]);
      out[m * columns + n] = total;
    }
  });
}

#ifdef JAXINFER_MATMUL_AVX2

// Sixteen consecutive weight elements as two float32 vectors. float32: in order. bfloat16:
// one 32-byte load whose 32-bit lanes each hold elements (2j, 2j + 1); the even ones become
// float32 by a shift, the odd ones by masking off the low half, so the two vectors hold the
// even and the odd elements ("interleaved"): two single-cycle ALU operations per 16 elements
// instead of a shuffle per 8. The products of interleaved weights are matched with
// interleaved activations, or put back in order where they are summed (`Interleaved`).
// Both widenings measured about alike here (the bfloat16 walk reads ~15-21 GB/s on this
// 2-core AVX2 EPYC, where the float32 one reads ~28-37): the walk is bound by its own
// instructions, not by the conversion.
inline void Load16(const float* w, __m256* first, __m256* second) {
  *first = _mm256_loadu_ps(w);
  *second = _mm256_loadu_ps(w + 8);
}
inline void Load16(const uint16_t* w, __m256* even, __m256* odd) {
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  *even = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  *odd = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(~0xFFFF)));
}

// Where element n of a row of `count` sits when every whole block of 16 is stored as its
// even elements then its odd ones (bfloat16's `Load16` order); float32 keeps its order.
template <typename W>
inline int64_t Interleaved(int64_t n, int64_t count) {
  if (!std::is_same_v<W, uint16_t> || n >= count / 16 * 16) return n;
  const int64_t j = n % 16;
  return n - j + (j % 2) * 8 + j / 2;
}

inline float Sum8(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

// sums[r, :width] += x[r, 0:S] @ w[0:S, :width] for the G rows of one group, w being S
// consecutive weight rows `ldw` apart (S = 4 in the body of a block, 1 at its tail); the
// sums of whole 16-column blocks in `Load16` order, of the tail in order.
template <typename W, int G, int S>
void StreamGroupAvx2(const float (*x)[4], const W* w, int64_t ldw, float* sums, int64_t ldsum,
                     int64_t width) {
  int64_t n = 0;
  for (; n + 16 <= width; n += 16) {
    __m256 first[S], second[S];
    for (int i = 0; i < S; ++i) Load16(w + i * ldw + n, &first[i], &second[i]);
    for (int r = 0; r < G; ++r) {
      __m256 total_first = _mm256_loadu_ps(sums + r * ldsum + n);
      __m256 total_second = _mm256_loadu_ps(sums + r * ldsum + n + 8);
      for (int i = 0; i < S; ++i) {
        const __m256 xv = _mm256_set1_ps(x[r][i]);
        total_first = _mm256_fmadd_ps(xv, first[i], total_first);
        total_second = _mm256_fmadd_ps(xv, second[i], total_second);
      }
      _mm256_storeu_ps(sums + r * ldsum + n, total_first);
      _mm256_storeu_ps(sums + r * ldsum + n + 8, total_second);
    }
  }
  for (; n < width; ++n) {
    for (int r = 0; r < G; ++r) {
      for (int i = 0; i < S; ++i) sums[r * ldsum + n] += x[r][i] * ToFloat(w[i * ldw + n]);
    }
  }
}

// Rows of `a` unrolled together: two keep their sums and eight weight vectors in registers.
constexpr int64_t kAvx2Group = 2;

template <typename W, int S>
void StreamRowsAvx2(const float (*x)[4], int64_t rows, const W* w, int64_t ldw, float* sums,
                    int64_t ldsum, int64_t width) {
  int64_t r0 = 0;
  for (; r0 + kAvx2Group <= rows; r0 += kAvx2Group) {
    StreamGroupAvx2<W, kAvx2Group, S>(x + r0, w, ldw, sums + r0 * ldsum, ldsum, width);
  }
  if (r0 < rows) StreamGroupAvx2<W, 1, S>(x + r0, w, ldw, sums + r0 * ldsum, ldsum, width);
}

// out[R, N] = a[R, depth] @ b[depth, N], R <= kStreamRows: the AVX-512 streaming walk above
// (each thread its own block of weight rows, front to back, into partial sums in L1).
template <typename W>
void MatmulKNAvx2(ffi::ThreadPool& pool, const float* a, const W* b, float* out, int64_t rows,
                  int64_t depth, int64_t columns, int32_t num_threads) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(num_threads, depth / 64));
  // Chunks of whole 16-column blocks, so the interleaved blocks are the same in every chunk.
  const int64_t chunk = std::max<int64_t>(64, (kStreamSums / rows) / 16 * 16);
  const int64_t size = rows * columns;
  // [threads, R, N], kept per calling thread across calls (a decode step makes hundreds of
  // these calls); the helpers are handed the caller's pointer.
  static thread_local std::vector<float> partial_sums;
  if (partial_sums.size() < static_cast<size_t>(threads * size)) {
    partial_sums.resize(threads * size);
  }
  float* const partials = partial_sums.data();
  jaxinfer::ParallelFor(pool, threads, threads, [&](int64_t t) {
    const int64_t k_begin = depth * t / threads / 4 * 4;
    const int64_t k_end = t + 1 == threads ? depth : depth * (t + 1) / threads / 4 * 4;
    float* partial = partials + t * size;  // [R, N]
    std::fill(partial, partial + size, 0.0f);
    float x[kStreamRows][4];  // [R, 4] this quad's activations
    for (int64_t n0 = 0; n0 < columns; n0 += chunk) {
      const int64_t width = std::min(chunk, columns - n0);
      int64_t k = k_begin;
      for (; k + 4 <= k_end; k += 4) {
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t i = 0; i < 4; ++i) x[r][i] = a[r * depth + k + i];
        }
        StreamRowsAvx2<W, 4>(x, rows, b + k * columns + n0, columns, partial + n0, columns,
                             width);
      }
      for (; k < k_end; ++k) {
        for (int64_t r = 0; r < rows; ++r) x[r][0] = a[r * depth + k];
        StreamRowsAvx2<W, 1>(x, rows, b + k * columns + n0, columns, partial + n0, columns,
                             width);
      }
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t n = 0; n < columns; ++n) {
      const int64_t from = r * columns + Interleaved<W>(n, columns);
      float total = partials[from];
      for (int64_t t = 1; t < threads; ++t) total += partials[t * size + from];
      out[r * columns + n] = total;
    }
  }
}

// out[R, C] = a[R, depth] @ w[C, depth]^T for R <= 2 rows of `a` (in `Load16` order, as the
// weight rows are loaded) and C <= 4 weight rows.
template <typename W, int R>
void TileNKAvx2(const float* a, int64_t lda, const W* w, int64_t ldw, float* out, int64_t ldo,
                int64_t depth, int64_t count) {
  __m256 acc[R][kWeightRows];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < kWeightRows; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 16 <= depth; k += 16) {
    __m256 first[kWeightRows], second[kWeightRows];
    for (int c = 0; c < kWeightRows; ++c) {
      if (c < count) {
        Load16(w + c * ldw + k, &first[c], &second[c]);
      } else {
        first[c] = second[c] = _mm256_setzero_ps();
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 x_first = _mm256_loadu_ps(a + r * lda + k);
      const __m256 x_second = _mm256_loadu_ps(a + r * lda + k + 8);
      for (int c = 0; c < kWeightRows; ++c) {
        acc[r][c] = _mm256_fmadd_ps(x_second, second[c],
                                    _mm256_fmadd_ps(x_first, first[c], acc[r][c]));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < count; ++c) {
      float total = Sum8(acc[r][c]);
      for (int64_t tail = k; tail < depth; ++tail) {
        total += a[r * lda + tail] * ToFloat(w[c * ldw + tail]);
      }
      out[r * ldo + c] = total;
    }
  }
}

template <typename W>
void MatmulNKAvx2(ffi::ThreadPool& pool, const float* a, const W* w, float* out, int64_t rows,
                  int64_t depth, int64_t columns, int32_t num_threads) {
  // The activations in the weight rows' `Load16` order (a copy of R x K floats per call).
  static thread_local std::vector<float> reordered;
  if (std::is_same_v<W, uint16_t>) {
    reordered.resize(rows * depth);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k < depth; ++k) {
        reordered[r * depth + Interleaved<W>(k, depth)] = a[r * depth + k];
      }
    }
    a = reordered.data();
  }
  const int64_t tasks = (columns + kWeightRowsPerTask - 1) / kWeightRowsPerTask;
  jaxinfer::ParallelFor(pool, tasks, num_threads, [&](int64_t task) {
    const int64_t end = std::min(columns, (task + 1) * kWeightRowsPerTask);
    for (int64_t first = task * kWeightRowsPerTask; first < end; first += kWeightRows) {
      const int64_t count = std::min(kWeightRows, end - first);
      int64_t m0 = 0;
      for (; m0 + 2 <= rows; m0 += 2) {
        TileNKAvx2<W, 2>(a + m0 * depth, depth, w + first * depth, depth,
                         out + m0 * columns + first, columns, depth, count);
      }
      if (m0 < rows) {
        TileNKAvx2<W, 1>(a + m0 * depth, depth, w + first * depth, depth,
                         out + m0 * columns + first, columns, depth, count);
      }
    }
  });
}

// Products of more than kStreamRows rows: the weight's [K, 16] panels written out as float32
// (bfloat16 widened, an [N, K] weight transposed on the way) under `cpu_panel.h`'s register
// tile. XLA's dot ran such products at 40-60% of its large-product rate, and a bfloat16
// layer had to be widened whole before it.
template <typename W>
void PanelKN(ffi::ThreadPool& pool, const float* a, const W* b, float* out, int64_t rows,
             int64_t depth, int64_t columns, bool transposed, int32_t threads) {
  jaxinfer::PanelProduct(pool, a, rows, depth, columns, out, threads,
                         [&](int64_t c0, float* panel) {
    using jaxinfer::kPanelColumns;
    if (transposed) {  // b is [N, K]: panel column j is stored row c0 + j
      for (int64_t j = 0; j < kPanelColumns; ++j) {
        const W* row = b + (c0 + j) * depth;
        for (int64_t k = 0; k < depth; ++k) panel[k * kPanelColumns + j] = ToFloat(row[k]);
      }
      return;
    }
    for (int64_t k = 0; k < depth; ++k) {
      const W* row = b + k * columns + c0;
#pragma omp simd
      for (int64_t j = 0; j < kPanelColumns; ++j) panel[k * kPanelColumns + j] = ToFloat(row[j]);
    }
  });
}

#endif  // JAXINFER_MATMUL_AVX2

// The fastest compiled walk for this weight dtype and product.
template <typename W>
void Multiply(ffi::ThreadPool& pool, const float* a, const W* weight, float* out, int64_t rows,
              int64_t depth, int64_t columns, bool transposed, int32_t threads) {
#ifdef JAXINFER_MATMUL_AVX512
  if constexpr (std::is_same_v<W, float>) {
    if (transposed) {
      MatmulNK(pool, a, weight, out, rows, depth, columns, threads);
    } else {
      MatmulKN(pool, a, weight, out, rows, depth, columns, threads);
    }
    return;
  }
#endif
#ifdef JAXINFER_MATMUL_AVX2
  if (rows > kStreamRows && columns % jaxinfer::kPanelColumns == 0) {
    PanelKN(pool, a, weight, out, rows, depth, columns, transposed, threads);
  } else if (transposed) {
    MatmulNKAvx2(pool, a, weight, out, rows, depth, columns, threads);
  } else if (rows <= kStreamRows) {
    MatmulKNAvx2(pool, a, weight, out, rows, depth, columns, threads);
  } else {
    ScalarKN(pool, a, weight, out, rows, depth, columns, threads);
  }
  return;
#endif
  if (transposed) {
    ScalarNK(pool, a, weight, out, rows, depth, columns, threads);
  } else {
    ScalarKN(pool, a, weight, out, rows, depth, columns, threads);
  }
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::AnyBuffer b,
                      ffi::Buffer<ffi::S32> layer, bool transposed, int32_t num_threads,
                      ffi::ResultBuffer<ffi::F32> out) {
  auto a_shape = a.dimensions();  // [M, K]
  auto b_shape = b.dimensions();  // [L, K, N] or [L, N, K] (a scan's stacked weights)
  if (a_shape.size() != 2 || b_shape.size() != 3) {
    return ffi::Error::InvalidArgument("a must be [M, K] and b [L, K, N] or [L, N, K]");
  }
  if (b.element_type() != ffi::DataType::F32 && b.element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("b must be float32 or bfloat16");
  }
  const int64_t rows = a_shape[0], depth = a_shape[1];
  const int64_t columns = transposed ? b_shape[1] : b_shape[2];
  if ((transposed ? b_shape[2] : b_shape[1]) != depth) {
    return ffi::Error::InvalidArgument("a and b disagree on the contracted size");
  }
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= b_shape[0]) {
    return ffi::Error::InvalidArgument("layer index out of range");
  }
  // The layer's matrix is read in place: slicing it out first cost a copy of every weight
  // per layer and step.
  const int64_t offset = index * depth * columns;
  const int32_t threads = std::max<int32_t>(1, num_threads);
  if (b.element_type() == ffi::DataType::F32) {
    Multiply(pool, a.typed_data(), static_cast<const float*>(b.untyped_data()) + offset,
             out->typed_data(), rows, depth, columns, transposed, threads);
  } else {
    Multiply(pool, a.typed_data(), static_cast<const uint16_t*>(b.untyped_data()) + offset,
             out->typed_data(), rows, depth, columns, transposed, threads);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DenseMatmulF32, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a [M, K]
                                  .Arg<ffi::AnyBuffer>()  // b [L, K, N] or [L, N, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Attr<bool>("transposed")
                                  .Attr<int32_t>("num_threads")
                                  .Ret<ffi::Buffer<ffi::F32>>());
