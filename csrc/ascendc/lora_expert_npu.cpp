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
//
// The packed ops (a quantised frozen W: MXFP4, INT4, block FP8; csrc/lora_expert_packed.h) run, for
// bfloat16 / float16, packed_tiling.h's plan: per chunk of experts (as many as fit in
// kPackedScratchBytes, csrc/packed_scratch.h, as on CUDA) the vector-unit decode
// (packed_decode_kernel.cpp) into one scratch, then the dense kernel on the chunk's rows with the
// scratch as W; the backward decodes again, for dx only. float32 decodes each expert with ATen ops
// into one tile, rows of about 2^18 values at a time (the pure-torch twin's decode_into), under the
// ATen math.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <acl/acl.h>
#include <torch_npu/csrc/core/npu/NPUGuard.h>
#include <torch_npu/csrc/core/npu/NPUStream.h>
#include <torch_npu/csrc/framework/OpCommand.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "lora_expert_aten.h"
#include "lora_expert_checks.h"
#include "lora_expert_packed.h"
#include "packed_scratch.h"
#include "ascendc/lora_expert_ascend.h"
#include "ascendc/lora_tiling.h"
#include "ascendc/packed_tiling.h"

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

slmoe_ascend::DType kernel_dtype(const at::Tensor& like) {
  return like.scalar_type() == at::kBFloat16 ? slmoe_ascend::DType::kBFloat16 : slmoe_ascend::DType::kFloat16;
}

// A plan's tiling bytes on `device`, through pinned memory (an asynchronous copy; only possible for
// a device).
at::Tensor stage_tiling(const std::vector<uint8_t>& bytes, const at::Device& device) {
  auto host = at::empty({static_cast<int64_t>(bytes.size())},
                        at::TensorOptions().dtype(at::kByte).pinned_memory(device.type() != at::kCPU));
  std::memcpy(host.data_ptr(), bytes.data(), bytes.size());
  return host.to(device, /*non_blocking=*/true);
}

