// C entry points of the emulated AscendC packed path, for packed_oracle.py (ctypes), with the
// signatures of csrc/cuda/emu/packed_shim.cpp so one oracle drives both emulators: host pointers
// (the emulation's "device" memory), dtype codes of slmoe::cuda::DType (0 fp32, 1 fp64, 2 bf16,
// 3 fp16), formats of PackedFormat. Runs the plans of ../packed_tiling.h (decode, then the dense
// launches per chunk of experts) the way a binding would. Returns 0, or 1 with the planner's refusal
// on stderr. `workspace` (the CUDA launchers' counters) is unused here.
//
// Decode segments are at most kShimMaxWidth columns (or one scale block where blocks are wider), so
// the oracle's rows (30 to 256 inputs) are cut into several segments as 7168-wide rows are at
// kPackedMaxWidth.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <cstdio>
#include <vector>

#include "../lora_expert_ascend.h"
#include "../packed_tiling.h"
#include "kernel_operator.h"

namespace {

using namespace slmoe_ascend;

constexpr uint32_t kShimMaxWidth = 64;

uint32_t max_width(int64_t block_cols) {
  return std::max<uint32_t>(kShimMaxWidth, std::lcm<uint32_t>(32, static_cast<uint32_t>(block_cols)));
}

HwCaps caps() {
  HwCaps c;
  c.numAic = 3;  // few cores: several tiles and segments per core
  return c;
}

bool dtype_of(int code, DType* t) {
  if (code != 2 && code != 3) return false;  // the kernels run bf16 and fp16
  *t = code == 2 ? DType::kBFloat16 : DType::kFloat16;
  return true;
}

PackedWeightDesc weight_desc(int format, int scale_dtype, int64_t block_rows, int64_t block_cols) {
  PackedWeightDesc w;
  w.format = static_cast<PackedFormat>(format);
  w.scaleType = scale_dtype == 2 ? kScaleBf16 : scale_dtype == 3 ? kScaleF16 : kScaleF32;
  w.blockRows = static_cast<uint32_t>(block_rows);
  w.blockCols = static_cast<uint32_t>(block_cols);
  return w;
}

template <typename P>
P* advance(P* p, int64_t elems) {
  using B = typename std::conditional<std::is_const<P>::value, const uint8_t, uint8_t>::type;
  return p == nullptr ? nullptr : reinterpret_cast<P*>(reinterpret_cast<B*>(p) + elems * 2);
}

void run_decode(const DecodePlan& plan, DType dtype, const void* packed, const void* scale, void* scratch,
                size_t scratch_bytes) {
  if (plan.blockDim == 0) return;
  std::vector<uint8_t> tiling = plan.tiling;
  slmoe_emu::gm_clear();
  slmoe_emu::gm_register(scratch, scratch_bytes, true, "scratch");
  slmoe_emu::gm_register(tiling.data(), tiling.size(), false, "tiling");
  launch_packed_decode(dtype, plan.blockDim, nullptr, packed, scale, scratch, tiling.data());
  slmoe_emu::gm_clear();
}

// The launches of one dense plan list; outputs registered writable (race-checked), inputs read unchecked.
void run_dense(const std::vector<LaunchPlan>& plans, DType dtype, void* const tensors[kNumTensors],
               const size_t bytes[kNumTensors]) {
  for (const auto& plan : plans) {
    if (plan.blockDim == 0) continue;
    const KernelTiling& h = tiling_header(plan);
    std::vector<uint8_t> tiling = plan.tiling;
    std::vector<float> ws(plan.workspaceBytes / sizeof(float), std::nanf(""));
    slmoe_emu::gm_clear();
    for (uint32_t p = 0; p < h.numProblems; ++p) {
      const uint32_t c = h.problems[p].c.tensor;
      slmoe_emu::gm_register(tensors[c], bytes[c], true, "output");
    }
    slmoe_emu::gm_register(ws.data(), ws.size() * sizeof(float), true, "workspace");
    slmoe_emu::gm_register(tiling.data(), tiling.size(), false, "tiling");
    launch_lora_grouped_gemm(dtype, plan.blockDim, nullptr, tensors, ws.data(), tiling.data());
  }
  slmoe_emu::gm_clear();
}

LoraDims dims(int64_t T, int64_t E, int64_t d_in, int64_t d_out, int64_t r, double scaling) {
  LoraDims d;
  d.T = T, d.E = E, d.d_in = d_in, d.d_out = d_out, d.r = r, d.scaling = scaling;
  return d;
}

// The tensors of one chunk: rows from row0, experts from e0 (dense: row0 = e0 = 0, all of them).
struct Call {
  int64_t d_in, d_out, r;
  void* t[kNumTensors] = {};
  void chunk(int64_t row0, int64_t e0, int64_t rows, int64_t experts, void* out[kNumTensors], size_t bytes[kNumTensors]) const {
    const int64_t row_elems[kNumTensors] = {d_in, d_in, 0, 0, 0, d_out, d_in, r, r, d_out, d_in, 0, 0};
    const int64_t expert_elems[kNumTensors] = {0, 0, d_out * d_in, r * d_in, d_out * r, 0, 0, 0, 0, 0, 0, r * d_in, d_out * r};
    for (uint32_t i = 0; i < kNumTensors; ++i) {
      out[i] = advance(t[i], row0 * row_elems[i] + e0 * expert_elems[i]);
      bytes[i] = static_cast<size_t>((rows * row_elems[i] + experts * expert_elems[i]) * 2);
    }
  }
};

int run_packed(const std::vector<PackedStep>& steps, DType dtype, const Call& call, const void* packed,
               const void* scale, void* scratch) {
  for (const PackedStep& s : steps) {
    void* t[kNumTensors];
    size_t bytes[kNumTensors];
    call.chunk(s.row0, s.e0, s.rows, s.experts, t, bytes);
    t[kTensorWeight] = scratch;
    bytes[kTensorWeight] = static_cast<size_t>(s.experts * call.d_out * call.d_in * 2);
    run_decode(s.decode, dtype, packed, scale, scratch, bytes[kTensorWeight]);
    run_dense(s.dense, dtype, t, bytes);
  }
  return 0;
}

int refuse(const std::string& why) {
  std::fprintf(stderr, "packed_shim: %s\n", why.c_str());
  return 1;
}

}  // namespace

