// How many decoded experts the CUDA packed kernel holds at once (csrc/cuda/lora_expert_binding.cpp),
// and the bytes that caps it. One home for the rule: the CUDA binding sizes its scratch with it, and
// csrc/bindings.cpp exposes it as slmoe::packed_scratch_experts on every build, so the memory
// planner's copy (megatron_slmoe.ops.lora_expert.PACKED_SCRATCH_BYTES, plan.memory) is tested
// against it on machines without CUDA.
#pragma once

#include <algorithm>
#include <cstdint>

namespace slmoe {

// Chunks run one after another, each ending in a partly idle wave of tiles and costing four
// launches, so fewer, larger chunks waste less (a 4096x7168 bf16 expert is 56 MiB: four per
// chunk); the scratch is the only decoded copy and is freed with the call.
constexpr int64_t kPackedScratchBytes = int64_t{256} << 20;

// Experts per chunk for `experts` local experts of `expert_bytes` decoded bytes each: as many as
// fit in kPackedScratchBytes, at least one, at most all of them.
inline int64_t packed_scratch_experts(int64_t experts, int64_t expert_bytes) {
  return std::max<int64_t>(1, std::min<int64_t>(experts, kPackedScratchBytes / std::max<int64_t>(1, expert_bytes)));
}

}  // namespace slmoe
