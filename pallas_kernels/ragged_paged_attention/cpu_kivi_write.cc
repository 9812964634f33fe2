// A decode step's KIVI writes for XLA:CPU (`kivi.write_to_kivi_pages`), as an XLA FFI call.
//
// XLA sizes the step's page quantization for the most pages a step could complete (one per
// sequence at decode): at 64 sequences it quantized 64 pages' rows every layer of every step,
// most of them then dropped, and a KIVI int4 decode step ran at ~0.7x a float32 KV step. Here
// only the pages the step completes are quantized, in the pool's own buffers (every output
// aliases its input): first each completed page, from its residual seat's earlier rows and the
// step's rows, then the step's rows of each sequence's partial last page into its seat (the
// seat is read before it is written: a sequence may complete a page and start the next).
//
// Shapes as in `kivi.py`: pages [L, P, Z, 2K, H * bits / 8] uint8, key scales and zeros
// [L, P, K, H] float16, value scales and zeros [L, P, Z, K, H / g] float16, residual
// [L, R, Z, 2K, H] float32; the step's rows [T, 2K, H] float32 and per-token int32 slot,
// position, context (keys before the step), kv_len (after it) and seat.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_half.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxinfer::FloatToHalf;
using jaxinfer::HalfToFloat;

// Min-max codes of `count` values `stride` apart, as `kivi.asymmetric`: zero = low and
// scale = (high - low) / levels, both stored as float16, and each code
// clip(round((x - zero) / scale), 0, levels) with the stored (widened) zero and scale.
void Asymmetric(const float* values, int64_t count, int64_t stride, int levels, uint8_t* codes,
                uint16_t* scale, uint16_t* zero) {
  float low = std::numeric_limits<float>::infinity();
  float high = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < count; ++i) {
    low = std::min(low, values[i * stride]);
    high = std::max(high, values[i * stride]);
  }
  *zero = FloatToHalf(low);
  *scale = FloatToHalf((high - low) / static_cast<float>(levels));
  const float stored_zero = HalfToFloat(*zero), stored_scale = HalfToFloat(*scale);
  const float divisor = stored_scale > 0.0f ? stored_scale : 1.0f;
  for (int64_t i = 0; i < count; ++i) {
    const float code = std::nearbyint((values[i * stride] - stored_zero) / divisor);
    codes[i] = static_cast<uint8_t>(std::clamp(code, 0.0f, static_cast<float>(levels)));
  }
}

struct KiviShape {
  int64_t pages, page_size, num_kv_heads, head_dim, bits, value_group, seats;
};

// Quantizes one page of float rows [Z, 2K, H] into its packed codes and scales (one layer's
// arrays, at the page): keys per channel over the Z rows, values per row and group of g.
void QuantizePage(const float* rows, const KiviShape& shape, uint8_t* packed,
                  uint16_t* key_scales, uint16_t* key_zeros, uint16_t* value_scales,
                  uint16_t* value_zeros) {
  const int64_t page_size = shape.page_size, num_kv_heads = shape.num_kv_heads;
  const int64_t head_dim = shape.head_dim, combined = 2 * num_kv_heads;
  const int64_t per_byte = 8 / shape.bits, row_bytes = head_dim / per_byte;
  const int64_t groups = head_dim / shape.value_group;
  const int levels = (1 << shape.bits) - 1;
  std::vector<uint8_t> codes(page_size * combined * head_dim);  // [Z, 2K, H]
  for (int64_t k = 0; k < num_kv_heads; ++k) {
    for (int64_t h = 0; h < head_dim; ++h) {  // keys: channel (k, h) over the Z rows
      uint8_t column[64];
      Asymmetric(rows + 2 * k * head_dim + h, page_size, combined * head_dim, levels, column,
                 key_scales + k * head_dim + h, key_zeros + k * head_dim + h);
      for (int64_t z = 0; z < page_size; ++z) {
        codes[(z * combined + 2 * k) * head_dim + h] = column[z];
      }
    }
    for (int64_t z = 0; z < page_size; ++z) {  // values: row z, group of g channels
      for (int64_t group = 0; group < groups; ++group) {
        const int64_t first = (z * combined + 2 * k + 1) * head_dim + group * shape.value_group;
        const int64_t scale = (z * num_kv_heads + k) * groups + group;
        Asymmetric(rows + first, shape.value_group, 1, levels, codes.data() + first,
                   value_scales + scale, value_zeros + scale);
      }
    }
  }
  std::memset(packed, 0, page_size * combined * row_bytes);
  for (int64_t row = 0; row < page_size * combined; ++row) {
    for (int64_t h = 0; h < head_dim; ++h) {
      packed[row * row_bytes + h / per_byte] |=
          static_cast<uint8_t>(codes[row * head_dim + h] << ((h % per_byte) * shape.bits));
    }
  }
}

