// C entry points of the emulated launchers, for packed_oracle.py (ctypes): flat arguments, host
// pointers (the emulation's "device" memory is host memory). Returns the launcher's cudaError_t.
#include "../lora_expert_cuda.h"

using slmoe::cuda::DType;
using slmoe::cuda::PackedFormat;

namespace {

slmoe::cuda::PackedWeightArgs weight_args(int format, const void* packed, const void* scale, int scale_dtype,
                                          int64_t block_rows, int64_t block_cols) {
  slmoe::cuda::PackedWeightArgs w{};
  w.format = static_cast<PackedFormat>(format);
  w.packed = packed;
  w.scale = scale;
  w.scale_dtype = static_cast<DType>(scale_dtype);
  w.block_rows = block_rows;
  w.block_cols = block_cols;
  return w;
}

}  // namespace

extern "C" {

void slmoe_emu_set_mutation(int n) { slmoe_emu::set_mutation(n); }

int slmoe_emu_decode(int format, const void* packed, const void* scale, int scale_dtype, int64_t block_rows,
                     int64_t block_cols, int dtype, int64_t d_out, int64_t d_in, int64_t e0, int64_t n,
                     const int64_t* counts, void* scratch) {
  return slmoe::cuda::decode_packed_experts(weight_args(format, packed, scale, scale_dtype, block_rows, block_cols),
                                            static_cast<DType>(dtype), d_out, d_in, e0, n, counts, scratch, nullptr);
}

// packed == nullptr: the dense launcher with `weight`; else the packed one.
int slmoe_emu_fwd(int dtype, int64_t T, int64_t E, int64_t d_in, int64_t d_out, int64_t r, double scaling,
                  const void* x, const void* lora_x, const void* weight, const void* lora_a, const void* lora_b,
                  const int64_t* counts, void* y, void* h, int32_t* workspace, int format, const void* packed,
                  const void* scale, int scale_dtype, int64_t block_rows, int64_t block_cols, void* scratch,
                  int64_t scratch_experts) {
  slmoe::cuda::LoraFwdArgs a{};
  a.dtype = static_cast<DType>(dtype);
  a.T = T, a.E = E, a.d_in = d_in, a.d_out = d_out, a.r = r, a.scaling = scaling;
  a.x = x, a.lora_x = lora_x, a.weight = weight, a.lora_a = lora_a, a.lora_b = lora_b;
  a.tokens_per_expert = counts, a.y = y, a.h = h, a.workspace = workspace;
  if (packed == nullptr) return slmoe::cuda::lora_grouped_linear_fwd(a, nullptr);
  slmoe::cuda::LoraPackedFwdArgs p{};
  p.dense = a;
  p.w = weight_args(format, packed, scale, scale_dtype, block_rows, block_cols);
  p.host_tokens_per_expert = counts;
  p.scratch = scratch;
  p.scratch_experts = scratch_experts;
  return slmoe::cuda::lora_grouped_linear_packed_fwd(p, nullptr);
}

int slmoe_emu_bwd(int dtype, int64_t T, int64_t E, int64_t d_in, int64_t d_out, int64_t r, double scaling,
                  const void* grad_y, const void* lora_x, const void* weight, const void* lora_a, const void* lora_b,
                  const void* h, const void* lora_mask, const int64_t* counts, void* dx, void* da, void* db, void* dh,
                  int32_t* workspace, int format, const void* packed, const void* scale, int scale_dtype,
                  int64_t block_rows, int64_t block_cols, void* scratch, int64_t scratch_experts) {
  slmoe::cuda::LoraBwdArgs a{};
  a.dtype = static_cast<DType>(dtype);
  a.T = T, a.E = E, a.d_in = d_in, a.d_out = d_out, a.r = r, a.scaling = scaling;
  a.grad_y = grad_y, a.lora_x = lora_x, a.weight = weight, a.lora_a = lora_a, a.lora_b = lora_b, a.h = h;
  a.lora_mask = lora_mask, a.tokens_per_expert = counts;
  a.dx = dx, a.da = da, a.db = db, a.dh = dh, a.workspace = workspace;
  if (packed == nullptr) return slmoe::cuda::lora_grouped_linear_bwd(a, nullptr);
  slmoe::cuda::LoraPackedBwdArgs p{};
  p.dense = a;
  p.w = weight_args(format, packed, scale, scale_dtype, block_rows, block_cols);
  p.host_tokens_per_expert = counts;
  p.scratch = scratch;
  p.scratch_experts = scratch_experts;
  return slmoe::cuda::lora_grouped_linear_packed_bwd(p, nullptr);
}

}  // extern "C"
