// The one parallel-for of the CPU kernels, with no ONNX Runtime types: a non-owning view of a
// thread pool (ORT's, through OrtParallelFor in ort_common.h) that runs a callable over
// [0, n). A call costs one indirect call per item, as a plain function pointer would: no
// std::function, no heap allocation, no virtual call.
#pragma once

#include <cstddef>

namespace ort_lora {

class ParallelFor {
 public:
  // Runs fn(data, i) for every i in [0, n) on `pool`, possibly in parallel; returns when all
  // are done (the shape of ORT's KernelContext::ParallelFor).
  using Runner = void (*)(const void* pool, void (*fn)(void* data, size_t i), size_t n, void* data);

  ParallelFor(Runner run, const void* pool) : run_(run), pool_(pool) {}

  // Calls fn(i) for every i in [0, n), possibly on several threads; returns when all are done.
  // n <= 1 runs on the calling thread (no pool wake-up). fn must be safe to call concurrently.
  template <typename Fn>
  void operator()(size_t n, const Fn& fn) const {
    if (n <= 1) {
      if (n == 1) fn(size_t{0});
      return;
    }
    run_(pool_, &Call<Fn>, n, const_cast<Fn*>(&fn));
  }

 private:
  template <typename Fn>
  static void Call(void* fn, size_t i) {
    (*static_cast<const Fn*>(fn))(i);
  }

  Runner run_;
  const void* pool_;
};

}  // namespace ort_lora
