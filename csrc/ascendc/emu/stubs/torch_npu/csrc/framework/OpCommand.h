// Stand-in for torch_npu's OpCommand.h (declarations used by csrc/ascendc/lora_expert_npu.cpp only).
#pragma once
#include <functional>
#include <string>

namespace at_npu {
namespace native {
using PROC_FUNC = std::function<int()>;
class OpCommand {
 public:
  OpCommand();
  ~OpCommand();
  OpCommand(const OpCommand&) = delete;
  OpCommand& operator=(const OpCommand&) = delete;
  OpCommand& Name(const std::string& name);
  OpCommand& SetCustomHandler(PROC_FUNC func);
  void Run();
};
}  // namespace native
}  // namespace at_npu