// Enqueues the planned launches, in order, on the current stream of `device`. The tiling bytes go
// through pinned memory (an asynchronous copy); one workspace serves every launch, since they run
// one after another. The handler captures the tensors, so they live until the kernels are enqueued;
// the caching allocator's stream order protects them after that.
void run_launches(const std::vector<LaunchPlan>& plans, const at::Tensor& like, const TensorTable& tensors) {
  const auto dtype = kernel_dtype(like);
  const at::Device device = like.device();
  uint64_t ws_bytes = 0;
  std::vector<at::Tensor> tilings;
  std::vector<uint32_t> blocks;
  for (const LaunchPlan& plan : plans) {
    if (plan.blockDim == 0) continue;
    ws_bytes = std::max(ws_bytes, plan.workspaceBytes);
    tilings.push_back(stage_tiling(plan.tiling, device));
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

// --- packed (quantised) frozen W ------------------------------------------------------------------

// The chunking a packed call runs with: 0 experts means packed_scratch_experts' (kPackedScratchBytes,
// as on CUDA). The registered ops take the defaults; csrc/ascendc/emu/npu_binding_test.cpp passes
// small ones so its few tiny experts still span several chunks and decode segments.
struct PackedLimits {
  int64_t scratch_experts = 0;
  uint32_t max_width = slmoe_ascend::kPackedMaxWidth;
};

slmoe_ascend::PackedWeightDesc packed_desc(const PackedLayout& l, const at::Tensor& scale) {
  slmoe_ascend::PackedWeightDesc w;
  w.format = l.format == Format::kMxfp4 ? slmoe_ascend::kPackedMxfp4
             : l.format == Format::kInt4 ? slmoe_ascend::kPackedInt4
                                         : slmoe_ascend::kPackedBlockFp8;
  const auto st = scale.scalar_type();
  w.scaleType = l.format != Format::kInt4 ? slmoe_ascend::kScaleF32
                : st == at::kBFloat16     ? slmoe_ascend::kScaleBf16
                : st == at::kHalf         ? slmoe_ascend::kScaleF16
                                          : slmoe_ascend::kScaleF32;
  w.blockRows = static_cast<uint32_t>(l.block_rows);
  w.blockCols = static_cast<uint32_t>(l.block_cols);
  return w;
}

int64_t scratch_experts(const PackedLayout& l, const at::Tensor& like, const PackedLimits& limits) {
  if (limits.scratch_experts > 0) return std::min(limits.scratch_experts, std::max<int64_t>(l.E, 1));
  return packed_scratch_experts(l.E, l.out * l.in * like.element_size());
}

// Enqueues the packed plan's launches on the current stream, in order, through one OpCommand: per
// chunk, its decode into `scratch`, then its dense launches on the chunk's rows and experts with the
// scratch as W. One workspace serves every dense launch (they run one after another); the handler
// holds every tensor until the launches are enqueued, as run_launches.
void run_packed_steps(const std::vector<slmoe_ascend::PackedStep>& steps, const at::Tensor& like,
                      const TensorTable& full, const at::Tensor& packed, const at::Tensor& scale,
                      const at::Tensor& scratch) {
  struct Launch {
    bool decode;
    uint32_t blockDim;
    size_t table, tiling;
  };
  const auto dtype = kernel_dtype(like);
  const at::Device device = like.device();
  uint64_t ws_bytes = 0;
  std::vector<TensorTable> tables;
  std::vector<at::Tensor> tilings;
  std::vector<Launch> launches;
  for (const auto& s : steps) {
    // The chunk's views: rows [row0, row0 + rows) of the row tensors, its experts of the per-expert
    // ones, the scratch's first experts as W (undefined where nothing is decoded).
    TensorTable t;
    for (size_t i = 0; i < t.size(); ++i) {
      if (!full[i].defined()) continue;
      const bool per_expert = i == slmoe_ascend::kTensorLoraA || i == slmoe_ascend::kTensorLoraB ||
                              i == slmoe_ascend::kTensorDa || i == slmoe_ascend::kTensorDb;
      t[i] = per_expert ? full[i].narrow(0, s.e0, s.experts) : full[i].narrow(0, s.row0, s.rows);
    }
    t[slmoe_ascend::kTensorWeight] = scratch.defined() ? scratch.narrow(0, 0, s.experts) : at::Tensor();
    tables.push_back(t);
    if (s.decode.blockDim > 0) {
      TORCH_CHECK(scratch.defined(), "lora_grouped_linear_packed (NPU): a decode planned without a scratch");
      tilings.push_back(stage_tiling(s.decode.tiling, device));
      launches.push_back({true, s.decode.blockDim, tables.size() - 1, tilings.size() - 1});
    }
    for (const LaunchPlan& plan : s.dense) {
      if (plan.blockDim == 0) continue;
      ws_bytes = std::max(ws_bytes, plan.workspaceBytes);
      tilings.push_back(stage_tiling(plan.tiling, device));
      launches.push_back({false, plan.blockDim, tables.size() - 1, tilings.size() - 1});
    }
  }
  if (launches.empty()) return;
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(std::max<uint64_t>(ws_bytes, 1))}, like.options().dtype(at::kByte));
  const auto stream = c10_npu::getCurrentNPUStream(device.index());
  at_npu::native::OpCommand cmd;
  cmd.Name("SlmoeLoraGroupedGemmPacked");
  cmd.SetCustomHandler([dtype, stream, tables, tilings, launches, packed, scale, workspace]() -> int {
    for (const Launch& launch : launches) {
      const TensorTable& t = tables[launch.table];
      if (launch.decode) {
        slmoe_ascend::launch_packed_decode(dtype, launch.blockDim, stream.stream(false), packed.data_ptr(),
                                           scale.data_ptr(), t[slmoe_ascend::kTensorWeight].data_ptr(),
                                           tilings[launch.tiling].data_ptr());
        continue;
      }
      void* ptrs[slmoe_ascend::kNumTensors];
      for (size_t i = 0; i < t.size(); ++i) ptrs[i] = t[i].defined() ? t[i].data_ptr() : nullptr;
      slmoe_ascend::launch_lora_grouped_gemm(dtype, launch.blockDim, stream.stream(false), ptrs,
                                             workspace.data_ptr(), tilings[launch.tiling].data_ptr());
    }
    return 0;
  });
  cmd.Run();
}

at::Tensor scratch_for(const std::vector<slmoe_ascend::PackedStep>& steps, const PackedLayout& l, int64_t experts,
                       const at::Tensor& like) {
  for (const auto& s : steps) {
    if (s.decode.blockDim > 0) return at::empty({experts, l.out, l.in}, like.options());
  }
  return at::Tensor();  // nothing to decode: no rows, or a backward without dx
}

