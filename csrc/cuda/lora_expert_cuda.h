// Launcher API of the CUDA grouped LoRA expert kernels: raw device pointers, sizes and a stream.
//
// No torch here on purpose: lora_expert_kernels.cu includes only this header and the CUDA toolkit,
// so .ci/compile_cuda.sh can compile the kernels with plain nvcc on a machine whose torch is a CPU
// build. lora_expert_binding.cpp turns tensors into these structs.
//
// Every tensor is dense row-major (contiguous) on the current device of `stream`, with the dtype
// `dtype` unless said otherwise. Rows of the [T, *] tensors are grouped by expert: expert e owns
// tokens_per_expert[e] consecutive rows, in expert order. The launchers compute the groups' row
// offsets and the tile schedule on the device from `tokens_per_expert` (int64, device memory), so
// nothing here reads it on the host; the caller checks the counts (non-negative, summing to T).
//
//   forward    h = lora_x A_e^T                      [T, r]      (lora_x = x, or x * dropout mask)
//              y = x W_e^T + s h B_e^T                [T, d_out]
//   backward   dh = s dy B_e                          [T, r]      (workspace)
//              dB_e = s dy_e^T h_e                    [E, d_out, r]
//              dA_e = dh_e^T lora_x_e                 [E, r, d_in]
//              dx = dy W_e + (dh A_e) [* mask]        [T, d_in]
//
// Limits (checked by the launchers, cudaErrorInvalidValue otherwise): T, d_in, d_out, r and E
// below 2^31. Sizes may be 0, and experts may own no rows: their dA and dB are written as zeros.
#pragma once

#include <cstddef>
#include <cstdint>

#ifdef SLMOE_CUDA_EMU
#include "emu/cuda_emu.h"  // host emulation for csrc/cuda/emu tests: same types, no GPU
#else
#include <cuda_runtime_api.h>
#endif

namespace slmoe {
namespace cuda {

enum class DType { kFloat32, kFloat64, kBFloat16, kFloat16 };

// Device int32 scratch the launchers need for the group offsets and the tile schedule.
inline size_t lora_workspace_elems(int64_t num_experts) { return 2 * static_cast<size_t>(num_experts + 1); }

struct LoraFwdArgs {
  DType dtype;
  int64_t T, E, d_in, d_out, r;
  double scaling;                    // s = alpha / r
  const void* x;                     // [T, d_in]
  const void* lora_x;                // [T, d_in] LoRA input, or nullptr to use x
  const void* weight;                // [E, d_out, d_in], frozen
  const void* lora_a;                // [E, r, d_in]
  const void* lora_b;                // [E, d_out, r]
  const int64_t* tokens_per_expert;  // [E] int64, device
  void* y;                           // [T, d_out] out
  void* h;                           // [T, r] out (kept for the backward)
  int32_t* workspace;                // lora_workspace_elems(E) int32, device
};

struct LoraBwdArgs {
  DType dtype;
  int64_t T, E, d_in, d_out, r;
  double scaling;
  const void* grad_y;                // [T, d_out]
  const void* lora_x;                // [T, d_in] the forward's LoRA input
  const void* weight;                // [E, d_out, d_in]
  const void* lora_a;                // [E, r, d_in]
  const void* lora_b;                // [E, d_out, r]
  const void* h;                     // [T, r] from the forward
  const void* lora_mask;             // [T, d_in] dropout mask applied to the LoRA term of dx, or nullptr
  const int64_t* tokens_per_expert;  // [E] int64, device
  void* dx;                          // [T, d_in] out, or nullptr: not computed
  void* da;                          // [E, r, d_in] out, or nullptr
  void* db;                          // [E, d_out, r] out, or nullptr
  void* dh;                          // [T, r] scratch, needed when dx or da is requested
  int32_t* workspace;                // lora_workspace_elems(E) int32, device
};

// Both enqueue their kernels on `stream` and return the first launch error (cudaSuccess if none).
// They never synchronize.
cudaError_t lora_grouped_linear_fwd(const LoraFwdArgs& args, cudaStream_t stream);
cudaError_t lora_grouped_linear_bwd(const LoraBwdArgs& args, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// The same op over a packed (quantised) frozen W of logical shape [E, d_out, d_in], in one of
// megatron_slmoe.ops.quantized_weights' formats (layouts there and in csrc/lora_expert_packed.h):
//   kMxfp4      packed uint8 [E, d_out, d_in/2], scale uint8 (E8M0) [E, d_out, d_in/32]
//   kInt4       packed int32 [E, d_out, d_in/8], scale bf16/fp16/fp32 [E, d_out, d_in/group]
//   kBlockFp8   packed float8_e4m3fn [E, d_out, d_in], scale fp32 [E, ceil(d_out/br), ceil(d_in/bc)]
// Experts are taken in chunks of at most `scratch_experts`: the chunk's experts that own rows are
// decoded (value for value as the Python codecs) into `scratch` [scratch_experts, d_out, d_in] of
// `dtype`, then the dense launchers above run on the chunk with the scratch as W. The scratch is
// the only decoded copy and lives for the call; the backward decodes again (only for dx).

enum class PackedFormat { kMxfp4, kInt4, kBlockFp8 };

struct PackedWeightArgs {
  PackedFormat format;
  const void* packed;
  const void* scale;
  DType scale_dtype;                 // kInt4: bf16, fp16 or fp32; ignored otherwise
  int64_t block_rows, block_cols;    // what one scale covers: [1, 32], [1, group] or [br, bc]
};

struct LoraPackedFwdArgs {
  LoraFwdArgs dense;                 // `weight` is ignored (the scratch takes its place)
  PackedWeightArgs w;
  const int64_t* host_tokens_per_expert;  // [E] the same counts on the host: the chunks' first rows
  void* scratch;                     // [scratch_experts, d_out, d_in] of dtype, device
  int64_t scratch_experts;           // >= 1
};

struct LoraPackedBwdArgs {
  LoraBwdArgs dense;                 // `weight` is ignored
  PackedWeightArgs w;
  const int64_t* host_tokens_per_expert;
  void* scratch;                     // needed when dx is requested and T > 0
  int64_t scratch_experts;
};

// Decodes experts [e0, e0 + n) of W into scratch [n, d_out, d_in] of `dtype`, skipping those whose
// count (device `tokens_per_expert`, indexed from e0; nullptr: decode all) is zero.
cudaError_t decode_packed_experts(const PackedWeightArgs& w, DType dtype, int64_t d_out, int64_t d_in, int64_t e0,
                                  int64_t n, const int64_t* tokens_per_expert, void* scratch, cudaStream_t stream);

cudaError_t lora_grouped_linear_packed_fwd(const LoraPackedFwdArgs& args, cudaStream_t stream);
cudaError_t lora_grouped_linear_packed_bwd(const LoraPackedBwdArgs& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace slmoe