ffi::Error KiviWriteImpl(ffi::Buffer<ffi::U8> pages, ffi::Buffer<ffi::F16> key_scales,
                         ffi::Buffer<ffi::F16> key_zeros, ffi::Buffer<ffi::F16> value_scales,
                         ffi::Buffer<ffi::F16> value_zeros, ffi::Buffer<ffi::F32> residual,
                         ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::S32> slots,
                         ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> contexts,
                         ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> seats,
                         ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::U8> pages_out,
                         ffi::ResultBuffer<ffi::F16> key_scales_out,
                         ffi::ResultBuffer<ffi::F16> key_zeros_out,
                         ffi::ResultBuffer<ffi::F16> value_scales_out,
                         ffi::ResultBuffer<ffi::F16> value_zeros_out,
                         ffi::ResultBuffer<ffi::F32> residual_out) {
  auto pool = pages.dimensions();          // [L, P, Z, 2K, Hb]
  auto exact = residual.dimensions();      // [L, R, Z, 2K, H]
  auto values = value_scales.dimensions();  // [L, P, Z, K, H / g]
  if (pool.size() != 5 || exact.size() != 5 || values.size() != 5 ||
      rows.dimensions().size() != 3) {
    return ffi::Error::InvalidArgument("KIVI pool, residual, value scales or rows of the wrong rank");
  }
  const int64_t head_dim = exact[4];
  if (pool[4] <= 0 || (8 * pool[4]) % head_dim != 0 || values[4] <= 0 ||
      head_dim % values[4] != 0 || pool[2] > 64) {
    return ffi::Error::InvalidArgument("packed rows, value groups or page size do not fit");
  }
  const KiviShape shape{pool[1], pool[2], pool[3] / 2, head_dim, 8 * pool[4] / head_dim,
                        head_dim / values[4], exact[1]};
  if (shape.bits != 1 && shape.bits != 2 && shape.bits != 4 && shape.bits != 8) {
    return ffi::Error::InvalidArgument("KIVI codes of 1, 2, 4 or 8 bits");
  }
  // XLA aliases every output to its input; were one not, it starts as a copy of the input.
  auto same = [](const void* from, void* to, size_t bytes) {
    if (from != to) std::memcpy(to, from, bytes);
  };
  same(pages.untyped_data(), pages_out->untyped_data(), pages.size_bytes());
  same(key_scales.untyped_data(), key_scales_out->untyped_data(), key_scales.size_bytes());
  same(key_zeros.untyped_data(), key_zeros_out->untyped_data(), key_zeros.size_bytes());
  same(value_scales.untyped_data(), value_scales_out->untyped_data(), value_scales.size_bytes());
  same(value_zeros.untyped_data(), value_zeros_out->untyped_data(), value_zeros.size_bytes());
  same(residual.untyped_data(), residual_out->untyped_data(), residual.size_bytes());

  const int64_t index = std::clamp<int64_t>(layer.typed_data()[0], 0, pool[0] - 1);
  const int64_t page_size = shape.page_size, combined = 2 * shape.num_kv_heads;
  const int64_t row_floats = combined * head_dim, page_floats = page_size * row_floats;
  const int64_t page_bytes = page_size * combined * pool[4];
  const int64_t key_page = shape.num_kv_heads * head_dim;
  const int64_t value_page = page_size * values[3] * values[4];
  uint8_t* packed = pages_out->typed_data() + index * shape.pages * page_bytes;
  uint16_t* layer_key_scales = key_scales_out->typed_data() + index * shape.pages * key_page;
  uint16_t* layer_key_zeros = key_zeros_out->typed_data() + index * shape.pages * key_page;
  uint16_t* layer_value_scales =
      value_scales_out->typed_data() + index * shape.pages * value_page;
  uint16_t* layer_value_zeros = value_zeros_out->typed_data() + index * shape.pages * value_page;
  float* seats_rows = residual_out->typed_data() + index * shape.seats * page_floats;
  const float* step_rows = rows.typed_data();
  const int32_t* slot = slots.typed_data();
  const int32_t* position = positions.typed_data();
  const int32_t* context = contexts.typed_data();
  const int32_t* kv_len = kv_lens.typed_data();
  const int32_t* seat = seats.typed_data();
  const int64_t num_tokens = slots.element_count();

  // 1. Each page a token completes (its last row): earlier rows from the seat, the step's own.
  std::vector<float> page(page_floats);
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slot[t] < 0 || position[t] % page_size != page_size - 1) continue;
    const int64_t target = slot[t] / page_size;
    const int64_t chosen = std::clamp<int64_t>(seat[t], 0, shape.seats - 1);
    if (target >= shape.pages) continue;
    for (int64_t z = 0; z < page_size; ++z) {
      const int64_t row_position = position[t] - (page_size - 1) + z;
      const float* source =
          row_position >= context[t]
              ? step_rows + std::clamp<int64_t>(t - (page_size - 1) + z, 0, num_tokens - 1) *
                                row_floats
              : seats_rows + (chosen * page_size + z) * row_floats;
      std::memcpy(page.data() + z * row_floats, source, row_floats * sizeof(float));
    }
    QuantizePage(page.data(), shape, packed + target * page_bytes,
                 layer_key_scales + target * key_page, layer_key_zeros + target * key_page,
                 layer_value_scales + target * value_page, layer_value_zeros + target * value_page);
  }
  // 2. The rows of each sequence's partial last page, into its seat.
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slot[t] < 0 || position[t] / page_size != kv_len[t] / page_size) continue;
    if (seat[t] < 0 || seat[t] >= shape.seats) continue;
    std::memcpy(seats_rows + (seat[t] * page_size + position[t] % page_size) * row_floats,
                step_rows + t * row_floats, row_floats * sizeof(float));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KiviWrite, KiviWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
