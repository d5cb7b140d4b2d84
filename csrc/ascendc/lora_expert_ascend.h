// Launcher of the AscendC grouped LoRA expert kernel: raw device pointers, a tiling buffer already
// on the device (from lora_tiling.h's planner) and an ACL stream. No torch, no CANN headers, so the
// torch_npu binding (host compiler) and the host emulation (g++) include the same declaration the
// kernel library (CANN's AscendC toolchain) defines.
#pragma once

#include "lora_tiling_data.h"  // fixed-width types, TensorId

namespace slmoe_ascend {

enum class DType : uint32_t { kFloat16 = 0, kBFloat16 = 1 };

// Enqueues one launch of the kernel on `stream` (an aclrtStream): blockDim AI Cores, each one cube
// unit and two vector units (KERNEL_TYPE_MIX_AIC_1_2). tensors[i] is the device address of
// TensorId i (nullptr where the launch does not use it); workspace holds plan.workspaceBytes.
// Does nothing when blockDim is 0.
void launch_lora_grouped_gemm(DType dtype, uint32_t blockDim, void* stream, void* const tensors[kNumTensors],
                              void* workspace, const void* tiling_on_device);

// Enqueues the packed-weight decode (packed_decode_kernel.cpp, KERNEL_TYPE_AIV_ONLY, blockDim vector
// units): the experts a decode tiling (packed_tiling.h's plan_decode) names, from packed/scale into
// scratch [experts, d_out, d_in] of `dtype`. Does nothing when blockDim is 0.
void launch_packed_decode(DType dtype, uint32_t blockDim, void* stream, const void* packed, const void* scale,
                          void* scratch, const void* tiling_on_device);

}  // namespace slmoe_ascend
