// Stand-in for torch_npu's NPUStream.h (declarations used by csrc/ascendc/lora_expert_npu.cpp only).
#pragma once
#include <acl/acl.h>
#include <c10/core/Device.h>

namespace c10_npu {
class NPUStream {
 public:
  aclrtStream stream() const;
  aclrtStream stream(const bool need_empty) const;  // false: do not drain the task queue first
};
NPUStream getCurrentNPUStream(c10::DeviceIndex device_index = -1);
}  // namespace c10_npu
