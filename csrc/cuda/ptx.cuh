// The few PTX instructions the grouped GEMM is built from, one inline function each.
//
//   cp.async      16-byte global -> shared copies that run while the warp computes (sm_80+), with
//                 zero fill for the part of a chunk outside the matrix (predication)
//   ldmatrix      a warp loads four 8x8 b16 tiles from shared memory straight into the register
//                 layout mma.sync expects; .trans transposes them on the way (sm_75+)
//   mma.sync      m16n8k16 tensor-core MMA, bf16 or fp16 inputs, fp32 accumulators (sm_80+)
//
// Kept apart from the kernels so that csrc/cuda/emu can swap in a host emulation of exactly these
// (and nothing else) to test the kernels' indexing on a machine without a GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#ifdef SLMOE_CUDA_EMU
#include "emu/cuda_emu.h"
#else

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "the slmoe CUDA kernels need sm_80 or newer (cp.async, bf16 mma.sync); build for sm_80/sm_90"
#endif

namespace slmoe {
namespace cuda {
namespace ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies src_bytes (0..16) bytes from global `src` to shared `dst` and zero-fills the rest of the
// 16 bytes; with src_bytes == 0 nothing is read. Both addresses must be 16-byte aligned.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Lane l passes the address of row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned); register j
// of lane l receives row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix j.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}

// As ldmatrix_x4 with each matrix transposed: register j of lane l receives rows 2 (l % 4) and
// 2 (l % 4) + 1, column l / 4 of matrix j.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}

// acc[16x8] += A[16x16] B[16x8] with the fragment layouts of the PTX ISA (g = lane / 4, c = lane % 4):
//   a: {A[g][2c..], A[g+8][2c..], A[g][2c+8..], A[g+8][2c+8..]}   b: {B[2c..][g], B[2c+8..][g]}
//   acc: {C[g][2c], C[g][2c+1], C[g+8][2c], C[g+8][2c+1]}
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&acc)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&acc)[4], const uint32_t (&a)[4],
                                                           const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&acc)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

}  // namespace ptx
}  // namespace cuda
}  // namespace slmoe

// Dynamic shared memory of the running block, 16-byte aligned.
#define SLMOE_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]

#endif  // SLMOE_CUDA_EMU
