// Host emulation of the CUDA subset the slmoe kernels use, to run them on a machine without a GPU.
//
// Why: the kernels' risk is in index math (fragment layouts, tile predication, the tile scheduler,
// the cp.async pipeline), and none of that can run here. With SLMOE_CUDA_EMU defined, the unchanged
// kernel sources compile as host C++ (g++), each CUDA thread becomes a fiber (ucontext), and the
// instructions of ptx.cuh are emulated with the semantics of the PTX ISA:
//   - __syncthreads, warp collectives (ldmatrix, mma.sync, __shfl_up_sync) are real barriers
//     between the fibers of a block / warp; lanes exchange operands through per-thread slots;
//   - cp.async copies are deferred until the cp.async.wait_group that must complete them (the
//     latest moment hardware may finish them), so reading shared memory too early reads stale data;
//   - shared memory starts as NaN bytes; ldmatrix and cp.async check alignment and that their
//     shared addresses lie inside the block's dynamic shared memory.
// Blocks run one after another; deadlocks (a barrier some thread never reaches) abort.
//
// This is a test device, not a simulator of timing or of the memory model beyond the above; a
// pass here says the indexing is right, not that the GPU run is. See csrc/cuda/emu/README.md.
#pragma once

#ifndef SLMOE_CUDA_EMU
#error "cuda_emu.h is for SLMOE_CUDA_EMU host builds only"
#endif

#define __launch_bounds__(...)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>  // types only (dim3, cudaError_t, ...); the functions are defined in cuda_emu.cpp

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>

namespace slmoe_emu {

uint3 thread_idx();
uint3 block_idx();
dim3 block_dim();
dim3 grid_dim();
unsigned char* dynamic_smem();
void syncthreads();

// Runs body once per thread of each block of the grid (blocks in order, threads as fibers).
void launch(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body);

// Warp exchange: each lane publishes `bytes` (<= 64) and waits for its warp; peer(l) then reads
// lane l's data until warp_done(), which waits again so the slots can be reused.
void warp_put(const void* data, size_t bytes);
const void* warp_peer(int lane);
void warp_done();

// Aborts unless [p, p + bytes) is inside the running block's dynamic shared memory and p is
// `align`-aligned.
void check_smem(const void* p, size_t bytes, size_t align, const char* what);
[[noreturn]] void fail(const char* fmt, ...);

void cp_async(void* dst, const void* src, int src_bytes);
void cp_async_commit();
void cp_async_wait(int pending);

// The injected bug this run compiles in (0: none): SLMOE_MUTANT(n) in the kernels is true when
// mutation() == n. Set by set_mutation, else $SLMOE_EMU_MUTATION.
int mutation();
void set_mutation(int n);

// Configuration of the emulated device (defaults: 4 SMs, 1 block per SM, i.e. a grid of at most
// 4 persistent blocks, so tests walk several tiles per block). Environment: SLMOE_EMU_SMS.
int emu_sm_count();

}  // namespace slmoe_emu

#define SLMOE_MUTANT(n) (::slmoe_emu::mutation() == (n))

#define threadIdx (::slmoe_emu::thread_idx())
#define blockIdx (::slmoe_emu::block_idx())
#define blockDim (::slmoe_emu::block_dim())
#define gridDim (::slmoe_emu::grid_dim())

inline void __syncthreads() { ::slmoe_emu::syncthreads(); }

template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta) {
  if (mask != 0xffffffffu) ::slmoe_emu::fail("__shfl_up_sync: only full-warp masks are emulated");
  ::slmoe_emu::warp_put(&v, sizeof v);
  const int lane = static_cast<int>(threadIdx.x % 32);
  T out = v;
  if (lane >= static_cast<int>(delta)) std::memcpy(&out, ::slmoe_emu::warp_peer(lane - static_cast<int>(delta)), sizeof out);
  ::slmoe_emu::warp_done();
  return out;
}

