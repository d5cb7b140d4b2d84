// Host planner of the AscendC grouped LoRA expert op over a packed frozen W (formats in
// csrc/lora_expert_packed.h): per chunk of experts, a decode launch (packed_decode_kernel.cpp: the
// vector units dequantise the chunk's experts that own rows into a scratch of the input dtype) and
// the dense launches of lora_tiling.h on that chunk with the scratch as W. The backward decodes
// again (only for dx; dA and dB never read W): no decoded copy outlives a launch sequence.
// No torch, no CANN: the torch_npu binding and the host emulation run the same plans.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lora_tiling.h"
#include "packed_tiling_data.h"

namespace slmoe_ascend {

// Columns of one decode segment at most: its VECCALC scratch is about 15 x 4 bytes per column
// (PackedCalcLayoutOf), 120 KiB of the 192 KiB UB at 2048, with room for the double-buffered queues.
constexpr uint32_t kPackedMaxWidth = 2048;

struct PackedWeightDesc {
  PackedFormat format = kPackedMxfp4;
  ScaleType scaleType = kScaleF32;  // pack-quantized only
  uint32_t blockRows = 1, blockCols = 32;
};

struct DecodePlan {
  std::vector<uint8_t> tiling;  // PackedDecodeTiling and its tables (packed_tiling_data.h)
  uint32_t blockDim = 0;        // vector units to launch; 0: nothing to decode
};

// One chunk of experts [e0, e0 + experts): rows [row0, row0 + rows) of the op's token rows.
struct PackedStep {
  int64_t e0 = 0, experts = 0, row0 = 0, rows = 0;
  DecodePlan decode;                // into scratch experts 0 .. experts - 1
  std::vector<LaunchPlan> dense;    // lora_tiling.h's launches for this chunk's experts and rows
};

// Each returns "" or one line saying what is not supported. counts: E group sizes summing to d.T.
// maxWidth: segment columns at most (tests pass small values to cut rows into several segments).
std::string plan_decode(const PackedWeightDesc& w, int64_t d_out, int64_t d_in, int64_t e0, int64_t experts,
                        const int64_t* counts, const HwCaps& caps, uint32_t maxWidth, DecodePlan* out);
std::string plan_packed_forward(const LoraDims& d, const int64_t* counts, const PackedWeightDesc& w,
                                int64_t scratchExperts, const HwCaps& caps, uint32_t maxWidth,
                                std::vector<PackedStep>* steps);
std::string plan_packed_backward(const LoraDims& d, const int64_t* counts, const PackedWeightDesc& w,
                                 int64_t scratchExperts, bool has_mask, bool need_dx, bool need_da, bool need_db,
                                 const HwCaps& caps, uint32_t maxWidth, std::vector<PackedStep>* steps);

}  // namespace slmoe_ascend
