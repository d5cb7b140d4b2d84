// Launchers of the grouped LoRA expert op (API in lora_expert_cuda.h) on the grouped GEMM of
// grouped_gemm.cuh. No torch headers: this file compiles with plain nvcc (.ci/compile_cuda.sh).
//
// Forward, three launches on one stream, each over all experts:
//   plan     row offsets and row-tile offsets of the groups, from tokens_per_expert on the device
//   shrink   h = lora_x A_e^T                        (kRows; N = r, so one column tile for r <= 64)
//   fused    y = [h | x] [s B_e | W_e]^T             (kRows; the LoRA k-tiles first, scaled by s)
// h is computed once per row and written out (the backward needs it) rather than recomputed by
// every column tile of the fused kernel: recomputing costs r / BN extra tensor-core work per tile
// (50% at r = 64, BN = 128), while the separate shrink reads x once more, which is a small
// memory-bound pass next to the compute-bound base GEMM.
//
// Backward, up to five:
//   plan
//   shrink   dh = s dy B_e                           (kRows, B_e read N-contiguous)
//   dB       dB_e = s dy_e^T h_e                     (kReduce over the expert's rows)
//   dA       dA_e = dh_e^T lora_x_e                  (kReduce)
//   fused    dx = [dh | dy] [A_e | W_e]              (kRows, NN; the LoRA part times the dropout mask)
//
// bf16/fp16 run on tensor cores (mma.sync m16n8k16, fp32 accumulate; the same code on sm_80 and
// sm_90, no wgmma), fp32/fp64 on CUDA cores.

#include <atomic>

#include "grouped_gemm.cuh"
#include "lora_expert_cuda.h"

namespace slmoe {
namespace cuda {
namespace {

using detail::GemmParams;
using detail::Group;
using detail::OperandDesc;

// Every kRows kernel uses this row tile: the plan's tile offsets are computed for it.
constexpr int kRowTile = 128;

// Tile configurations. Tensor cores: 128x128x32 with 8 warps (64x32 each) for the big fused GEMM;
// 128x64 with 4 warps for the rank-wide shrink and dB (N = r <= 64: one column tile), 64x128 for
// dA (M = r). Four stages keep three k-tiles in flight while one is consumed.
template <typename T, bool kTensorCores = (sizeof(T) == 2)>
struct Configs;

template <typename T>
struct Configs<T, true> {
  template <bool kBKContig>
  using Shrink = detail::MmaMath<T, kRowTile, 64, 32, 4, 1, 4, true, kBKContig>;
  template <bool kBKContig>
  using Fused = detail::MmaMath<T, kRowTile, 128, 32, 2, 4, 4, true, kBKContig>;
  using ReduceA = detail::MmaMath<T, 64, 128, 32, 2, 2, 4, false, false>;  // dA: M = r
  using ReduceB = detail::MmaMath<T, 128, 64, 32, 4, 1, 4, false, false>;  // dB: N = r
};

template <typename T>
struct Configs<T, false> {
  template <bool kBKContig>
  using Shrink = detail::SimtMath<T, kRowTile, 64, 16, 256, 3, true, kBKContig>;
  template <bool kBKContig>
  using Fused = Shrink<kBKContig>;
  using ReduceA = detail::SimtMath<T, 128, 64, 16, 256, 3, false, false>;
  using ReduceB = ReduceA;
};

template <typename P>
cudaError_t launch(void (*kernel)(P), int grid, int block, size_t smem, cudaStream_t stream, const P& params) {
#ifdef SLMOE_CUDA_EMU
  (void)stream;
  slmoe_emu::launch(dim3(grid), dim3(block), smem, [&] { kernel(params); });
#else
  kernel<<<grid, block, smem, stream>>>(params);
#endif
  return cudaGetLastError();
}

// Blocks of `kernel` that fit on the current device at once, after opting it in to `smem` bytes of
// dynamic shared memory (needed above 48 KiB; the attribute is per device). Queried once per
// kernel and device, then cached: these runtime calls cost microseconds, a small expert GEMM not
// much more. Threads racing on the first call compute the same value.
template <class Math, Group kGroup>
cudaError_t resident_blocks(int* out) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= 0 && device < kMaxDevices && (*out = cache[device].load(std::memory_order_relaxed)) > 0) {
    return cudaSuccess;
  }
  const void* kernel = reinterpret_cast<const void*>(&detail::grouped_gemm_kernel<Math, kGroup>);
  const size_t smem = Math::kSmemBytes;
  if (smem > 48 * 1024) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  int per_sm = 0, sms = 0;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, Math::kThreads, smem);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  if (per_sm < 1 || sms < 1) return cudaErrorInvalidConfiguration;  // does not fit on this device at all
  *out = per_sm * sms;
  if (device >= 0 && device < kMaxDevices) cache[device].store(*out, std::memory_order_relaxed);
  return cudaSuccess;
}

