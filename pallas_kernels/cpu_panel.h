// A float product over panels of a weight that each task first writes out as float32: the
// walk of the CPU kernels for products of several rows (decode steps of many sequences).
//
//   out[M, N] = x[M, K] @ W, W given panel by panel: pack(c0, panel) writes
//   panel[k * 16 + j] = W[k, c0 + j] for every k < K and j < 16.
//
// Reading a weight in its stored form (int8 levels, int4 nibbles, bfloat16, or float32 rows
// of a [K, N] or [N, K] layout) once per product, as a float [K, 16] panel in L2 (96 KiB at
// K = 1536), lets one register tile serve every weight format: rows of x six at a time,
// 6 x 16 outputs in 12 accumulators, two panel loads and six broadcasts per 12 FMAs (the
// classic AVX2 sgemm tile). The walks that decode the weight in registers (the quantized
// kernel's register walk, the dense kernel's streaming walk) decode it again for every pair
// of rows; from ~5 rows on this product is faster (`benchmarks/cpu_kernel_rows.py`).
// Panels are shared over `threads` tasks on XLA's pool (`cpu_parallel.h`).

#ifndef JAXINFER_PALLAS_KERNELS_CPU_PANEL_H_
#define JAXINFER_PALLAS_KERNELS_CPU_PANEL_H_

#if defined(__AVX2__) && defined(__FMA__)
#define JAXINFER_PANEL_AVX2 1

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "cpu_parallel.h"

namespace jaxinfer {

constexpr int64_t kPanelColumns = 16;  // output columns per panel (two 8-float vectors)
constexpr int64_t kPanelRowBlock = 6;  // rows of x per register tile

// The 12 accumulators are named variables, not an array: with `__m256 acc[R][2]` GCC kept
// the array in memory and stored all 12 back to the stack every step (27% of the core's FMA
// rate), since the loop's float loads could alias its elements as far as it could tell.
#define JAXINFER_PANEL_ROW(r, low, high)                         \
  if constexpr (R > r) {                                         \
    const __m256 a = _mm256_broadcast_ss(x + (r) * depth + k);   \
    low = _mm256_fmadd_ps(a, b0, low);                           \
    high = _mm256_fmadd_ps(a, b1, high);                         \
  }
#define JAXINFER_PANEL_STORE(r, low, high)                       \
  if constexpr (R > r) {                                         \
    _mm256_storeu_ps(out + (r) * columns, low);                  \
    _mm256_storeu_ps(out + (r) * columns + 8, high);             \
  }

// out[0 .. R, 0 .. 16) = x[0 .. R, :] @ panel; x rows `depth` apart, out rows `columns`.
template <int R>
inline void PanelRows(const float* x, int64_t depth, const float* panel, float* out,
                      int64_t columns) {
  static_assert(R >= 1 && R <= kPanelRowBlock);
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0,
         h3 = l0, l4 = l0, h4 = l0, l5 = l0, h5 = l0;
  for (int64_t k = 0; k < depth; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * kPanelColumns);
    const __m256 b1 = _mm256_loadu_ps(panel + k * kPanelColumns + 8);
    JAXINFER_PANEL_ROW(0, l0, h0)
    JAXINFER_PANEL_ROW(1, l1, h1)
    JAXINFER_PANEL_ROW(2, l2, h2)
    JAXINFER_PANEL_ROW(3, l3, h3)
    JAXINFER_PANEL_ROW(4, l4, h4)
    JAXINFER_PANEL_ROW(5, l5, h5)
  }
  JAXINFER_PANEL_STORE(0, l0, h0)
  JAXINFER_PANEL_STORE(1, l1, h1)
  JAXINFER_PANEL_STORE(2, l2, h2)
  JAXINFER_PANEL_STORE(3, l3, h3)
  JAXINFER_PANEL_STORE(4, l4, h4)
  JAXINFER_PANEL_STORE(5, l5, h5)
}
#undef JAXINFER_PANEL_ROW
#undef JAXINFER_PANEL_STORE

// out[M, N] = x[M, K] @ W with W packed panel by panel by `pack`; N a multiple of 16.
template <typename Pack>
void PanelProduct(xla::ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t depth,
                  int64_t columns, float* out, int64_t threads, const Pack& pack) {
  ParallelFor(pool, columns / kPanelColumns, threads, [&](int64_t index) {
    // Each worker's own panel, kept across calls.
    static thread_local std::vector<float> buffer;
    if (buffer.size() < static_cast<size_t>(depth * kPanelColumns)) {
      buffer.resize(depth * kPanelColumns);
    }
    const int64_t c0 = index * kPanelColumns;
    pack(c0, buffer.data());
    const float* panel = buffer.data();
    int64_t r0 = 0;
    for (; r0 + kPanelRowBlock <= rows; r0 += kPanelRowBlock) {
      PanelRows<kPanelRowBlock>(x + r0 * depth, depth, panel, out + r0 * columns + c0, columns);
    }
    const float* xr = x + r0 * depth;
    float* o = out + r0 * columns + c0;
    switch (rows - r0) {
      case 5: PanelRows<5>(xr, depth, panel, o, columns); break;
      case 4: PanelRows<4>(xr, depth, panel, o, columns); break;
      case 3: PanelRows<3>(xr, depth, panel, o, columns); break;
      case 2: PanelRows<2>(xr, depth, panel, o, columns); break;
      case 1: PanelRows<1>(xr, depth, panel, o, columns); break;
      default: break;
    }
  });
}

}  // namespace jaxinfer

#endif  // __AVX2__ && __FMA__
#endif  // JAXINFER_PALLAS_KERNELS_CPU_PANEL_H_
