// Stand-in for CANN's acl/acl.h (declarations used by csrc/ascendc/lora_expert_npu.cpp only).
#pragma once
#include <cstdint>

typedef int aclError;
typedef void* aclrtStream;
static const aclError ACL_SUCCESS = 0;

typedef enum aclDeviceInfo {
  ACL_DEVICE_INFO_UNDEFINED = -1,
  ACL_DEVICE_INFO_AI_CORE_NUM = 0,
  ACL_DEVICE_INFO_VECTOR_CORE_NUM = 1,
  ACL_DEVICE_INFO_L2_SIZE = 2,
} aclDeviceInfo;

aclError aclGetDeviceCapability(uint32_t deviceId, aclDeviceInfo deviceInfo, int64_t* value);
