// The CPU kernels' schedule of experts over the thread pool: for_each_expert, shared by the dense
// (lora_expert.cpp) and the packed (lora_expert_packed.cpp) grouped LoRA expert ops.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace slmoe {
namespace cpu {

// Below this many multiply-adds per call, waking the thread pool costs more than it saves.
constexpr int64_t kMinParallelMacs = int64_t{1} << 20;

// Runs fn(e) once for every expert e. Experts holding more than one thread's fair share of rows
// run one after another with multi-threaded GEMMs; the rest are packed longest-first onto the
// least loaded thread and run with single-threaded GEMMs, so uneven routing neither serializes the
// call on one thread nor drowns small experts in threading overhead. macs_per_row sizes the call.
template <typename F>
void for_each_expert(const std::vector<int64_t>& offsets, int64_t macs_per_row, const F& fn) {
  const int64_t E = static_cast<int64_t>(offsets.size()) - 1;
  const int64_t T = offsets[E];
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || at::in_parallel_region() || E <= 1 || T * macs_per_row < kMinParallelMacs) {
    for (int64_t e = 0; e < E; ++e) fn(e);
    return;
  }
  auto rows = [&](int64_t e) { return offsets[e + 1] - offsets[e]; };
  std::vector<int64_t> small;
  for (int64_t e = 0; e < E; ++e) {
    if (rows(e) * threads > T) {
      fn(e);  // big expert: its GEMMs use all threads
    } else {
      small.push_back(e);
    }
  }
  if (small.empty()) return;
  std::stable_sort(small.begin(), small.end(), [&](int64_t a, int64_t b) { return rows(a) > rows(b); });
  const int64_t bins = std::min<int64_t>(threads, static_cast<int64_t>(small.size()));
  std::vector<std::vector<int64_t>> bin_experts(bins);
  std::vector<int64_t> bin_rows(bins, 0);
  for (int64_t e : small) {
    const auto b = std::min_element(bin_rows.begin(), bin_rows.end()) - bin_rows.begin();
    bin_experts[b].push_back(e);
    bin_rows[b] += rows(e);
  }
  // grain 1 over `bins` tasks: OpenMP hands each thread exactly one bin.
  at::parallel_for(0, bins, 1, [&](int64_t begin, int64_t end) {
    // Worker threads start with default dispatch TLS; keep the inner ATen calls below autograd.
    at::AutoDispatchBelowADInplaceOrView guard;
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t e : bin_experts[b]) fn(e);
    }
  });
}

// for_each_expert as a value the shared ATen math can call.
constexpr auto kCpuExperts = [](const std::vector<int64_t>& offsets, int64_t macs_per_row, const auto& fn) {
  for_each_expert(offsets, macs_per_row, fn);
};

}  // namespace cpu
}  // namespace slmoe
