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

}  // namespace cuda
}  // namespace slmoe
