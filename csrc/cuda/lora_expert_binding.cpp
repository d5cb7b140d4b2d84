// CUDA impl of the grouped LoRA expert op (schema in csrc/bindings.cpp).
//
// Thin: the same argument checks as the CPU impl (lora_expert_checks.h, same messages), tensors
// made contiguous, outputs allocated, then the torch-free launchers of lora_expert_kernels.cu on
// the current stream. Compiled by the host compiler (no nvcc needed for torch's headers) and only
// in CUDA builds (setup.py).
//
// tokens_per_expert stays a CPU tensor in the op's contract: the counts are validated on the host
// (as on every device) and then copied to the device through pinned memory, without a sync; the
// kernels compute the group offsets and the tile schedule from the device copy.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <limits>
#include <optional>
#include <tuple>

#include "lora_expert_checks.h"
#include "lora_expert_cuda.h"
#include "lora_expert_packed.h"
#include "packed_scratch.h"

namespace slmoe {
namespace {

cuda::DType to_kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cuda::DType::kFloat32;
    case at::kDouble: return cuda::DType::kFloat64;
    case at::kBFloat16: return cuda::DType::kBFloat16;
    case at::kHalf: return cuda::DType::kFloat16;
    default: break;
  }
  TORCH_CHECK_TYPE(false, "lora_grouped_linear: unsupported dtype ", t);
  return cuda::DType::kFloat32;  // not reached
}

void check_cuda_limits(const GroupedDims& d) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  TORCH_CHECK_VALUE(d.T < kMax && d.E < kMax && d.d_in < kMax && d.d_out < kMax && d.r < kMax,
                    "lora_grouped_linear (CUDA): T, E, d_in, d_out and r must be below 2^31, got T=", d.T,
                    ", E=", d.E, ", d_in=", d.d_in, ", d_out=", d.d_out, ", r=", d.r);
}

// The counts on `device`, copied asynchronously: pinned staging makes the copy truly async (a
// pageable source may make the driver wait for the stream), and the caching host allocator keeps
// the staging buffer alive until the copy has run.
at::Tensor counts_on_device(const at::Tensor& tokens_per_expert, const at::Device& device) {
  return tokens_per_expert.contiguous().pin_memory().to(device, at::kLong, /*non_blocking=*/true);
}

at::Tensor workspace(int64_t E, const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(cuda::lora_workspace_elems(E))}, like.options().dtype(at::kInt));
}

// The dense launchers' arguments, the weight left to the caller (the packed path decodes it into
// its scratch chunk by chunk).
cuda::LoraFwdArgs dense_fwd_args(const GroupedDims& d, double scaling, const at::Tensor& x,
                                 const std::optional<at::Tensor>& lora_x, const at::Tensor& lora_a,
                                 const at::Tensor& lora_b, const at::Tensor& counts, at::Tensor& y,
                                 at::Tensor& h, at::Tensor& ws) {
  cuda::LoraFwdArgs a{};
  a.dtype = to_kernel_dtype(x.scalar_type());
  a.T = d.T;
  a.E = d.E;
  a.d_in = d.d_in;
  a.d_out = d.d_out;
  a.r = d.r;
  a.scaling = scaling;
  a.x = x.data_ptr();
  a.lora_x = lora_x.has_value() ? lora_x->data_ptr() : nullptr;
  a.lora_a = lora_a.data_ptr();
  a.lora_b = lora_b.data_ptr();
  a.tokens_per_expert = counts.data_ptr<int64_t>();
  a.y = y.data_ptr();
  a.h = h.data_ptr();
  a.workspace = ws.data_ptr<int32_t>();
  return a;
}

