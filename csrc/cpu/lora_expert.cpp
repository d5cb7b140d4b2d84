// CPU impl of the grouped LoRA expert op (schema in csrc/bindings.cpp): the per-expert ATen math of
// lora_expert_aten.h, spread over the thread pool by for_each_expert (cpu/expert_schedule.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "expert_schedule.h"
#include "lora_expert_aten.h"
#include "lora_expert_checks.h"

namespace slmoe {
namespace {

using cpu::kCpuExperts;

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
