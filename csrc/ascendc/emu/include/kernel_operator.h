// Host emulation of the AscendC API subset csrc/ascendc/lora_expert_kernel.cpp uses, for Atlas
// A2/A3 (dav-c220). It stands in for CANN's kernel_operator.h so the kernel source compiles
// unchanged with g++ (-DSLMOE_ASCEND_EMU) and runs on host fibers, one per cube or vector unit.
//
// What is modelled, because the kernel's correctness depends on it (see ../README.md):
//   * memories and their capacities: L1 512 KiB, L0A/L0B 64 KiB, L0C 128 KiB per cube unit, UB
//     192 KiB per vector unit; TPipe::InitBuffer fails past them (and past 8 buffers per position);
//   * data layouts: ND2NZ into L1, the ZZ (L0A) / ZN (L0B) fractal loads of LoadData (with per-
//     fractal transpose), NZ accumulators in L0C, Fixpipe NZ->ND with fp32->fp16/bf16 conversion,
//     Mmad's GEMV mode at M = 1 (which reads L0A as ND), fp32 accumulation;
//   * DataCopy's 32-byte rules (UB addresses, contiguous lengths), DataCopyPad's per-row padding;
//   * the pipes (S, V, M, MTE1, MTE2, MTE3, FIX) as asynchronous queues: a happens-before race
//     detector over every byte of local memory and of the writable global memory, fed by queue
//     EnQue/DeQue/AllocTensor/FreeTensor, PipeBarrier and CrossCoreSetFlag/WaitFlag; an access not
//     ordered after a conflicting one (RAW/WAR/WAW) fails, as does reuse of an L0C accumulator by
//     a small Mmad without PipeBarrier<PIPE_M>;
//   * TQue state: AllocTensor past the buffer count, EnQue past the depth, DeQue of an empty queue,
//     a tensor used while queued or after FreeTensor, a double free, tensors left at kernel end;
//   * cross-core flags in mode 2 (AIC <-> both AIVs) as counting semaphores (max 15), deadlocks,
//     flags left unconsumed at kernel end; global memory accesses outside registered buffers.
// Every violation ends the process with "emu: ..." on stderr and exit status 3.
//
// Not modelled: timing, bank conflicts, the scalar cache, real pipe overlap (ops execute in
// program order; the race detector decides whether that order was guaranteed), any API or data
// type the kernel does not use.
#pragma once

#ifndef SLMOE_ASCEND_EMU
#error "this kernel_operator.h is the host emulation; build with -DSLMOE_ASCEND_EMU"
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#define __aicore__
#define __global__
#define __gm__
#define GM_ADDR uint8_t*

// ----- types of the global namespace ---------------------------------------------------------

struct half {
  uint16_t bits = 0;
  half() = default;
  half(float f);  // round to nearest even, as CAST_RINT
  explicit operator float() const;
};

struct bfloat16_t {
  uint16_t bits = 0;
  bfloat16_t() = default;
  bfloat16_t(float f);  // round to nearest even
  explicit operator float() const;
};

enum pipe_t { PIPE_S = 0, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_FIX, PIPE_ALL };

enum QuantMode_t : uint8_t { NoQuant = 0, F322F16, F322BF16, DEQF16, VDEQF16, QF322B8_PRE, VQF322B8_PRE, REQ8, VREQ8 };

enum KernelTaskType {
  KERNEL_TYPE_AIV_ONLY = 0,
  KERNEL_TYPE_AIC_ONLY,
  KERNEL_TYPE_MIX_AIV_1_0,
  KERNEL_TYPE_MIX_AIC_1_0,
  KERNEL_TYPE_MIX_AIC_1_1,
  KERNEL_TYPE_MIX_AIC_1_2,
};

#define KERNEL_TASK_TYPE_DEFAULT(type) ::slmoe_emu::declare_kernel_type(type)
#define ASCEND_IS_AIC (::slmoe_emu::is_aic())
#define ASCEND_IS_AIV (::slmoe_emu::is_aiv())

namespace AscendC {

enum class TPosition : uint8_t { GM, A1, A2, B1, B2, C1, C2, CO1, CO2, VECIN, VECOUT, VECCALC, MAX };
using QuePosition = TPosition;

enum class RoundMode { CAST_NONE = 0, CAST_RINT, CAST_FLOOR, CAST_CEIL, CAST_ROUND, CAST_TRUNC, CAST_ODD };

}  // namespace AscendC

// ----- runtime of the emulation (ascendc_emu.cpp) ---------------------------------------------