cuda::LoraBwdArgs dense_bwd_args(const GroupedDims& d, double scaling, const at::Tensor& dy,
                                 const at::Tensor& lora_x, const at::Tensor& lora_a,
                                 const at::Tensor& lora_b, const at::Tensor& h,
                                 const std::optional<at::Tensor>& mask, const at::Tensor& counts,
                                 at::Tensor& dx, at::Tensor& da, at::Tensor& db, at::Tensor& dh,
                                 at::Tensor& ws) {
  cuda::LoraBwdArgs a{};
  a.dtype = to_kernel_dtype(lora_x.scalar_type());
  a.T = d.T;
  a.E = d.E;
  a.d_in = d.d_in;
  a.d_out = d.d_out;
  a.r = d.r;
  a.scaling = scaling;
  a.grad_y = dy.data_ptr();
  a.lora_x = lora_x.data_ptr();
  a.lora_a = lora_a.data_ptr();
  a.lora_b = lora_b.data_ptr();
  a.h = h.data_ptr();
  a.lora_mask = mask.has_value() ? mask->data_ptr() : nullptr;
  a.tokens_per_expert = counts.data_ptr<int64_t>();
  a.dx = dx.defined() ? dx.data_ptr() : nullptr;
  a.da = da.defined() ? da.data_ptr() : nullptr;
  a.db = db.defined() ? db.data_ptr() : nullptr;
  a.dh = dh.defined() ? dh.data_ptr() : nullptr;
  a.workspace = ws.data_ptr<int32_t>();
  return a;
}

