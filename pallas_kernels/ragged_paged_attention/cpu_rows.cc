// Row writes and reads of a KV pool for XLA:CPU, in the pool's own buffer, as XLA FFI calls.
//
// Two things XLA:CPU does copied whole float8 pools inside the decode step:
//  - it scatters and gathers no float8 array: it widened the whole pool to float16 around
//    each, and a uint8 `bitcast_convert_type` of the pool (the way round that) is a copy too
//    (float8 KV decoded at a third of float32 KV's speed);
//  - it copies a loop-carried pool to alias an in-place update to a reshape of it.
// These handlers move rows as bytes (any element type): `WriteRows` updates the pool in place
// (the call's output aliases it, the pool taken in its own shape), `ReadRows` copies out the
// rows asked for.
//
// Layout: the pool is [L, N..., R...]: per layer, the N axes (their product is the row count)
// hold rows of the trailing `row_rank` axes R. Of the pool [L, P, Z, 2K, H], row_rank 2 makes
// the rows token slots (P*Z of them) and 3 whole pages. Slots and indices are int32 row numbers
// within the layer. The pool is taken in its own shape, not reshaped first: XLA could not
// alias the write's output to a reshape of a loop-carried pool, and copied the pool for it.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The pool's layer count, rows per layer and bytes per row (of any element width: the rows
// are moved as bytes); layers 0 unless the pool has a layer axis, a row axis and `row_rank`.
struct PoolShape {
  int64_t layers = 0, rows = 1, row_bytes = 1;
};

PoolShape ShapeOf(const ffi::AnyBuffer& pool, int64_t row_rank) {
  auto dims = pool.dimensions();
  const int64_t rank = dims.size();
  if (row_rank < 0 || rank < row_rank + 2) return PoolShape{};
  PoolShape shape{dims[0], 1, static_cast<int64_t>(ffi::ByteWidth(pool.element_type()))};
  for (int64_t axis = 1; axis < rank - row_rank; ++axis) shape.rows *= dims[axis];
  for (int64_t axis = rank - row_rank; axis < rank; ++axis) shape.row_bytes *= dims[axis];
  return shape;
}

// The layer index clamped into range, as XLA's dynamic indexing does.
inline int64_t ClampedLayer(const ffi::Buffer<ffi::S32>& layer, int64_t layers) {
  return std::clamp<int64_t>(layer.typed_data()[0], 0, layers - 1);
}

// pool[layer, slots[t]] = rows[t]; a slot outside [0, N) is dropped (the engine's padding).
// The pool and rows come as AnyBuffer: this FFI maps no C++ type to its float8 kinds.
ffi::Error WriteImpl(ffi::AnyBuffer pool, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> slots,
                     ffi::Buffer<ffi::S32> layer, int64_t row_rank,
                     ffi::Result<ffi::AnyBuffer> out) {
  const PoolShape shape = ShapeOf(pool, row_rank);
  if (shape.layers == 0) return ffi::Error::InvalidArgument("the pool must be [L, N..., R...]");
  const int64_t count = slots.element_count();
  if (rows.element_type() != pool.element_type() ||
      static_cast<int64_t>(rows.size_bytes()) != count * shape.row_bytes) {
    return ffi::Error::InvalidArgument("rows must be [T, R...] of the pool's dtype for [T] slots");
  }
  auto* target = static_cast<uint8_t*>(out->untyped_data());
  if (target != pool.untyped_data()) {  // XLA did not alias the output to the pool
    std::memcpy(target, pool.untyped_data(), pool.size_bytes());
  }
  const int64_t layer_offset = ClampedLayer(layer, shape.layers) * shape.rows;
  const auto* source = static_cast<const uint8_t*>(rows.untyped_data());
  const int32_t* slot = slots.typed_data();
  for (int64_t t = 0; t < count; ++t) {
    if (slot[t] < 0 || slot[t] >= shape.rows) continue;
    std::memcpy(target + (layer_offset + slot[t]) * shape.row_bytes,
                source + t * shape.row_bytes, shape.row_bytes);
  }
  return ffi::Error::Success();
}

// out[i] = pool[layer, index[i]], an index clamped into [0, N) as XLA's gather clamps it.
ffi::Error ReadImpl(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> index,
                    ffi::Buffer<ffi::S32> layer, int64_t row_rank,
                    ffi::Result<ffi::AnyBuffer> out) {
  const PoolShape shape = ShapeOf(pool, row_rank);
  if (shape.layers == 0) return ffi::Error::InvalidArgument("the pool must be [L, N..., R...]");
  const int64_t count = index.element_count();
  if (static_cast<int64_t>(out->size_bytes()) != count * shape.row_bytes) {
    return ffi::Error::InvalidArgument("the output must be [..., R...] for [...] indices");
  }
  const int64_t layer_offset = ClampedLayer(layer, shape.layers) * shape.rows;
  const auto* source = static_cast<const uint8_t*>(pool.untyped_data());
  auto* target = static_cast<uint8_t*>(out->untyped_data());
  const int32_t* row = index.typed_data();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t chosen = std::clamp<int64_t>(row[i], 0, shape.rows - 1);
    std::memcpy(target + i * shape.row_bytes,
                source + (layer_offset + chosen) * shape.row_bytes, shape.row_bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WriteRows, WriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("row_rank")
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ReadRows, ReadImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("row_rank")
                                  .Ret<ffi::AnyBuffer>());
