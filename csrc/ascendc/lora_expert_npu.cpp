// torch_npu impl of the grouped LoRA expert op (schema in csrc/bindings.cpp), registered for the NPU's
// dispatch key (PrivateUse1). Built by setup.py only when CANN is found (SLMOE_BUILD_ASCEND), with the
// host compiler against torch, torch_npu and CANN's headers; the kernels it launches come from
// lora_expert_kernel.cpp through CANN's AscendC toolchain (CMakeLists.txt).
//
// NOT compiled against the real torch_npu / CANN headers or run on an NPU by this project's CI: the
// CI checks this file with the host compiler against torch's headers and stand-ins for the few
// torch_npu / ACL declarations it uses (emu/stubs, .ci/compile_ascendc.sh).
//
// bfloat16 / float16: the same argument checks as the CPU impl (lora_expert_checks.h), tensors made
// contiguous, outputs allocated, the launches planned on the host from tokens_per_expert (a CPU
// tensor in this op's contract) and enqueued on the current NPU stream through torch_npu's task
// queue (OpCommand). float32 runs the CPU impl's per-expert ATen math on the NPU
// (lora_expert_aten.h); float64 is refused (no fp64 matmul on Ascend).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <acl/acl.h>
#include <torch_npu/csrc/core/npu/NPUGuard.h>
#include <torch_npu/csrc/core/npu/NPUStream.h>
#include <torch_npu/csrc/framework/OpCommand.h>

#include <array>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "lora_expert_aten.h"
#include "lora_expert_checks.h"
#include "ascendc/lora_expert_ascend.h"
#include "ascendc/lora_tiling.h"

namespace slmoe {
namespace {

using slmoe_ascend::LaunchPlan;
using TensorTable = std::array<at::Tensor, slmoe_ascend::kNumTensors>;

// The AscendC kernel's dtypes; float32 takes the ATen path, float64 is refused.
bool npu_kernel_dtype(const at::Tensor& t) {
  const auto dt = t.scalar_type();
  TORCH_CHECK_TYPE(dt != at::kDouble,
                   "lora_grouped_linear (NPU): float64 is not supported on Ascend NPUs; use bfloat16, float16 or float32");
  return dt == at::kBFloat16 || dt == at::kHalf;
}

void check_npu_limits(const GroupedDims& d) {
  // GM -> L1 copies take 16-bit row strides on Atlas A2; group sizes and tiles are 32-bit.
  constexpr int64_t kMaxLd = 65535;
  TORCH_CHECK_VALUE(d.d_in <= kMaxLd && d.d_out <= kMaxLd && d.r <= kMaxLd,
                    "lora_grouped_linear (NPU): d_in, d_out and r must be at most 65535, got d_in=", d.d_in,
                    ", d_out=", d.d_out, ", r=", d.r);
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  TORCH_CHECK_VALUE(d.T < kMax32 && d.E < kMax32, "lora_grouped_linear (NPU): T and E must be below 2^31, got T=",
                    d.T, ", E=", d.E);
}

// AI Cores of the device (the launch's block dim); the memory sizes are those of Atlas A2/A3.
slmoe_ascend::HwCaps device_caps(c10::DeviceIndex index) {
  static std::mutex mu;
  static std::map<c10::DeviceIndex, slmoe_ascend::HwCaps> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(index);
  if (it != cache.end()) return it->second;
  int64_t cores = 0;
  const aclError err = aclGetDeviceCapability(static_cast<uint32_t>(index), ACL_DEVICE_INFO_AI_CORE_NUM, &cores);
  TORCH_CHECK(err == ACL_SUCCESS && cores > 0, "lora_grouped_linear (NPU): cannot read the AI Core count of npu:",
              static_cast<int>(index), " (ACL error ", err, ")");
  slmoe_ascend::HwCaps caps;
  caps.numAic = static_cast<uint32_t>(cores);
  return cache.emplace(index, caps).first->second;
}

slmoe_ascend::LoraDims lora_dims(const GroupedDims& d, double scaling) {
  slmoe_ascend::LoraDims dims;
  dims.T = d.T;
  dims.E = d.E;
  dims.d_in = d.d_in;
  dims.d_out = d.d_out;
  dims.r = d.r;
  dims.scaling = scaling;
  return dims;
}

// Enqueues the planned launches, in order, on the current stream of `device`. The tiling bytes go
// through pinned memory (an asynchronous copy); one workspace serves every launch, since they run
// one after another. The handler captures the tensors, so they live until the kernels are enqueued;
// the caching allocator's stream order protects them after that.
void run_launches(const std::vector<LaunchPlan>& plans, const at::Tensor& like, const TensorTable& tensors) {
  const auto dtype = like.scalar_type() == at::kBFloat16 ? slmoe_ascend::DType::kBFloat16
                                                         : slmoe_ascend::DType::kFloat16;
  const at::Device device = like.device();
  uint64_t ws_bytes = 0;
  std::vector<at::Tensor> tilings;
  std::vector<uint32_t> blocks;
  for (const LaunchPlan& plan : plans) {
    if (plan.blockDim == 0) continue;
    ws_bytes = std::max(ws_bytes, plan.workspaceBytes);
    // Pinned staging makes the copy to the device asynchronous (and is only possible for one).
    auto host = at::empty({static_cast<int64_t>(plan.tiling.size())},
                          at::TensorOptions().dtype(at::kByte).pinned_memory(device.type() != at::kCPU));
    std::memcpy(host.data_ptr(), plan.tiling.data(), plan.tiling.size());
    tilings.push_back(host.to(device, /*non_blocking=*/true));
    blocks.push_back(plan.blockDim);
  }
  if (blocks.empty()) return;
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(std::max<uint64_t>(ws_bytes, 1))}, like.options().dtype(at::kByte));
  const auto stream = c10_npu::getCurrentNPUStream(device.index());
  at_npu::native::OpCommand cmd;
  cmd.Name("SlmoeLoraGroupedGemm");
  cmd.SetCustomHandler([dtype, stream, tensors, workspace, tilings, blocks]() -> int {
    void* ptrs[slmoe_ascend::kNumTensors];
    for (size_t i = 0; i < tensors.size(); ++i) ptrs[i] = tensors[i].defined() ? tensors[i].data_ptr() : nullptr;
    for (size_t i = 0; i < blocks.size(); ++i) {
      slmoe_ascend::launch_lora_grouped_gemm(dtype, blocks[i], stream.stream(false), ptrs, workspace.data_ptr(),
                                             tilings[i].data_ptr());
    }
    return 0;
  });
  cmd.Run();
}