std::tuple<at::Tensor, at::Tensor> lora_grouped_linear_fwd_cuda(const at::Tensor& x_in, const at::Tensor& weight_in,
                                                                const at::Tensor& lora_a_in,
                                                                const at::Tensor& lora_b_in,
                                                                const at::Tensor& tokens_per_expert,
                                                                double scaling,
                                                                const std::optional<at::Tensor>& lora_x_in,
                                                                const std::optional<at::Tensor>& probs) {
  const auto d = check_grouped_inputs(x_in, weight_in, lora_a_in, lora_b_in, tokens_per_expert);
  if (lora_x_in.has_value()) {
    check_like(*lora_x_in, x_in, "lora_x");
    check_shape(*lora_x_in, x_in.sizes(), "lora_x", "like x");
  }
  check_probs(probs, x_in);
  group_offsets(tokens_per_expert, d.T);  // validates the counts; the kernels recompute offsets on the device
  check_cuda_limits(d);
  at::AutoDispatchBelowADInplaceOrView guard;
  const c10::cuda::CUDAGuard device_guard(x_in.device());

  const auto x = x_in.contiguous();
  const auto weight = weight_in.contiguous();
  const auto lora_a = lora_a_in.contiguous();
  const auto lora_b = lora_b_in.contiguous();
  const auto lora_x = lora_x_in.has_value() ? std::optional<at::Tensor>(lora_x_in->contiguous()) : std::nullopt;
  auto y = at::empty({d.T, d.d_out}, x.options());
  auto h = at::empty({d.T, d.r}, x.options());
  if (d.T == 0) return {y, h};

  const auto counts = counts_on_device(tokens_per_expert, x.device());
  auto ws = workspace(d.E, x);
  auto args = dense_fwd_args(d, scaling, x, lora_x, lora_a, lora_b, counts, y, h, ws);
  args.weight = weight.data_ptr();
  C10_CUDA_CHECK(cuda::lora_grouped_linear_fwd(args, c10::cuda::getCurrentCUDAStream(x.device().index()).stream()));
  // The row scale as a separate pass for now (a per-row epilogue scale in the fused GEMM would
  // save it).
  if (probs.has_value()) y.mul_(probs->unsqueeze(1));
  return {y, h};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lora_grouped_linear_bwd_cuda(
    const at::Tensor& grad_y_in, const at::Tensor& lora_x_in, const at::Tensor& weight_in,
    const at::Tensor& lora_a_in, const at::Tensor& lora_b_in, const at::Tensor& h_in,
    const at::Tensor& tokens_per_expert, double scaling, const std::optional<at::Tensor>& lora_mask_in,
    std::array<bool, 3> output_mask, const std::optional<at::Tensor>& probs) {
  const auto d = check_grouped_inputs(lora_x_in, weight_in, lora_a_in, lora_b_in, tokens_per_expert);
  check_probs(probs, lora_x_in);
  check_like(grad_y_in, lora_x_in, "grad_y");
  check_shape(grad_y_in, {d.T, d.d_out}, "grad_y", "[T, d_out]");
  check_like(h_in, lora_x_in, "h");
  check_shape(h_in, {d.T, d.r}, "h", "[T, r]");
  if (lora_mask_in.has_value()) {
    check_like(*lora_mask_in, lora_x_in, "lora_mask");
    check_shape(*lora_mask_in, lora_x_in.sizes(), "lora_mask", "like x");
  }
  group_offsets(tokens_per_expert, d.T);
  check_cuda_limits(d);
  const bool need_dx = output_mask[0], need_da = output_mask[1], need_db = output_mask[2];
  at::AutoDispatchBelowADInplaceOrView guard;
  const c10::cuda::CUDAGuard device_guard(lora_x_in.device());

  const auto dy = grad_y_in.contiguous();
  // With probs p the output was p * y: dB = s dy^T (p h) and dA = dh^T (p lora_x), while dx (which
  // reads neither h nor lora_x) comes back unscaled, as the schema says.
  const auto row_scale = probs.has_value() ? std::optional<at::Tensor>(probs->unsqueeze(1)) : std::nullopt;
  const bool scale_x = row_scale.has_value() && output_mask[1], scale_h = row_scale.has_value() && output_mask[2];
  const auto lora_x = scale_x ? (lora_x_in * *row_scale).contiguous() : lora_x_in.contiguous();
  const auto weight = weight_in.contiguous();
  const auto lora_a = lora_a_in.contiguous();
  const auto lora_b = lora_b_in.contiguous();
  const auto h = scale_h ? (h_in * *row_scale).contiguous() : h_in.contiguous();
  const auto mask = lora_mask_in.has_value() ? std::optional<at::Tensor>(lora_mask_in->contiguous()) : std::nullopt;

  const auto opts = lora_x.options();
  at::Tensor dx = need_dx ? at::empty({d.T, d.d_in}, opts) : at::Tensor();
  at::Tensor da = need_da ? at::empty({d.E, d.r, d.d_in}, opts) : at::Tensor();
  at::Tensor db = need_db ? at::empty({d.E, d.d_out, d.r}, opts) : at::Tensor();
  if (!need_dx && !need_da && !need_db) return {dx, da, db};
  // dh = s dy B feeds both dA and dx; one [T, r] scratch, each expert's rows written once.
  at::Tensor dh = (need_dx || need_da) ? at::empty({d.T, d.r}, opts) : at::Tensor();

  // With T == 0 the kernels still run: every expert is empty and gets zero dA, dB.
  const auto counts = counts_on_device(tokens_per_expert, lora_x.device());
  auto ws = workspace(d.E, lora_x);
  auto args = dense_bwd_args(d, scaling, dy, lora_x, lora_a, lora_b, h, mask, counts, dx, da, db, dh, ws);
  args.weight = weight.data_ptr();
  C10_CUDA_CHECK(
      cuda::lora_grouped_linear_bwd(args, c10::cuda::getCurrentCUDAStream(lora_x.device().index()).stream()));
  return {dx, da, db};
}

// --- packed (quantised) frozen W ------------------------------------------------------------------

cuda::PackedWeightArgs packed_args(const PackedLayout& l, const at::Tensor& packed, const at::Tensor& scale) {
  cuda::PackedWeightArgs w{};
  w.format = l.format == Format::kMxfp4 ? cuda::PackedFormat::kMxfp4
             : l.format == Format::kInt4 ? cuda::PackedFormat::kInt4
                                         : cuda::PackedFormat::kBlockFp8;
  w.packed = packed.data_ptr();
  w.scale = scale.data_ptr();
  w.scale_dtype = l.format == Format::kInt4 ? to_kernel_dtype(scale.scalar_type()) : cuda::DType::kFloat32;
  w.block_rows = l.block_rows;
  w.block_cols = l.block_cols;
  return w;
}

// Decoded experts held at once: as many as fit in kPackedScratchBytes, at least one (packed_scratch.h).
int64_t scratch_experts(const PackedLayout& l, const at::Tensor& like) {
  return packed_scratch_experts(l.E, l.out * l.in * like.element_size());
}

at::Tensor packed_scratch(const PackedLayout& l, int64_t experts, const at::Tensor& like) {
  return at::empty({experts, l.out, l.in}, like.options());
}

std::tuple<at::Tensor, at::Tensor> lora_grouped_linear_packed_fwd_cuda(
    const at::Tensor& x_in, const at::Tensor& lora_a_in, const at::Tensor& lora_b_in,
    const at::Tensor& tokens_per_expert, double scaling, const std::optional<at::Tensor>& lora_x_in,
    const std::optional<at::Tensor>& probs, const at::Tensor& packed_in, const at::Tensor& scale_in,
    c10::string_view format, at::IntArrayRef block, at::IntArrayRef matrix_shape) {
  const auto l = check_packed(packed_in, scale_in, std::string(format), block, matrix_shape, x_in);
  const auto d = check_forward_inputs(x_in, logical_weight(l, x_in), lora_a_in, lora_b_in, tokens_per_expert,
                                      lora_x_in, probs);
  group_offsets(tokens_per_expert, d.T);
  check_cuda_limits(d);
  at::AutoDispatchBelowADInplaceOrView guard;
  const c10::cuda::CUDAGuard device_guard(x_in.device());

  const auto x = x_in.contiguous();
  const auto lora_a = lora_a_in.contiguous();
  const auto lora_b = lora_b_in.contiguous();
  const auto lora_x = lora_x_in.has_value() ? std::optional<at::Tensor>(lora_x_in->contiguous()) : std::nullopt;
  const auto packed = packed_in.contiguous();
  const auto scale = scale_in.contiguous();
  const auto host_counts = tokens_per_expert.contiguous();
  auto y = at::empty({d.T, d.d_out}, x.options());
  auto h = at::empty({d.T, d.r}, x.options());
  if (d.T == 0) return {y, h};

  const auto counts = counts_on_device(host_counts, x.device());
  auto ws = workspace(d.E, x);
  const int64_t chunk = scratch_experts(l, x);
  auto scratch = packed_scratch(l, chunk, x);
  cuda::LoraPackedFwdArgs args{};
  args.dense = dense_fwd_args(d, scaling, x, lora_x, lora_a, lora_b, counts, y, h, ws);
  args.w = packed_args(l, packed, scale);
  args.host_tokens_per_expert = host_counts.data_ptr<int64_t>();
  args.scratch = scratch.data_ptr();
  args.scratch_experts = chunk;
  C10_CUDA_CHECK(
      cuda::lora_grouped_linear_packed_fwd(args, c10::cuda::getCurrentCUDAStream(x.device().index()).stream()));
  if (probs.has_value()) y.mul_(probs->unsqueeze(1));
  return {y, h};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lora_grouped_linear_packed_bwd_cuda(
    const at::Tensor& grad_y_in, const at::Tensor& lora_x_in, const at::Tensor& lora_a_in,
    const at::Tensor& lora_b_in, const at::Tensor& h_in, const at::Tensor& tokens_per_expert, double scaling,
    const std::optional<at::Tensor>& lora_mask_in, std::array<bool, 3> output_mask,
    const std::optional<at::Tensor>& probs, const at::Tensor& packed_in, const at::Tensor& scale_in,
    c10::string_view format, at::IntArrayRef block, at::IntArrayRef matrix_shape) {
  const auto l = check_packed(packed_in, scale_in, std::string(format), block, matrix_shape, lora_x_in);
  const auto d = check_backward_inputs(grad_y_in, lora_x_in, logical_weight(l, lora_x_in), lora_a_in, lora_b_in,
                                       h_in, tokens_per_expert, lora_mask_in, probs);
  group_offsets(tokens_per_expert, d.T);
  check_cuda_limits(d);
  const bool need_dx = output_mask[0], need_da = output_mask[1], need_db = output_mask[2];
  at::AutoDispatchBelowADInplaceOrView guard;
  const c10::cuda::CUDAGuard device_guard(lora_x_in.device());

  const auto dy = grad_y_in.contiguous();
  // As the dense op: dA, dB for the row-scaled output, dx without the row scale.
  const auto row_scale = probs.has_value() ? std::optional<at::Tensor>(probs->unsqueeze(1)) : std::nullopt;
  const bool scale_x = row_scale.has_value() && need_da, scale_h = row_scale.has_value() && need_db;
  const auto lora_x = scale_x ? (lora_x_in * *row_scale).contiguous() : lora_x_in.contiguous();
  const auto lora_a = lora_a_in.contiguous();
  const auto lora_b = lora_b_in.contiguous();
  const auto h = scale_h ? (h_in * *row_scale).contiguous() : h_in.contiguous();
  const auto mask = lora_mask_in.has_value() ? std::optional<at::Tensor>(lora_mask_in->contiguous()) : std::nullopt;
  const auto packed = packed_in.contiguous();
  const auto scale = scale_in.contiguous();
  const auto host_counts = tokens_per_expert.contiguous();

  const auto opts = lora_x.options();
  at::Tensor dx = need_dx ? at::empty({d.T, d.d_in}, opts) : at::Tensor();
  at::Tensor da = need_da ? at::empty({d.E, d.r, d.d_in}, opts) : at::Tensor();
  at::Tensor db = need_db ? at::empty({d.E, d.d_out, d.r}, opts) : at::Tensor();
  if (!need_dx && !need_da && !need_db) return {dx, da, db};
  at::Tensor dh = (need_dx || need_da) ? at::empty({d.T, d.r}, opts) : at::Tensor();
  // Only dx reads W: without it nothing is decoded.
  const int64_t chunk = scratch_experts(l, lora_x);
  at::Tensor scratch = need_dx && d.T > 0 ? packed_scratch(l, chunk, lora_x) : at::Tensor();

  const auto counts = counts_on_device(host_counts, lora_x.device());
  auto ws = workspace(d.E, lora_x);
  cuda::LoraPackedBwdArgs args{};
  args.dense = dense_bwd_args(d, scaling, dy, lora_x, lora_a, lora_b, h, mask, counts, dx, da, db, dh, ws);
  args.w = packed_args(l, packed, scale);
  args.host_tokens_per_expert = host_counts.data_ptr<int64_t>();
  args.scratch = scratch.defined() ? scratch.data_ptr() : nullptr;
  args.scratch_experts = chunk;
  C10_CUDA_CHECK(cuda::lora_grouped_linear_packed_bwd(
      args, c10::cuda::getCurrentCUDAStream(lora_x.device().index()).stream()));
  return {dx, da, db};
}

}  // namespace

TORCH_LIBRARY_IMPL(slmoe, CUDA, m) {
  m.impl("lora_grouped_linear_fwd", &lora_grouped_linear_fwd_cuda);
  m.impl("lora_grouped_linear_bwd", &lora_grouped_linear_bwd_cuda);
  m.impl("lora_grouped_linear_packed_fwd", &lora_grouped_linear_packed_fwd_cuda);
  m.impl("lora_grouped_linear_packed_bwd", &lora_grouped_linear_packed_bwd_cuda);
}

}  // namespace slmoe