// Launches the persistent grouped GEMM: at most as many blocks as fit on the device at once, each
// walking the flat tile index; `max_tiles` (an upper bound of the true count, which only the
// device knows for kRows) caps the grid for small problems.
template <class Math, Group kGroup>
cudaError_t run_gemm(const GemmParams& p, int64_t max_tiles, cudaStream_t stream) {
  if (max_tiles <= 0) return cudaSuccess;
  int resident = 0;
  const cudaError_t err = resident_blocks<Math, kGroup>(&resident);
  if (err != cudaSuccess) return err;
  const int grid = static_cast<int>(max_tiles < resident ? max_tiles : resident);
  return launch(&detail::grouped_gemm_kernel<Math, kGroup>, grid, Math::kThreads, Math::kSmemBytes, stream, p);
}

// Upper bound of sum_e ceil(rows_e / kRowTile): every expert adds at most one partial tile.
int64_t max_row_tiles(int64_t T, int64_t E) { return detail::ceil_div(T, kRowTile) + E; }

bool aligned16(const void* ptr, int64_t elem_bytes, int64_t ld, int64_t expert_stride, int64_t row_stride) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && (ld * elem_bytes) % 16 == 0 &&
         (expert_stride * elem_bytes) % 16 == 0 && (row_stride * elem_bytes) % 16 == 0;
}

// A row-grouped [T, cols] tensor (moves with the expert's first row).
OperandDesc grouped(const void* ptr, int64_t cols, int64_t elem_bytes) {
  OperandDesc d;
  d.ptr = ptr;
  d.ld = cols;
  d.row_stride = cols;
  d.vec = aligned16(ptr, elem_bytes, cols, 0, cols);
  return d;
}

// A per-expert [E, rows, cols] tensor (moves with the expert index).
OperandDesc per_expert(const void* ptr, int64_t rows, int64_t cols, int64_t elem_bytes) {
  OperandDesc d;
  d.ptr = ptr;
  d.ld = cols;
  d.expert_stride = rows * cols;
  d.vec = aligned16(ptr, elem_bytes, cols, rows * cols, 0);
  return d;
}

cudaError_t run_plan(const int64_t* counts, int64_t E, int32_t* workspace, cudaStream_t stream) {
  detail::PlanParams pp;
  pp.counts = counts;
  pp.num_experts = static_cast<int>(E);
  pp.row_tile = kRowTile;
  pp.row_offsets = workspace;
  pp.tile_offsets = workspace + (E + 1);
  return launch(&detail::plan_kernel, 1, detail::kPlanThreads, 2 * detail::kPlanWarps * sizeof(int32_t), stream, pp);
}

GemmParams base_params(int64_t E, const int32_t* workspace) {
  GemmParams p;
  p.num_experts = static_cast<int>(E);
  p.row_offsets = workspace;
  p.tile_offsets = workspace + (E + 1);
  return p;
}