namespace slmoe_emu {

enum class Mem : uint8_t { L1 = 0, L0A, L0B, L0C, UB, kCount };

// A view of local memory: which core, where, and the queue buffer it belongs to.
struct TensorRef {
  int core = -1;
  Mem mem = Mem::UB;
  AscendC::TPosition pos = AscendC::TPosition::MAX;
  uint32_t addr = 0;   // byte offset in the core's memory
  uint32_t bytes = 0;  // bytes from addr to the end of the tensor
  int buffer = -1;     // queue / TBuf buffer id in the core
  uint32_t gen = 0;    // allocation generation of that buffer
};

[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Launch and core identity.
void launch_mix(uint32_t block_dim, const std::function<void()>& kernel);  // KERNEL_TYPE_MIX_AIC_1_2
void launch_aiv(uint32_t block_dim, const std::function<void()>& kernel);  // KERNEL_TYPE_AIV_ONLY: one AIV per block
void declare_kernel_type(int type);
bool is_aic();
bool is_aiv();
int64_t block_idx();
int64_t block_num();
int64_t sub_block_idx();
int mutation();  // injected bug selected by $SLMOE_EMU_MUTATION (0: none) or set_mutation
void set_mutation(int n);

// Global memory the kernel may touch; writable buffers are race-checked. With
// gm_allow_unregistered(true), addresses outside every registered buffer are accepted unchecked
// (for callers that allocate their own outputs, such as the binding test).
void gm_register(const void* p, size_t bytes, bool writable, const char* name);
void gm_clear();
void gm_allow_unregistered(bool allow);

// TPipe / TQue / TBuf.
void pipe_open();
int queue_create(AscendC::TPosition pos, int depth, int num, uint32_t len, const char* kind);
int tbuf_create(AscendC::TPosition pos, uint32_t len);
TensorRef queue_alloc(int queue);
void queue_enque(int queue, const TensorRef& t);
TensorRef queue_deque(int queue);
void queue_free(int queue, const TensorRef& t);
TensorRef tbuf_get(int tbuf, uint32_t bytes);
uint8_t* tensor_data(const TensorRef& t, const char* what);  // validates state; pointer to addr

// One instruction on a pipe: begin, declare every byte range it reads and writes, end.
void op_begin(pipe_t pipe, const char* what);
void op_local(const TensorRef& t, uint32_t offset, uint32_t bytes, bool write);
void op_gm(const void* p, uint64_t bytes, bool write);
void op_mmad_accumulate_check(const TensorRef& c, uint32_t bytes, uint16_t m, uint16_t n);
void op_end();

void pipe_barrier(pipe_t pipe);
void cross_core_set(uint8_t mode, pipe_t pipe, uint16_t flag);
void cross_core_wait(uint8_t mode, uint16_t flag);

}  // namespace slmoe_emu

// ----- AscendC API subset --------------------------------------------------------------------

namespace AscendC {

template <typename T>
class GlobalTensor {
 public:
  void SetGlobalBuffer(__gm__ T* buffer, uint64_t size = 0) {
    ptr_ = buffer;
    size_ = size;
  }
  GlobalTensor operator[](uint64_t offset) const {
    GlobalTensor g;
    g.ptr_ = ptr_ + offset;
    g.size_ = size_ == 0 ? 0 : (offset < size_ ? size_ - offset : 1);
    return g;
  }
  T GetValue(uint64_t i) const {
    slmoe_emu::op_begin(PIPE_S, "GlobalTensor::GetValue");
    slmoe_emu::op_gm(ptr_ + i, sizeof(T), false);
    slmoe_emu::op_end();
    return ptr_[i];
  }
  T* emu_ptr() const { return ptr_; }

 private:
  T* ptr_ = nullptr;
  uint64_t size_ = 0;
};

template <typename T>
class LocalTensor {
 public:
  LocalTensor() = default;
  explicit LocalTensor(const slmoe_emu::TensorRef& r) : ref_(r) {}
  LocalTensor operator[](uint32_t offset) const {
    if (static_cast<uint64_t>(offset) * sizeof(T) > ref_.bytes) {
      slmoe_emu::fail("LocalTensor[%u] is past the end of a %u-byte tensor", offset, ref_.bytes);
    }
    LocalTensor t(ref_);
    t.ref_.addr += offset * sizeof(T);
    t.ref_.bytes -= offset * sizeof(T);
    return t;
  }
  uint32_t GetSize() const { return ref_.bytes / sizeof(T); }
  template <typename U>
  LocalTensor<U> ReinterpretCast() const {
    return LocalTensor<U>(ref_);
  }
  const slmoe_emu::TensorRef& emu_ref() const { return ref_; }
  T* emu_data(const char* what) const { return reinterpret_cast<T*>(slmoe_emu::tensor_data(ref_, what)); }

 private:
  slmoe_emu::TensorRef ref_;
};

template <TPosition pos, int32_t depth>
class TQue {
 public:
  template <typename T>
  LocalTensor<T> AllocTensor() {
    return LocalTensor<T>(slmoe_emu::queue_alloc(id()));
  }
  template <typename T>
  void EnQue(const LocalTensor<T>& t) {
    slmoe_emu::queue_enque(id(), t.emu_ref());
  }
  template <typename T>
  LocalTensor<T> DeQue() {
    return LocalTensor<T>(slmoe_emu::queue_deque(id()));
  }
  template <typename T>
  void FreeTensor(LocalTensor<T>& t) {
    slmoe_emu::queue_free(id(), t.emu_ref());
  }
  void emu_init(uint8_t num, uint32_t len) {
    if (id_ >= 0) slmoe_emu::fail("TPipe::InitBuffer called twice for one TQue");
    id_ = slmoe_emu::queue_create(pos, depth, num, len, "TQue");
  }