#define SLMOE_DYNAMIC_SMEM(name) unsigned char* name = ::slmoe_emu::dynamic_smem()

namespace slmoe {
namespace cuda {
namespace ptx {

inline void cp_async_16(void* dst, const void* src, int src_bytes) { ::slmoe_emu::cp_async(dst, src, src_bytes); }
inline void cp_async_commit() { ::slmoe_emu::cp_async_commit(); }
template <int N>
inline void cp_async_wait() {
  ::slmoe_emu::cp_async_wait(N);
}

namespace emu_detail {
inline uint16_t load_b16(const void* base, int index) {
  uint16_t v;
  std::memcpy(&v, static_cast<const unsigned char*>(base) + 2 * index, 2);
  return v;
}

inline void ldmatrix(uint32_t (&r)[4], const void* row, bool trans) {
  ::slmoe_emu::check_smem(row, 16, 16, "ldmatrix row address");
  ::slmoe_emu::warp_put(&row, sizeof row);
  const int lane = static_cast<int>(threadIdx.x % 32);
  auto row_of = [](int matrix, int r) { return *static_cast<const void* const*>(::slmoe_emu::warp_peer(8 * matrix + r)); };
  for (int j = 0; j < 4; ++j) {
    uint16_t lo, hi;
    if (!trans) {  // row lane/4, columns 2(lane%4), +1
      const void* p = row_of(j, lane / 4);
      lo = load_b16(p, 2 * (lane % 4));
      hi = load_b16(p, 2 * (lane % 4) + 1);
    } else {  // rows 2(lane%4), +1, column lane/4
      lo = load_b16(row_of(j, 2 * (lane % 4)), lane / 4);
      hi = load_b16(row_of(j, 2 * (lane % 4) + 1), lane / 4);
    }
    r[j] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  ::slmoe_emu::warp_done();
}

inline float b16_to_float(uint16_t bits, const __nv_bfloat16*) {
  const uint32_t w = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}
inline float b16_to_float(uint16_t bits, const __half*) {
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}
}  // namespace emu_detail

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) { emu_detail::ldmatrix(r, row, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) { emu_detail::ldmatrix(r, row, true); }

template <typename T>
inline void mma_m16n8k16(float (&acc)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  struct Frag {
    uint32_t a[4], b[2];
  } mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}};
  ::slmoe_emu::warp_put(&mine, sizeof mine);
  const int lane = static_cast<int>(threadIdx.x % 32);
  auto frag = [](int l) { return static_cast<const Frag*>(::slmoe_emu::warp_peer(l)); };
  auto half_of = [](uint32_t reg, int h) { return static_cast<uint16_t>(h ? reg >> 16 : reg & 0xffffu); };
  // A[row][k] sits in lane (row % 8) * 4 + (k % 8) / 2, register (row / 8) + 2 (k / 8), half k % 2;
  // B[k][col] in lane col * 4 + (k % 8) / 2, register k / 8, half k % 2.
  auto A = [&](int row, int k) {
    return emu_detail::b16_to_float(half_of(frag((row % 8) * 4 + (k % 8) / 2)->a[row / 8 + 2 * (k / 8)], k % 2),
                                    static_cast<const T*>(nullptr));
  };
  auto B = [&](int k, int col) {
    return emu_detail::b16_to_float(half_of(frag(col * 4 + (k % 8) / 2)->b[k / 8], k % 2), static_cast<const T*>(nullptr));
  };
  float out[4];
  for (int q = 0; q < 4; ++q) {
    const int row = lane / 4 + 8 * (q / 2), col = 2 * (lane % 4) + q % 2;
    float sum = 0.f;
    for (int k = 0; k < 16; ++k) sum += A(row, k) * B(k, col);
    out[q] = acc[q] + sum;
  }
  ::slmoe_emu::warp_done();
  for (int q = 0; q < 4; ++q) acc[q] = out[q];
}

}  // namespace ptx
}  // namespace cuda
}  // namespace slmoe
