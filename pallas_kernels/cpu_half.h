// IEEE float16 <-> float32 for the CPU kernels (KIVI's scales and zero points are float16).
//
// With F16C these are the single conversion instructions; without, the same results by bit
// arithmetic: widening is exact, narrowing rounds to nearest even (subnormals, overflow to
// infinity and NaN included), as XLA's convert does.

#ifndef JAXINFER_PALLAS_KERNELS_CPU_HALF_H_
#define JAXINFER_PALLAS_KERNELS_CPU_HALF_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace jaxinfer {

inline float HalfToFloat(uint16_t bits) {
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  const int exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 0x1f) {
    magnitude = mantissa ? std::numeric_limits<float>::quiet_NaN()
                         : std::numeric_limits<float>::infinity();
  } else {
    magnitude = std::ldexp(1.0f + mantissa / 1024.0f, exponent - 15);
  }
  return (bits & 0x8000) ? -magnitude : magnitude;
#endif
}

inline uint16_t FloatToHalf(float value) {
#if defined(__F16C__)
  return _cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t sign = (bits >> 16) & 0x8000, magnitude = bits & 0x7fffffff;
  if (magnitude > 0x7f800000) return static_cast<uint16_t>(sign | 0x7e00);  // NaN
  if (magnitude >= 0x477ff000) return static_cast<uint16_t>(sign | 0x7c00);  // to infinity
  if (magnitude < 0x38800000) {  // below the smallest normal half: m * 2^-24, m rounded
    float scaled;
    std::memcpy(&scaled, &magnitude, sizeof(scaled));
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled * 16777216.0f)));
  }
  // Rebias the exponent (127 -> 15) and round the mantissa's low 13 bits to nearest even.
  const uint32_t rounded = magnitude + 0xfff + ((magnitude >> 13) & 1);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000) >> 13));
#endif
}

}  // namespace jaxinfer

#endif  // JAXINFER_PALLAS_KERNELS_CPU_HALF_H_
