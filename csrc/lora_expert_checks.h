// Argument checks and group offsets for the grouped LoRA expert op, shared by every device's impl
// so a bad call fails with the same message on CPU, CUDA and NPU.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace slmoe {

inline void check_float_dtype(const at::Tensor& t, const char* name) {
  const auto dt = t.scalar_type();
  TORCH_CHECK_TYPE(
      dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf,
      "lora_grouped_linear: ", name, " must be float32, float64, bfloat16 or float16, got ", dt);
}

inline void check_like(const at::Tensor& t, const at::Tensor& x, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == x.scalar_type(), "lora_grouped_linear: ", name, " has dtype ",
                   t.scalar_type(), " but x has ", x.scalar_type());
  TORCH_CHECK_VALUE(t.device() == x.device(), "lora_grouped_linear: ", name, " is on ", t.device(),
                    " but x is on ", x.device());
}

inline void check_shape(const at::Tensor& t, at::IntArrayRef want, const char* name, const char* layout) {
  TORCH_CHECK_VALUE(t.sizes() == want, "lora_grouped_linear: ", name, " must have shape ", layout, " = ",
                    want, ", got ", t.sizes());
}

// Sizes of one call: T rows, E experts, d_in -> d_out, rank r.
struct GroupedDims {
  int64_t T, E, d_in, d_out, r;
};

inline GroupedDims check_grouped_inputs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_a,
                                        const at::Tensor& lora_b, const at::Tensor& tokens_per_expert) {
  TORCH_CHECK_VALUE(x.dim() == 2, "lora_grouped_linear: x must be 2-D [T, d_in], got ", x.sizes());
  check_float_dtype(x, "x");
  TORCH_CHECK_VALUE(weight.dim() == 3, "lora_grouped_linear: weight must be 3-D [E, d_out, d_in], got ",
                    weight.sizes());
  TORCH_CHECK_VALUE(lora_a.dim() == 3, "lora_grouped_linear: lora_a must be 3-D [E, r, d_in], got ",
                    lora_a.sizes());
  check_like(weight, x, "weight");
  check_like(lora_a, x, "lora_a");
  check_like(lora_b, x, "lora_b");
  GroupedDims d{x.size(0), weight.size(0), x.size(1), weight.size(1), lora_a.size(1)};
  check_shape(weight, {d.E, d.d_out, d.d_in}, "weight", "[E, d_out, d_in]");
  check_shape(lora_a, {d.E, d.r, d.d_in}, "lora_a", "[E, r, d_in]");
  check_shape(lora_b, {d.E, d.d_out, d.r}, "lora_b", "[E, d_out, r]");
  // Group sizes are read on the host to plan the per-expert GEMMs, on every device.
  TORCH_CHECK_VALUE(tokens_per_expert.device().is_cpu(),
                    "lora_grouped_linear: tokens_per_expert must be a CPU tensor, got one on ",
                    tokens_per_expert.device());
  TORCH_CHECK_TYPE(tokens_per_expert.scalar_type() == at::kLong,
                   "lora_grouped_linear: tokens_per_expert must be int64, got ", tokens_per_expert.scalar_type());
  check_shape(tokens_per_expert, {d.E}, "tokens_per_expert", "[E]");
  return d;
}

// The optional per-row scale of the output: [T], x's dtype and device.
inline void check_probs(const std::optional<at::Tensor>& probs, const at::Tensor& x) {
  if (!probs.has_value()) return;
  check_like(*probs, x, "probs");
  check_shape(*probs, {x.size(0)}, "probs", "[T]");
}

// Row offset of each expert's group: offsets[e]..offsets[e + 1]. Checks the counts cover x exactly.
inline std::vector<int64_t> group_offsets(const at::Tensor& tokens_per_expert, int64_t T) {
  const auto counts = tokens_per_expert.contiguous();
  const int64_t* c = counts.data_ptr<int64_t>();
  const int64_t E = counts.numel();
  std::vector<int64_t> offsets(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK_VALUE(c[e] >= 0, "lora_grouped_linear: tokens_per_expert[", e, "] is negative (", c[e], ")");
    offsets[e + 1] = offsets[e] + c[e];
  }
  TORCH_CHECK_VALUE(offsets[E] == T, "lora_grouped_linear: tokens_per_expert sums to ", offsets[E],
                    " but x has ", T, " rows");
  return offsets;
}

// All checks of the forward: the grouped inputs, lora_x (the LoRA input, x times a dropout mask)
// like x and probs [T] when given. Returns the sizes.
inline GroupedDims check_forward_inputs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_a,
                                        const at::Tensor& lora_b, const at::Tensor& tokens_per_expert,
                                        const std::optional<at::Tensor>& lora_x,
                                        const std::optional<at::Tensor>& probs) {
  const auto d = check_grouped_inputs(x, weight, lora_a, lora_b, tokens_per_expert);
  check_probs(probs, x);
  if (lora_x.has_value()) {
    check_like(*lora_x, x, "lora_x");
    check_shape(*lora_x, x.sizes(), "lora_x", "like x");
  }
  return d;
}

// All checks of the backward: the grouped inputs (lora_x in the role of x), grad_y [T, d_out],
// h [T, r], the dropout mask like lora_x and probs [T] when given. Returns the sizes.
inline GroupedDims check_backward_inputs(const at::Tensor& grad_y, const at::Tensor& lora_x, const at::Tensor& weight,
                                         const at::Tensor& lora_a, const at::Tensor& lora_b, const at::Tensor& h,
                                         const at::Tensor& tokens_per_expert,
                                         const std::optional<at::Tensor>& lora_mask,
                                         const std::optional<at::Tensor>& probs) {
  const auto d = check_grouped_inputs(lora_x, weight, lora_a, lora_b, tokens_per_expert);
  check_probs(probs, lora_x);
  check_like(grad_y, lora_x, "grad_y");
  check_shape(grad_y, {d.T, d.d_out}, "grad_y", "[T, d_out]");
  check_like(h, lora_x, "h");
  check_shape(h, {d.T, d.r}, "h", "[T, r]");
  if (lora_mask.has_value()) {
    check_like(*lora_mask, lora_x, "lora_mask");
    check_shape(*lora_mask, lora_x.sizes(), "lora_mask", "like x");
  }
  return d;
}

}  // namespace slmoe
