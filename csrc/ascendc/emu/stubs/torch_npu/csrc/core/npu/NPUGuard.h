// Stand-in for torch_npu's NPUGuard.h (declarations used by csrc/ascendc/lora_expert_npu.cpp only).
#pragma once
#include <c10/core/Device.h>
#include <optional>

namespace c10_npu {
struct OptionalNPUGuard {
  explicit OptionalNPUGuard(std::optional<c10::Device> device);
  explicit OptionalNPUGuard(c10::Device device);
  ~OptionalNPUGuard();
  OptionalNPUGuard(const OptionalNPUGuard&) = delete;
  OptionalNPUGuard& operator=(const OptionalNPUGuard&) = delete;
};
}  // namespace c10_npu