extern "C" {

void slmoe_emu_set_mutation(int n) { slmoe_emu::set_mutation(n); }

int slmoe_emu_decode(int format, const void* packed, const void* scale, int scale_dtype, int64_t block_rows,
                     int64_t block_cols, int dtype, int64_t d_out, int64_t d_in, int64_t e0, int64_t n,
                     const int64_t* counts, void* scratch) {
  DType t;
  if (!dtype_of(dtype, &t)) return refuse("dtype must be bf16 or fp16");
  slmoe_emu::gm_allow_unregistered(true);
  DecodePlan plan;
  const std::string err = plan_decode(weight_desc(format, scale_dtype, block_rows, block_cols), d_out, d_in, e0, n,
                                      counts, caps(), max_width(block_cols), &plan);
  if (!err.empty()) return refuse(err);
  run_decode(plan, t, packed, scale, scratch, static_cast<size_t>(n * d_out * d_in * 2));
  return 0;
}

// packed == nullptr: the dense launches with `weight`; else the packed plan.
int slmoe_emu_fwd(int dtype, int64_t T, int64_t E, int64_t d_in, int64_t d_out, int64_t r, double scaling,
                  const void* x, const void* lora_x, const void* weight, const void* lora_a, const void* lora_b,
                  const int64_t* counts, void* y, void* h, int32_t* workspace, int format, const void* packed,
                  const void* scale, int scale_dtype, int64_t block_rows, int64_t block_cols, void* scratch,
                  int64_t scratch_experts) {
  (void)workspace;
  DType t;
  if (!dtype_of(dtype, &t)) return refuse("dtype must be bf16 or fp16");
  slmoe_emu::gm_allow_unregistered(true);
  Call call{d_in, d_out, r};
  call.t[kTensorX] = const_cast<void*>(x);
  call.t[kTensorLoraX] = const_cast<void*>(lora_x != nullptr ? lora_x : x);
  call.t[kTensorWeight] = const_cast<void*>(weight);
  call.t[kTensorLoraA] = const_cast<void*>(lora_a);
  call.t[kTensorLoraB] = const_cast<void*>(lora_b);
  call.t[kTensorY] = y;
  call.t[kTensorH] = h;
  const LoraDims d = dims(T, E, d_in, d_out, r, scaling);
  if (packed == nullptr) {
    void* tt[kNumTensors];
    size_t bytes[kNumTensors];
    call.chunk(0, 0, T, E, tt, bytes);
    run_dense(plan_forward(d, counts, caps()), t, tt, bytes);
    return 0;
  }
  std::vector<PackedStep> steps;
  const std::string err = plan_packed_forward(d, counts, weight_desc(format, scale_dtype, block_rows, block_cols),
                                              scratch_experts, caps(), max_width(block_cols), &steps);
  if (!err.empty()) return refuse(err);
  return run_packed(steps, t, call, packed, scale, scratch);
}

int slmoe_emu_bwd(int dtype, int64_t T, int64_t E, int64_t d_in, int64_t d_out, int64_t r, double scaling,
                  const void* grad_y, const void* lora_x, const void* weight, const void* lora_a, const void* lora_b,
                  const void* h, const void* lora_mask, const int64_t* counts, void* dx, void* da, void* db, void* dh,
                  int32_t* workspace, int format, const void* packed, const void* scale, int scale_dtype,
                  int64_t block_rows, int64_t block_cols, void* scratch, int64_t scratch_experts) {
  (void)workspace;
  DType t;
  if (!dtype_of(dtype, &t)) return refuse("dtype must be bf16 or fp16");
  slmoe_emu::gm_allow_unregistered(true);
  Call call{d_in, d_out, r};
  call.t[kTensorGradY] = const_cast<void*>(grad_y);
  call.t[kTensorLoraX] = const_cast<void*>(lora_x);
  call.t[kTensorWeight] = const_cast<void*>(weight);
  call.t[kTensorLoraA] = const_cast<void*>(lora_a);
  call.t[kTensorLoraB] = const_cast<void*>(lora_b);
  call.t[kTensorH] = const_cast<void*>(h);
  call.t[kTensorMask] = const_cast<void*>(lora_mask);
  call.t[kTensorDx] = dx;
  call.t[kTensorDa] = da;
  call.t[kTensorDb] = db;
  call.t[kTensorDh] = dh;
  const LoraDims d = dims(T, E, d_in, d_out, r, scaling);
  const bool mask = lora_mask != nullptr, need_dx = dx != nullptr, need_da = da != nullptr, need_db = db != nullptr;
  if (packed == nullptr) {
    void* tt[kNumTensors];
    size_t bytes[kNumTensors];
    call.chunk(0, 0, T, E, tt, bytes);
    run_dense(plan_backward(d, counts, mask, need_dx, need_da, need_db, caps()), t, tt, bytes);
    return 0;
  }
  std::vector<PackedStep> steps;
  const std::string err = plan_packed_backward(d, counts, weight_desc(format, scale_dtype, block_rows, block_cols),
                                               scratch_experts, mask, need_dx, need_da, need_db, caps(),
                                               max_width(block_cols), &steps);
  if (!err.empty()) return refuse(err);
  return run_packed(steps, t, call, packed, scale, scratch);
}

}  // extern "C"