void check_plan(const std::string& err) {
  TORCH_CHECK_VALUE(err.empty(), "lora_grouped_linear_packed (NPU): ", err);
}

// float32 (no AscendC decode for it): expert e's W into one [out, in] tile with ATen ops on the
// device, rows of about 2^18 values at a time (whole scale blocks), so the intermediates stay a
// step's, as the pure-torch twin's PackedWeight.decode_into; value for value as
// megatron_slmoe/ops/quantized_weights.py (csrc/lora_expert_packed.h).
class AtenDecodedTile {
 public:
  AtenDecodedTile(const PackedLayout& l, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& like)
      : l_(l), packed_(packed.contiguous()), scale_(scale.contiguous()),
        tile_(at::empty({l.out, l.in}, like.options())) {
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    if (l.format == Format::kMxfp4) {
      std::vector<float> e2m1(16), e8m0(256);
      const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
      for (int c = 0; c < 16; ++c) e2m1[c] = (c & 8) ? -mag[c & 7] : mag[c & 7];
      for (int s = 0; s < 256; ++s) {
        e8m0[s] = s == 255 ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, s - 127);
      }
      e2m1_ = at::tensor(e2m1, f32).to(like.device());
      e8m0_ = at::tensor(e8m0, f32).to(like.device());
    } else if (l.format == Format::kInt4) {
      shifts_ = at::arange(0, 32, 4, at::TensorOptions().dtype(at::kInt).device(like.device()));
    }
  }

  at::Tensor operator()(int64_t e) const {
    const int64_t br = l_.block_rows;
    const int64_t step = std::min(l_.out, std::max(br, (int64_t{1} << 18) / l_.in / br * br));
    for (int64_t r0 = 0; r0 < l_.out; r0 += step) {
      const int64_t n = std::min(step, l_.out - r0);
      tile_.narrow(0, r0, n).copy_(decode_rows(e, r0, n));
    }
    return tile_;
  }

 private:
  at::Tensor decode_rows(int64_t e, int64_t r0, int64_t n) const {
    const auto p = packed_[e].narrow(0, r0, n);
    if (l_.format == Format::kMxfp4) {
      const auto codes =
          at::stack({p.bitwise_and(0xF), p.bitwise_right_shift(4)}, -1).flatten(-2).to(at::kLong);
      const auto factors = at::take(e8m0_, scale_[e].narrow(0, r0, n).to(at::kLong));
      return (at::take(e2m1_, codes).unflatten(-1, {-1, 32}) * factors.unsqueeze(-1)).flatten(-2);
    }
    if (l_.format == Format::kInt4) {
      // Arithmetic shifts, then masked: sign-safe.
      const auto q =
          (p.unsqueeze(-1).bitwise_right_shift(shifts_).bitwise_and(0xF).flatten(-2) - 8).to(at::kChar);
      const auto s = scale_[e].narrow(0, r0, n);
      return (q.unflatten(-1, {-1, l_.block_cols}).to(s.scalar_type()) * s.unsqueeze(-1)).flatten(-2);
    }
    const int64_t br = l_.block_rows;
    const auto s = scale_[e].narrow(0, r0 / br, (n + br - 1) / br);  // r0: a multiple of br
    const auto factors =
        s.repeat_interleave(br, 0).narrow(0, 0, n).repeat_interleave(l_.block_cols, 1).narrow(1, 0, l_.in);
    return p.to(at::kFloat) * factors;
  }

  PackedLayout l_;
  at::Tensor packed_, scale_, e2m1_, e8m0_, shifts_;
  at::Tensor tile_;
};

