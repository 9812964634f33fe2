// Splitting a CPU kernel's work over XLA:CPU's own intra-op thread pool.
//
// The kernels used OpenMP first. OpenMP keeps a team of threads per calling thread and lets
// them spin after each parallel region, so on a machine with few cores its idle threads
// competed with XLA's for the same cores: a 3 MB weight that the kernel streams at ~30 GB/s
// alone took 0.36 ms (~8 GB/s) inside a decode step. Tasks on the pool XLA hands to FFI calls
// (`ffi::ThreadPool`) share XLA's threads instead of adding to them.

#ifndef JAXINFER_PALLAS_KERNELS_CPU_PARALLEL_H_
#define JAXINFER_PALLAS_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxinfer {

// Runs body(i) for every i in [0, count): the calling thread and up to `threads - 1` tasks
// scheduled on `pool` claim indices from a shared counter until none are left, and the call
// returns when every claimed index is done. The caller never waits for a helper to start (a
// busy pool only means the caller does more of the work), so it cannot deadlock; a helper
// that starts late finds no index left and touches nothing but the shared counter.
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t count, int64_t threads, const Body& body) {
  const int64_t helpers =
      std::min<int64_t>({threads - 1, count - 1, static_cast<int64_t>(pool.num_threads())});
  if (helpers <= 0) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  struct Progress {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto progress = std::make_shared<Progress>();
  const Body* work = &body;
  auto claim = [progress, count, work]() {
    for (;;) {
      const int64_t i = progress->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= count) return;
      (*work)(i);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < helpers; ++h) {
    auto task = claim;  // Schedule takes its task by value (an rvalue)
    pool.Schedule(std::move(task));
  }
  claim();
  while (progress->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

}  // namespace jaxinfer

#endif  // JAXINFER_PALLAS_KERNELS_CPU_PARALLEL_H_