// float32: the CPU impl's per-expert ATen math, expert after expert, on the NPU.
constexpr auto kSerialExperts = [](const std::vector<int64_t>& offsets, int64_t, const auto& fn) {
  for (size_t e = 0; e + 1 < offsets.size(); ++e) fn(static_cast<int64_t>(e));
};

std::tuple<at::Tensor, at::Tensor> lora_grouped_linear_fwd_npu(const at::Tensor& x_in, const at::Tensor& weight_in,
                                                               const at::Tensor& lora_a_in,
                                                               const at::Tensor& lora_b_in,
                                                               const at::Tensor& tokens_per_expert, double scaling,
                                                               const std::optional<at::Tensor>& lora_x_in,
                                                               const std::optional<at::Tensor>& probs) {
  const auto d = check_forward_inputs(x_in, weight_in, lora_a_in, lora_b_in, tokens_per_expert, lora_x_in, probs);
  const auto offsets = group_offsets(tokens_per_expert, d.T);
  const c10_npu::OptionalNPUGuard device_guard(x_in.device());
  if (!npu_kernel_dtype(x_in)) {
    return lora_grouped_linear_fwd_aten(d, offsets, x_in, weight_in, lora_a_in, lora_b_in, scaling, lora_x_in,
                                        probs, kSerialExperts);
  }
  check_npu_limits(d);
  at::AutoDispatchBelowADInplaceOrView guard;
  TensorTable t;
  t[slmoe_ascend::kTensorX] = x_in.contiguous();
  t[slmoe_ascend::kTensorLoraX] = lora_x_in.has_value() ? lora_x_in->contiguous() : t[slmoe_ascend::kTensorX];
  t[slmoe_ascend::kTensorWeight] = weight_in.contiguous();
  t[slmoe_ascend::kTensorLoraA] = lora_a_in.contiguous();
  t[slmoe_ascend::kTensorLoraB] = lora_b_in.contiguous();
  const auto& x = t[slmoe_ascend::kTensorX];
  auto y = at::empty({d.T, d.d_out}, x.options());
  auto h = at::empty({d.T, d.r}, x.options());
  t[slmoe_ascend::kTensorY] = y;
  t[slmoe_ascend::kTensorH] = h;
  const auto counts = tokens_per_expert.contiguous();
  run_launches(slmoe_ascend::plan_forward(lora_dims(d, scaling), counts.data_ptr<int64_t>(),
                                          device_caps(x.device().index())),
               x, t);
  // The row scale as a separate pass (the kernel's epilogue does not take one yet).
  if (probs.has_value()) y.mul_(probs->unsqueeze(1));
  return {y, h};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lora_grouped_linear_bwd_npu(
    const at::Tensor& grad_y_in, const at::Tensor& lora_x_in, const at::Tensor& weight_in,
    const at::Tensor& lora_a_in, const at::Tensor& lora_b_in, const at::Tensor& h_in,
    const at::Tensor& tokens_per_expert, double scaling, const std::optional<at::Tensor>& lora_mask_in,
    std::array<bool, 3> output_mask, const std::optional<at::Tensor>& probs) {
  const auto d = check_backward_inputs(grad_y_in, lora_x_in, weight_in, lora_a_in, lora_b_in, h_in,
                                       tokens_per_expert, lora_mask_in, probs);
  const auto offsets = group_offsets(tokens_per_expert, d.T);
  const c10_npu::OptionalNPUGuard device_guard(lora_x_in.device());
  if (!npu_kernel_dtype(lora_x_in)) {
    return lora_grouped_linear_bwd_aten(d, offsets, grad_y_in, lora_x_in, weight_in, lora_a_in, lora_b_in, h_in,
                                        scaling, lora_mask_in, output_mask, probs, kSerialExperts);
  }
  check_npu_limits(d);
  const bool need_dx = output_mask[0], need_da = output_mask[1], need_db = output_mask[2];
  at::AutoDispatchBelowADInplaceOrView guard;
  TensorTable t;
  // With probs p the output was p * y: dB = s dy^T (p h) and dA = dh^T (p lora_x), while dx (which
  // reads neither h nor lora_x) comes back unscaled, as the schema says.
  const auto row_scale = probs.has_value() ? std::optional<at::Tensor>(probs->unsqueeze(1)) : std::nullopt;
  const bool scale_x = row_scale.has_value() && need_da, scale_h = row_scale.has_value() && need_db;
  t[slmoe_ascend::kTensorGradY] = grad_y_in.contiguous();
  t[slmoe_ascend::kTensorLoraX] = scale_x ? (lora_x_in * *row_scale).contiguous() : lora_x_in.contiguous();
  t[slmoe_ascend::kTensorWeight] = weight_in.contiguous();
  t[slmoe_ascend::kTensorLoraA] = lora_a_in.contiguous();
  t[slmoe_ascend::kTensorLoraB] = lora_b_in.contiguous();
  t[slmoe_ascend::kTensorH] = scale_h ? (h_in * *row_scale).contiguous() : h_in.contiguous();
  if (lora_mask_in.has_value()) t[slmoe_ascend::kTensorMask] = lora_mask_in->contiguous();
  const auto opts = t[slmoe_ascend::kTensorLoraX].options();
  at::Tensor dx = need_dx ? at::empty({d.T, d.d_in}, opts) : at::Tensor();
  at::Tensor da = need_da ? at::empty({d.E, d.r, d.d_in}, opts) : at::Tensor();
  at::Tensor db = need_db ? at::empty({d.E, d.d_out, d.r}, opts) : at::Tensor();
  if (!need_dx && !need_da && !need_db) return {dx, da, db};
  t[slmoe_ascend::kTensorDx] = dx;
  t[slmoe_ascend::kTensorDa] = da;
  t[slmoe_ascend::kTensorDb] = db;
  // dh = s dy B feeds both dA and dx: one [T, r] scratch, written by the first launch.
  if (need_dx || need_da) t[slmoe_ascend::kTensorDh] = at::empty({d.T, d.r}, opts);
  const auto counts = tokens_per_expert.contiguous();
  // With T == 0 the launches still run: every expert is empty and gets zero dA, dB.
  run_launches(slmoe_ascend::plan_backward(lora_dims(d, scaling), counts.data_ptr<int64_t>(), lora_mask_in.has_value(),
                                           need_dx, need_da, need_db, device_caps(lora_x_in.device().index())),
               t[slmoe_ascend::kTensorLoraX], t);
  return {dx, da, db};
}

}  // namespace

TORCH_LIBRARY_IMPL(slmoe, PrivateUse1, m) {
  m.impl("lora_grouped_linear_fwd", &lora_grouped_linear_fwd_npu);
  m.impl("lora_grouped_linear_bwd", &lora_grouped_linear_bwd_npu);
}

}  // namespace slmoe