std::tuple<at::Tensor, at::Tensor> packed_fwd_npu(const at::Tensor& x_in, const at::Tensor& lora_a_in,
                                                  const at::Tensor& lora_b_in, const at::Tensor& tokens_per_expert,
                                                  double scaling, const std::optional<at::Tensor>& lora_x_in,
                                                  const std::optional<at::Tensor>& probs, const at::Tensor& packed_in,
                                                  const at::Tensor& scale_in, c10::string_view format,
                                                  at::IntArrayRef block, at::IntArrayRef matrix_shape,
                                                  const PackedLimits& limits) {
  const auto l = check_packed(packed_in, scale_in, std::string(format), block, matrix_shape, x_in);
  const auto d = check_forward_inputs(x_in, logical_weight(l, x_in), lora_a_in, lora_b_in, tokens_per_expert,
                                      lora_x_in, probs);
  const auto offsets = group_offsets(tokens_per_expert, d.T);
  const c10_npu::OptionalNPUGuard device_guard(x_in.device());
  if (!npu_kernel_dtype(x_in)) {
    return lora_grouped_linear_fwd_aten_tiles(d, offsets, x_in, AtenDecodedTile(l, packed_in, scale_in, x_in),
                                              lora_a_in, lora_b_in, scaling, lora_x_in, probs, kSerialExperts);
  }
  check_npu_limits(d);
  at::AutoDispatchBelowADInplaceOrView guard;
  TensorTable t;
  t[slmoe_ascend::kTensorX] = x_in.contiguous();
  t[slmoe_ascend::kTensorLoraX] = lora_x_in.has_value() ? lora_x_in->contiguous() : t[slmoe_ascend::kTensorX];
  t[slmoe_ascend::kTensorLoraA] = lora_a_in.contiguous();
  t[slmoe_ascend::kTensorLoraB] = lora_b_in.contiguous();
  const auto& x = t[slmoe_ascend::kTensorX];
  auto y = at::empty({d.T, d.d_out}, x.options());
  auto h = at::empty({d.T, d.r}, x.options());
  t[slmoe_ascend::kTensorY] = y;
  t[slmoe_ascend::kTensorH] = h;
  const auto counts = tokens_per_expert.contiguous();
  const int64_t chunk = scratch_experts(l, x, limits);
  std::vector<slmoe_ascend::PackedStep> steps;
  check_plan(slmoe_ascend::plan_packed_forward(lora_dims(d, scaling), counts.data_ptr<int64_t>(),
                                               packed_desc(l, scale_in), chunk, device_caps(x.device().index()),
                                               limits.max_width, &steps));
  run_packed_steps(steps, x, t, packed_in.contiguous(), scale_in.contiguous(), scratch_for(steps, l, chunk, x));
  if (probs.has_value()) y.mul_(probs->unsqueeze(1));  // as the dense op
  return {y, h};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> packed_bwd_npu(
    const at::Tensor& grad_y_in, const at::Tensor& lora_x_in, const at::Tensor& lora_a_in,
    const at::Tensor& lora_b_in, const at::Tensor& h_in, const at::Tensor& tokens_per_expert, double scaling,
    const std::optional<at::Tensor>& lora_mask_in, std::array<bool, 3> output_mask,
    const std::optional<at::Tensor>& probs, const at::Tensor& packed_in, const at::Tensor& scale_in,
    c10::string_view format, at::IntArrayRef block, at::IntArrayRef matrix_shape, const PackedLimits& limits) {
  const auto l = check_packed(packed_in, scale_in, std::string(format), block, matrix_shape, lora_x_in);
  const auto d = check_backward_inputs(grad_y_in, lora_x_in, logical_weight(l, lora_x_in), lora_a_in, lora_b_in,
                                       h_in, tokens_per_expert, lora_mask_in, probs);
  const auto offsets = group_offsets(tokens_per_expert, d.T);
  const c10_npu::OptionalNPUGuard device_guard(lora_x_in.device());
  if (!npu_kernel_dtype(lora_x_in)) {
    return lora_grouped_linear_bwd_aten_tiles(d, offsets, grad_y_in, lora_x_in,
                                              AtenDecodedTile(l, packed_in, scale_in, lora_x_in), lora_a_in,
                                              lora_b_in, h_in, scaling, lora_mask_in, output_mask, probs,
                                              kSerialExperts);
  }
  check_npu_limits(d);
  const bool need_dx = output_mask[0], need_da = output_mask[1], need_db = output_mask[2];
  at::AutoDispatchBelowADInplaceOrView guard;
  TensorTable t;
  // As the dense op: dA, dB for the row-scaled output, dx without the row scale.
  const auto row_scale = probs.has_value() ? std::optional<at::Tensor>(probs->unsqueeze(1)) : std::nullopt;
  const bool scale_x = row_scale.has_value() && need_da, scale_h = row_scale.has_value() && need_db;
  t[slmoe_ascend::kTensorGradY] = grad_y_in.contiguous();
  t[slmoe_ascend::kTensorLoraX] = scale_x ? (lora_x_in * *row_scale).contiguous() : lora_x_in.contiguous();
  t[slmoe_ascend::kTensorLoraA] = lora_a_in.contiguous();
  t[slmoe_ascend::kTensorLoraB] = lora_b_in.contiguous();
  t[slmoe_ascend::kTensorH] = scale_h ? (h_in * *row_scale).contiguous() : h_in.contiguous();
  if (lora_mask_in.has_value()) t[slmoe_ascend::kTensorMask] = lora_mask_in->contiguous();
  const auto& like = t[slmoe_ascend::kTensorLoraX];
  const auto opts = like.options();
  at::Tensor dx = need_dx ? at::empty({d.T, d.d_in}, opts) : at::Tensor();
  at::Tensor da = need_da ? at::empty({d.E, d.r, d.d_in}, opts) : at::Tensor();
  at::Tensor db = need_db ? at::empty({d.E, d.d_out, d.r}, opts) : at::Tensor();
  if (!need_dx && !need_da && !need_db) return {dx, da, db};
  t[slmoe_ascend::kTensorDx] = dx;
  t[slmoe_ascend::kTensorDa] = da;
  t[slmoe_ascend::kTensorDb] = db;
  if (need_dx || need_da) t[slmoe_ascend::kTensorDh] = at::empty({d.T, d.r}, opts);
  const auto counts = tokens_per_expert.contiguous();
  const int64_t chunk = scratch_experts(l, like, limits);
  std::vector<slmoe_ascend::PackedStep> steps;
  // Every chunk runs (experts without rows get zero dA, dB); only dx reads W, so only it decodes.
  check_plan(slmoe_ascend::plan_packed_backward(lora_dims(d, scaling), counts.data_ptr<int64_t>(),
                                                packed_desc(l, scale_in), chunk, lora_mask_in.has_value(), need_dx,
                                                need_da, need_db, device_caps(like.device().index()),
                                                limits.max_width, &steps));
  run_packed_steps(steps, like, t, packed_in.contiguous(), scale_in.contiguous(),
                   scratch_for(steps, l, chunk, like));
  return {dx, da, db};
}

std::tuple<at::Tensor, at::Tensor> lora_grouped_linear_packed_fwd_npu(
    const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b, const at::Tensor& tokens_per_expert,
    double scaling, const std::optional<at::Tensor>& lora_x, const std::optional<at::Tensor>& probs,
    const at::Tensor& packed, const at::Tensor& scale, c10::string_view format, at::IntArrayRef block,
    at::IntArrayRef matrix_shape) {
  return packed_fwd_npu(x, lora_a, lora_b, tokens_per_expert, scaling, lora_x, probs, packed, scale, format, block,
                        matrix_shape, PackedLimits());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lora_grouped_linear_packed_bwd_npu(
    const at::Tensor& grad_y, const at::Tensor& lora_x, const at::Tensor& lora_a, const at::Tensor& lora_b,
    const at::Tensor& h, const at::Tensor& tokens_per_expert, double scaling,
    const std::optional<at::Tensor>& lora_mask, std::array<bool, 3> output_mask,
    const std::optional<at::Tensor>& probs, const at::Tensor& packed, const at::Tensor& scale,
    c10::string_view format, at::IntArrayRef block, at::IntArrayRef matrix_shape) {
  return packed_bwd_npu(grad_y, lora_x, lora_a, lora_b, h, tokens_per_expert, scaling, lora_mask, output_mask, probs,
                        packed, scale, format, block, matrix_shape, PackedLimits());
}

}  // namespace

TORCH_LIBRARY_IMPL(slmoe, PrivateUse1, m) {
  m.impl("lora_grouped_linear_fwd", &lora_grouped_linear_fwd_npu);
  m.impl("lora_grouped_linear_bwd", &lora_grouped_linear_bwd_npu);
  m.impl("lora_grouped_linear_packed_fwd", &lora_grouped_linear_packed_fwd_npu);
  m.impl("lora_grouped_linear_packed_bwd", &lora_grouped_linear_packed_bwd_npu);
}

}  // namespace slmoe