bool sizes_ok(int64_t T, int64_t E, int64_t d_in, int64_t d_out, int64_t r) {
  constexpr int64_t kMax = (int64_t{1} << 31) - 1;
  return T >= 0 && E >= 0 && d_in >= 0 && d_out >= 0 && r >= 0 && T < kMax && E < kMax && d_in < kMax &&
         d_out < kMax && r < kMax;
}

template <typename T>
cudaError_t fwd(const LoraFwdArgs& a, cudaStream_t stream) {
  using C = Configs<T>;
  const int64_t es = sizeof(T);
  cudaError_t err = run_plan(a.tokens_per_expert, a.E, a.workspace, stream);
  if (err != cudaSuccess) return err;
  const void* lora_x = a.lora_x != nullptr ? a.lora_x : a.x;

  if (a.r > 0) {  // h = lora_x A_e^T
    using Math = typename C::template Shrink<true>;
    GemmParams p = base_params(a.E, a.workspace);
    p.a = grouped(lora_x, a.d_in, es);
    p.b = per_expert(a.lora_a, a.r, a.d_in, es);  // (n = j, k = i) at A_e[j][i]: K-contiguous
    p.c = grouped(a.h, a.r, es);
    p.N = a.r;
    p.K = a.d_in;
    p.tiles_n = detail::ceil_div(p.N, Math::kBN);
    err = run_gemm<Math, Group::kRows>(p, max_row_tiles(a.T, a.E) * p.tiles_n, stream);
    if (err != cudaSuccess) return err;
  }

  {  // y = s (h B_e^T) + x W_e^T
    using Math = typename C::template Fused<true>;
    GemmParams p = base_params(a.E, a.workspace);
    p.a = grouped(a.x, a.d_in, es);
    p.b = per_expert(a.weight, a.d_out, a.d_in, es);  // (n = o, k = i) at W_e[o][i]
    if (a.r > 0) {
      p.p = grouped(a.h, a.r, es);
      p.q = per_expert(a.lora_b, a.d_out, a.r, es);  // (n = o, k = j) at B_e[o][j]
      p.Kp = a.r;
      p.pro_scale = a.scaling;
    }
    p.c = grouped(a.y, a.d_out, es);
    p.N = a.d_out;
    p.K = a.d_in;
    p.tiles_n = detail::ceil_div(p.N, Math::kBN);
    err = run_gemm<Math, Group::kRows>(p, max_row_tiles(a.T, a.E) * p.tiles_n, stream);
  }
  return err;
}