 private:
  int id() const {
    if (id_ < 0) slmoe_emu::fail("TQue used before TPipe::InitBuffer");
    return id_;
  }
  int id_ = -1;
};

template <TPosition pos>
class TBuf {
 public:
  template <typename T>
  LocalTensor<T> Get() {
    return LocalTensor<T>(slmoe_emu::tbuf_get(id(), 0));
  }
  template <typename T>
  LocalTensor<T> Get(uint32_t len) {
    return LocalTensor<T>(slmoe_emu::tbuf_get(id(), len * sizeof(T)));
  }
  void emu_init(uint32_t len) {
    if (id_ >= 0) slmoe_emu::fail("TPipe::InitBuffer called twice for one TBuf");
    id_ = slmoe_emu::tbuf_create(pos, len);
  }

 private:
  int id() const {
    if (id_ < 0) slmoe_emu::fail("TBuf used before TPipe::InitBuffer");
    return id_;
  }
  int id_ = -1;
};

class TPipe {
 public:
  TPipe() { slmoe_emu::pipe_open(); }
  template <TPosition pos, int32_t depth>
  bool InitBuffer(TQue<pos, depth>& que, uint8_t num, uint32_t len) {
    que.emu_init(num, len);
    return true;
  }
  template <TPosition pos>
  bool InitBuffer(TBuf<pos>& buf, uint32_t len) {
    buf.emu_init(len);
    return true;
  }
  void Destroy() {}
};

// ----- parameter structs, with the field types of dav-c220 ----------------------------------

struct Nd2NzParams {
  uint16_t ndNum = 0;
  uint16_t nValue = 0;
  uint16_t dValue = 0;
  uint16_t srcNdMatrixStride = 0;
  uint16_t srcDValue = 0;
  uint16_t dstNzC0Stride = 0;
  uint16_t dstNzNStride = 0;
  uint16_t dstNzMatrixStride = 0;
};

struct LoadData2DParams {
  uint16_t startIndex = 0;
  uint16_t dstGap = 0;
  uint16_t srcStride = 0;
  bool ifTranspose = false;
  uint8_t repeatTimes = 0;
  uint8_t sid = 0;
  uint8_t addrMode = 0;
};

struct MmadParams {
  uint16_t m = 0;
  uint16_t n = 0;
  uint16_t k = 0;
  bool isBias = false;
  int32_t fmOffset = 0;
  bool enSsparse = false;
  bool enWinogradA = false;
  bool enWinogradB = false;
  uint8_t unitFlag = 0;
  bool kDirectionAlign = false;
  bool cmatrixSource = false;
  bool cmatrixInitVal = true;
};

enum class CO2Layout : uint8_t { NZ = 0, ROW_MAJOR, COLUMN_MAJOR };
struct FixpipeConfig {
  CO2Layout format;
};
constexpr FixpipeConfig CFG_NZ = {CO2Layout::NZ};
constexpr FixpipeConfig CFG_ROW_MAJOR = {CO2Layout::ROW_MAJOR};

struct FixpipeParamsV220 {
  uint16_t nSize = 0;
  uint16_t mSize = 0;
  uint16_t srcStride = 0;
  uint32_t dstStride = 0;
  QuantMode_t quantPre = QuantMode_t::NoQuant;
  uint64_t deqScalar = 0;
  uint16_t ndNum = 1;
  uint16_t srcNdStride = 0;
  uint16_t dstNdStride = 0;
  bool reluEn = false;
  uint8_t unitFlag = 0;
  bool isChannelSplit = false;
};

struct DataCopyExtParams {
  uint16_t blockCount = 1;
  uint32_t blockLen = 0;
  uint32_t srcStride = 0;
  uint32_t dstStride = 0;
  uint32_t rsv = 0;
};

template <typename T>
struct DataCopyPadExtParams {
  bool isPad = false;
  uint8_t leftPadding = 0;
  uint8_t rightPadding = 0;
  T paddingValue = T();
};

// ----- instructions (ascendc_emu_ops.h) -------------------------------------------------------

int64_t GetBlockIdx();
int64_t GetBlockNum();
int64_t GetSubBlockIdx();

template <pipe_t pipe>
void PipeBarrier() {
  slmoe_emu::pipe_barrier(pipe);
}

template <uint8_t modeId, pipe_t pipe>
void CrossCoreSetFlag(uint16_t flagId) {
  slmoe_emu::cross_core_set(modeId, pipe, flagId);
}

template <uint8_t modeId = 0, pipe_t pipe = PIPE_S>
void CrossCoreWaitFlag(uint16_t flagId) {
  slmoe_emu::cross_core_wait(modeId, flagId);
}

}  // namespace AscendC

#include "ascendc_emu_ops.h"
