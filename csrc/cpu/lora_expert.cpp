// CPU impl of the grouped LoRA expert op (schema in csrc/bindings.cpp): the per-expert ATen math of
// lora_expert_aten.h, spread over the thread pool by for_each_expert below.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "lora_expert_aten.h"
#include "lora_expert_checks.h"

namespace slmoe {
namespace {

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

std::tuple<at::Tensor, at::Tensor> lora_grouped_linear_fwd_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                               const at::Tensor& lora_a, const at::Tensor& lora_b,
                                                               const at::Tensor& tokens_per_expert, double scaling,
                                                               const std::optional<at::Tensor>& lora_x,
                                                               const std::optional<at::Tensor>& probs) {
  const auto d = check_forward_inputs(x, weight, lora_a, lora_b, tokens_per_expert, lora_x, probs);
  const auto offsets = group_offsets(tokens_per_expert, d.T);
  return lora_grouped_linear_fwd_aten(d, offsets, x, weight, lora_a, lora_b, scaling, lora_x, probs,
                                      kCpuExperts);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lora_grouped_linear_bwd_cpu(
    const at::Tensor& grad_y, const at::Tensor& lora_x, const at::Tensor& weight, const at::Tensor& lora_a,
    const at::Tensor& lora_b, const at::Tensor& h, const at::Tensor& tokens_per_expert, double scaling,
    const std::optional<at::Tensor>& lora_mask, std::array<bool, 3> output_mask,
    const std::optional<at::Tensor>& probs) {
  const auto d = check_backward_inputs(grad_y, lora_x, weight, lora_a, lora_b, h, tokens_per_expert, lora_mask,
                                       probs);
  const auto offsets = group_offsets(tokens_per_expert, d.T);
  return lora_grouped_linear_bwd_aten(d, offsets, grad_y, lora_x, weight, lora_a, lora_b, h, scaling, lora_mask,
                                      output_mask, probs, kCpuExperts);
}

}  // namespace

TORCH_LIBRARY_IMPL(slmoe, CPU, m) {
  m.impl("lora_grouped_linear_fwd", &lora_grouped_linear_fwd_cpu);
  m.impl("lora_grouped_linear_bwd", &lora_grouped_linear_bwd_cpu);
}

}  // namespace slmoe