template <typename T>
cudaError_t bwd(const LoraBwdArgs& a, cudaStream_t stream) {
  using C = Configs<T>;
  const int64_t es = sizeof(T);
  const bool need_dh = a.r > 0 && (a.dx != nullptr || a.da != nullptr);
  // With T = 0 there is no row of dh to write (torch gives empty tensors a null pointer).
  if (need_dh && a.dh == nullptr && a.T > 0) return cudaErrorInvalidValue;
  cudaError_t err = run_plan(a.tokens_per_expert, a.E, a.workspace, stream);
  if (err != cudaSuccess) return err;

  if (need_dh) {  // dh = s dy B_e
    using Math = typename C::template Shrink<false>;
    GemmParams p = base_params(a.E, a.workspace);
    p.a = grouped(a.grad_y, a.d_out, es);
    p.b = per_expert(a.lora_b, a.d_out, a.r, es);  // (n = j, k = o) at B_e[o][j]: N-contiguous
    p.c = grouped(a.dh, a.r, es);
    p.out_scale = a.scaling;
    p.N = a.r;
    p.K = a.d_out;
    p.tiles_n = detail::ceil_div(p.N, Math::kBN);
    err = run_gemm<Math, Group::kRows>(p, max_row_tiles(a.T, a.E) * p.tiles_n, stream);
    if (err != cudaSuccess) return err;
  }

  if (a.db != nullptr) {  // dB_e = s dy_e^T h_e: C (o, j), A (m = o, k = row) = dy[row][o], B (n = j, k = row) = h[row][j]
    using Math = typename C::ReduceB;
    GemmParams p = base_params(a.E, a.workspace);
    p.a = grouped(a.grad_y, a.d_out, es);
    p.b = grouped(a.h, a.r, es);
    p.c = per_expert(a.db, a.d_out, a.r, es);
    p.out_scale = a.scaling;
    p.M = a.d_out;
    p.N = a.r;
    p.tiles_m = detail::ceil_div(p.M, Math::kBM);
    p.tiles_n = detail::ceil_div(p.N, Math::kBN);
    err = run_gemm<Math, Group::kReduce>(p, a.E * p.tiles_m * p.tiles_n, stream);
    if (err != cudaSuccess) return err;
  }

  if (a.da != nullptr) {  // dA_e = dh_e^T lora_x_e: C (j, i), A (m = j, k = row) = dh[row][j], B (n = i, k = row) = x[row][i]
    using Math = typename C::ReduceA;
    GemmParams p = base_params(a.E, a.workspace);
    p.a = grouped(a.dh, a.r, es);
    p.b = grouped(a.lora_x, a.d_in, es);
    p.c = per_expert(a.da, a.r, a.d_in, es);
    p.M = a.r;
    p.N = a.d_in;
    p.tiles_m = detail::ceil_div(p.M, Math::kBM);
    p.tiles_n = detail::ceil_div(p.N, Math::kBN);
    err = run_gemm<Math, Group::kReduce>(p, a.E * p.tiles_m * p.tiles_n, stream);
    if (err != cudaSuccess) return err;
  }

  if (a.dx != nullptr) {  // dx = (dh A_e) [* mask] + dy W_e
    using Math = typename C::template Fused<false>;
    GemmParams p = base_params(a.E, a.workspace);
    p.a = grouped(a.grad_y, a.d_out, es);
    p.b = per_expert(a.weight, a.d_out, a.d_in, es);  // (n = i, k = o) at W_e[o][i]: N-contiguous
    if (a.r > 0) {
      p.p = grouped(a.dh, a.r, es);
      p.q = per_expert(a.lora_a, a.r, a.d_in, es);  // (n = i, k = j) at A_e[j][i]: N-contiguous
      p.Kp = a.r;
      p.mask = a.lora_mask;
      p.ld_mask = a.d_in;
    }
    p.c = grouped(a.dx, a.d_in, es);
    p.N = a.d_in;
    p.K = a.d_out;
    p.tiles_n = detail::ceil_div(p.N, Math::kBN);
    err = run_gemm<Math, Group::kRows>(p, max_row_tiles(a.T, a.E) * p.tiles_n, stream);
  }
  return err;
}

}  // namespace

cudaError_t lora_grouped_linear_fwd(const LoraFwdArgs& a, cudaStream_t stream) {
  if (!sizes_ok(a.T, a.E, a.d_in, a.d_out, a.r)) return cudaErrorInvalidValue;
  switch (a.dtype) {
    case DType::kBFloat16: return fwd<__nv_bfloat16>(a, stream);
    case DType::kFloat16: return fwd<__half>(a, stream);
    case DType::kFloat32: return fwd<float>(a, stream);
    case DType::kFloat64: return fwd<double>(a, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t lora_grouped_linear_bwd(const LoraBwdArgs& a, cudaStream_t stream) {
  if (!sizes_ok(a.T, a.E, a.d_in, a.d_out, a.r)) return cudaErrorInvalidValue;
  switch (a.dtype) {
    case DType::kBFloat16: return bwd<__nv_bfloat16>(a, stream);
    case DType::kFloat16: return bwd<__half>(a, stream);
    case DType::kFloat32: return bwd<float>(a, stream);
    case DType::kFloat64: return bwd<double>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace slmoe
