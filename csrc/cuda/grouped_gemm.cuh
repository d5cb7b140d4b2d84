// A grouped GEMM over all experts in one launch, with an optional fused low-rank term.
//
// For every expert e one GEMM, tiled into BM x BN output tiles:
//
//     C_e[m, n] = out_scale * ( F(m, n) * sum_{j < Kp} P_e[m, j] Q_e[n, j]  +  sum_{k < K} A_e[m, k] B_e[n, k] )
//     F(m, n)   = pro_scale, times mask[m, n] when a mask is given
//
// The first sum is the LoRA term: it runs as ceil(Kp / BK) extra k-tiles *before* the base GEMM's
// k-tiles through the same pipeline and the same accumulators, i.e. [P | A] [Q | B]^T with K
// extended by Kp. After its last k-tile the accumulators hold exactly P Q^T and are multiplied by
// F in registers, then the base k-tiles add A B^T on top. One pass, one accumulator set, and the
// elementwise factor (the LoRA scale, or the dropout mask of dx) touches only the LoRA part.
//
// Two ways of grouping (Group):
//   kRows    M = the expert's rows (variable, from the row offsets), N and K fixed. Used for the
//            shrink h = x A^T, the fused y = x W^T + s h B^T, and their backward counterparts.
//   kReduce  M and N fixed, K = the expert's rows: the weight gradients dA_e = dh_e^T x_e and
//            dB_e = s dy_e^T h_e, reductions over each expert's rows. An expert without rows still
//            gets its tiles, so its gradient is written as exact zeros.
//
// Operands are described by a base pointer and three strides: element (i, j) of expert e (i the
// non-contiguous index) is at ptr + e * expert_stride + row0_e * row_stride + i * ld + j, where
// row0_e is the expert's first grouped row. Weights use expert_stride, grouped activations use
// row_stride; which index is contiguous is a compile-time property of the kernel (kAKContig,
// kBKContig below), so one kernel template covers the NT (forward), NN (dx) and TN (dA, dB) cases.
//
// Tile scheduler: a persistent grid walks a flat tile index t. kRows: t = row_tile * tiles_n + col
// tile, where the global row tiles are numbered expert after expert; the expert of a row tile is
// found by binary search in the prefix sums of ceil(rows_e / BM) that plan_kernel computes on the
// device (so the launch needs no host knowledge of the counts; the grid is an upper bound and each
// block reads the true tile count). kReduce: t = (e * tiles_m + tm) * tiles_n + tn.
//
// Math: MmaMath (bf16/fp16) uses ldmatrix + mma.sync m16n8k16 with fp32 accumulators; SimtMath
// (fp32/fp64) uses plain FMAs in the input precision. Both read the same shared-memory tiles,
// filled by the same multi-stage cp.async pipeline.
#pragma once

#include <cstdint>
#include <type_traits>

#include "ptx.cuh"

namespace slmoe {
namespace cuda {
namespace detail {

enum class Group { kRows, kReduce };

struct OperandDesc {
  const void* ptr = nullptr;
  int64_t ld = 0;             // elements between consecutive rows of the non-contiguous index
  int64_t expert_stride = 0;  // elements between expert e and e + 1
  int64_t row_stride = 0;     // elements per grouped row the expert starts at
  bool vec = false;           // 16-byte copies are legal: base, ld and both strides 16-byte aligned
};

struct GemmParams {
  OperandDesc a, b;     // base GEMM operands: A (m, k), B (n, k)
  OperandDesc p, q;     // LoRA operands: P (m, j), Q (n, j); p.ptr == nullptr: no LoRA term
  OperandDesc c;        // output (m, n); c.vec unused
  const void* mask = nullptr;  // [rows, N] like C (row-grouped), multiplies the LoRA term; or nullptr
  int64_t ld_mask = 0;
  double pro_scale = 1.0, out_scale = 1.0;
  int64_t M = 0;        // kReduce only: rows of every C_e
  int64_t N = 0;
  int64_t K = 0;        // kRows only: reduction length of the base GEMM
  int64_t Kp = 0;       // reduction length of the LoRA term
  int num_experts = 0;
  int64_t tiles_m = 0;  // kReduce only
  int64_t tiles_n = 0;
  const int32_t* row_offsets = nullptr;   // [E + 1] first grouped row of each expert
  const int32_t* tile_offsets = nullptr;  // [E + 1] first global row tile of each expert (kRows)
};

struct PlanParams {
  const int64_t* counts;  // [E]
  int num_experts;
  int row_tile;           // BM of the kRows kernels that read tile_offsets
  int32_t* row_offsets;   // [E + 1] out
  int32_t* tile_offsets;  // [E + 1] out
};

// ---------------------------------------------------------------------------------------------
// Element conversions. torch builds define __CUDA_NO_*_CONVERSIONS__, so no implicit ones.

template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }

template <typename T> __device__ __forceinline__ T from_acc(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <typename T> __device__ __forceinline__ T from_acc(double v) { return v; }

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------------
// Shared-memory tiles. An operand tile is stored with the same index contiguous as in global
// memory, so every copy moves whole 16-byte chunks: a K-contiguous operand as [rows][BK + pad],
// a row-contiguous one as [BK][rows + pad]. The pad (16 bytes) shifts consecutive rows by four
// banks, which makes the eight 16-byte row reads of an ldmatrix conflict-free.

template <typename T_, int BM_, int BN_, int BK_, int kStages_, int kThreads_, bool kAKContig_, bool kBKContig_>
struct TileShape {
  using T = T_;
  static constexpr int kBM = BM_, kBN = BN_, kBK = BK_, kStages = kStages_, kThreads = kThreads_;
  static constexpr bool kAKContig = kAKContig_, kBKContig = kBKContig_;
  static constexpr int kChunk = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte copy
  static constexpr int kPad = kChunk;
  static constexpr int kALd = kAKContig ? kBK + kPad : kBM + kPad;
  static constexpr int kBLd = kBKContig ? kBK + kPad : kBN + kPad;
  static constexpr int kAStage = kAKContig ? kBM * kALd : kBK * kALd;  // elements per stage
  static constexpr int kBStage = kBKContig ? kBN * kBLd : kBK * kBLd;
  static constexpr size_t kSmemBytes = sizeof(T) * static_cast<size_t>(kStages) * (kAStage + kBStage);
  static_assert(kBK % kChunk == 0 && kBM % kChunk == 0 && kBN % kChunk == 0, "tiles must be whole 16-byte chunks");
  static_assert(kStages >= 2, "the pipeline needs at least two stages");
};

// Copies the OUTER x INNER tile at (outer0, inner0) of a matrix whose INNER index is contiguous
// (element (o, i) at g[o * ld + i]) into smem[o * SMEM_LD + i]. Elements at o >= outer_lim or
// i >= inner_lim are written as zeros, so partial tiles at matrix edges, group ends and K tails
// contribute nothing to the MMA. vec: 16-byte cp.async (asynchronous, see the pipeline); else
// element loads and stores (synchronous), for operands whose rows are not 16-byte aligned.
template <typename T, int OUTER, int INNER, int SMEM_LD, int kThreads>
__device__ __forceinline__ void copy_tile(T* smem, const T* g, int64_t ld, bool vec, int64_t outer0, int64_t outer_lim,
                                          int64_t inner0, int64_t inner_lim) {
  constexpr int kChunk = 16 / static_cast<int>(sizeof(T));
  constexpr int kChunksPerRow = INNER / kChunk;
  constexpr int kChunks = OUTER * kChunksPerRow;
  for (int c = threadIdx.x; c < kChunks; c += kThreads) {
    const int o = c / kChunksPerRow, i = (c % kChunksPerRow) * kChunk;
    const int64_t go = outer0 + o, gi = inner0 + i;
    T* dst = smem + o * SMEM_LD + i;
    const bool row_in = go < outer_lim;
    if (vec) {
      int bytes = 0;
      const T* src = g;  // a valid, aligned address even when nothing is read
      if (row_in && gi < inner_lim) {
        const int64_t left = inner_lim - gi;
        bytes = static_cast<int>((left < kChunk ? left : kChunk) * static_cast<int64_t>(sizeof(T)));
        src = g + go * ld + gi;
      }
      ptx::cp_async_16(dst, src, bytes);
    } else {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        dst[j] = (row_in && gi + j < inner_lim) ? g[go * ld + gi + j] : T{};
      }
    }
  }
}

// Loads the BK-wide k-slice at k0 of a ROWS x K operand tile starting at row r0 (rows < rlim and
// k < klim are real), in the operand's layout.
template <class S, bool kKContig, int ROWS>
__device__ __forceinline__ void load_operand(typename S::T* smem, const typename S::T* g, const OperandDesc& d,
                                             int64_t r0, int64_t rlim, int64_t k0, int64_t klim) {
  using T = typename S::T;
  if constexpr (kKContig) {
    copy_tile<T, ROWS, S::kBK, S::kBK + S::kPad, S::kThreads>(smem, g, d.ld, d.vec, r0, rlim, k0, klim);
  } else {
    copy_tile<T, S::kBK, ROWS, ROWS + S::kPad, S::kThreads>(smem, g, d.ld, d.vec, k0, klim, r0, rlim);
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core math for bf16/fp16: WM x WN warps, each owning a (BM/WM) x (BN/WN) sub-tile made
// of 16x8 mma.sync tiles. Per 16-wide k-step a warp loads its A fragments (one ldmatrix.x4 per
// 16 rows) and B fragments (one ldmatrix.x4 per 16 columns) and issues MI x NI MMAs. Operands
// stored row-contiguous in shared memory are loaded with ldmatrix.trans, which yields the same
// fragments, so no layout needs a transpose in memory.

template <typename T_, int BM, int BN, int BK, int WM, int WN, int kStages, bool kAKContig, bool kBKContig>
struct MmaMath : TileShape<T_, BM, BN, BK, kStages, WM * WN * 32, kAKContig, kBKContig> {
  using S = TileShape<T_, BM, BN, BK, kStages, WM * WN * 32, kAKContig, kBKContig>;
  using T = T_;
  using Acc = float;
  static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value, "mma.sync path is bf16/fp16");
  static constexpr int kWarpM = BM / WM, kWarpN = BN / WN;
  static constexpr int kMI = kWarpM / 16, kNI = kWarpN / 8;
  static_assert(BM % WM == 0 && BN % WN == 0 && kWarpM % 16 == 0 && kWarpN % 16 == 0 && BK % 16 == 0,
                "warp tiles are whole 16x16 blocks");

  float acc[kMI][kNI][4];
  int lane, warp_m0, warp_n0;

  __device__ __forceinline__ MmaMath() {
    const int warp = threadIdx.x / 32;
    lane = threadIdx.x % 32;
    warp_m0 = (warp / WN) * kWarpM;
    warp_n0 = (warp % WN) * kWarpN;
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[mi][ni][q] = 0.f;
  }

  __device__ __forceinline__ void mma_ktile(const T* sA, const T* sB) {
    const int j = lane / 8, i = lane % 8;  // ldmatrix: lane supplies row i of 8x8 matrix j
#pragma unroll
    for (int ks = 0; ks < BK; ks += 16) {
      uint32_t a[kMI][4], b[kNI][2];
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi) {
        const int m = warp_m0 + mi * 16;
        if constexpr (kAKContig) {
          // sA[m][k]; matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15)
          ptx::ldmatrix_x4(a[mi], sA + (m + lane % 16) * S::kALd + ks + (lane / 16) * 8);
        } else {
          // sA[k][m], transposed on load; same four matrices in the same order
          ptx::ldmatrix_x4_trans(a[mi], sA + (ks + i + (j / 2) * 8) * S::kALd + m + (j % 2) * 8);
        }
      }
#pragma unroll
      for (int nj = 0; nj < kNI / 2; ++nj) {
        const int n = warp_n0 + nj * 16;
        uint32_t r[4];
        if constexpr (kBKContig) {
          // sB[n][k]; matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
          ptx::ldmatrix_x4(r, sB + (n + i + (j / 2) * 8) * S::kBLd + ks + (j % 2) * 8);
        } else {
          // sB[k][n], transposed on load; same four matrices in the same order
          ptx::ldmatrix_x4_trans(r, sB + (ks + i + (j % 2) * 8) * S::kBLd + n + (j / 2) * 8);
        }
        b[2 * nj][0] = r[0];
        b[2 * nj][1] = r[1];
        b[2 * nj + 1][0] = r[2];
        b[2 * nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
        for (int ni = 0; ni < kNI; ++ni) ptx::mma_m16n8k16<T>(acc[mi][ni], a[mi], b[ni]);
    }
  }

  // f(m, n, acc&) for every accumulator, (m, n) relative to the block tile.
  template <class F>
  __device__ __forceinline__ void for_each(F&& f) {
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          f(warp_m0 + mi * 16 + lane / 4 + (q / 2) * 8, warp_n0 + ni * 8 + (lane % 4) * 2 + q % 2, acc[mi][ni][q]);
        }
  }
};

// ---------------------------------------------------------------------------------------------
// CUDA-core math for fp32/fp64 (no tensor cores: tf32 would not meet fp32 accuracy, and fp64
// is for gradient checks). 16 x (kThreads/16) threads; thread (ty, tx) owns rows ty + TY*i and
// columns tx + 16*j, so a warp reads 16 different columns and a broadcast row per k.

template <typename T_, int BM, int BN, int BK, int kThreads, int kStages, bool kAKContig, bool kBKContig>
struct SimtMath : TileShape<T_, BM, BN, BK, kStages, kThreads, kAKContig, kBKContig> {
  using S = TileShape<T_, BM, BN, BK, kStages, kThreads, kAKContig, kBKContig>;
  using T = T_;
  using Acc = typename AccOf<T>::type;
  static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value, "SIMT path is fp32/fp64");
  static constexpr int kTX = 16, kTY = kThreads / kTX, kRM = BM / kTY, kRN = BN / kTX;
  static_assert(kThreads % kTX == 0 && BM % kTY == 0 && BN % kTX == 0, "thread grid must tile the block tile");

  Acc acc[kRM][kRN];
  int ty, tx;

  __device__ __forceinline__ SimtMath() {
    ty = threadIdx.x / kTX;
    tx = threadIdx.x % kTX;
#pragma unroll
    for (int i = 0; i < kRM; ++i)
#pragma unroll
      for (int j = 0; j < kRN; ++j) acc[i][j] = Acc(0);
  }

  __device__ __forceinline__ void mma_ktile(const T* sA, const T* sB) {
#pragma unroll 4
    for (int k = 0; k < BK; ++k) {
      Acc a[kRM], b[kRN];
#pragma unroll
      for (int i = 0; i < kRM; ++i) {
        const int m = ty + kTY * i;
        a[i] = kAKContig ? sA[m * S::kALd + k] : sA[k * S::kALd + m];
      }
#pragma unroll
      for (int j = 0; j < kRN; ++j) {
        const int n = tx + kTX * j;
        b[j] = kBKContig ? sB[n * S::kBLd + k] : sB[k * S::kBLd + n];
      }
#pragma unroll
      for (int i = 0; i < kRM; ++i)
#pragma unroll
        for (int j = 0; j < kRN; ++j) acc[i][j] += a[i] * b[j];
    }
  }

  template <class F>
  __device__ __forceinline__ void for_each(F&& f) {
#pragma unroll
    for (int i = 0; i < kRM; ++i)
#pragma unroll
      for (int j = 0; j < kRN; ++j) f(ty + kTY * i, tx + kTX * j, acc[i][j]);
  }
};

// ---------------------------------------------------------------------------------------------
// The kernel.

struct TileCoord {
  int e;
  int64_t row0;    // first grouped row of expert e
  int64_t M, K;    // this expert's GEMM sizes
  int64_t m0, n0;  // tile origin within C_e
};

// Largest e in [0, E) with offsets[e] <= t. With t below offsets[E], expert e owns t (empty
// experts have offsets[e] == offsets[e + 1] and are skipped by "largest").
__device__ __forceinline__ int find_expert(const int32_t* offsets, int E, int64_t t) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <Group kGroup, int BM, int BN>
__device__ __forceinline__ TileCoord locate(const GemmParams& p, int64_t t) {
  TileCoord c;
  if constexpr (kGroup == Group::kRows) {
    const int64_t row_tile = t / p.tiles_n;
    c.e = find_expert(p.tile_offsets, p.num_experts, row_tile);
    c.row0 = p.row_offsets[c.e];
    c.M = p.row_offsets[c.e + 1] - c.row0;
    c.K = p.K;
    c.m0 = (row_tile - p.tile_offsets[c.e]) * BM;
    c.n0 = (t % p.tiles_n) * BN;
  } else {
    const int64_t per_expert = p.tiles_m * p.tiles_n;
    c.e = static_cast<int>(t / per_expert);
    const int64_t rest = t % per_expert;
    c.row0 = p.row_offsets[c.e];
    c.M = p.M;
    c.K = p.row_offsets[c.e + 1] - c.row0;
    c.m0 = (rest / p.tiles_n) * BM;
    c.n0 = (rest % p.tiles_n) * BN;
  }
  return c;
}

template <typename T>
__device__ __forceinline__ const T* operand_base(const OperandDesc& d, const TileCoord& c) {
  return static_cast<const T*>(d.ptr) + c.e * d.expert_stride + c.row0 * d.row_stride;
}

// Launch bounds (threads, 1): a persistent block per SM is the unit the launcher plans with, so
// ptxas may use up to 255 registers per thread rather than spill to fit more blocks.
template <class Math, Group kGroup>
__global__ void __launch_bounds__(Math::kThreads, 1) grouped_gemm_kernel(const GemmParams p) {
  using T = typename Math::T;
  using Acc = typename Math::Acc;
  constexpr int BM = Math::kBM, BN = Math::kBN, BK = Math::kBK, kStages = Math::kStages;

  SLMOE_DYNAMIC_SMEM(smem_raw);
  T* const sA = reinterpret_cast<T*>(smem_raw);
  T* const sB = sA + kStages * Math::kAStage;

  const int64_t num_tiles = kGroup == Group::kRows
                                ? static_cast<int64_t>(p.tile_offsets[p.num_experts]) * p.tiles_n
                                : static_cast<int64_t>(p.num_experts) * p.tiles_m * p.tiles_n;
  const bool has_lora = p.p.ptr != nullptr;

  for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const TileCoord c = locate<kGroup, BM, BN>(p, t);
    const T* const ga = operand_base<T>(p.a, c);
    const T* const gb = operand_base<T>(p.b, c);
    const T* const gp = has_lora ? operand_base<T>(p.p, c) : nullptr;
    const T* const gq = has_lora ? operand_base<T>(p.q, c) : nullptr;

    // k-tiles 0 .. lora_tiles-1 come from (P, Q), the rest from (A, B).
    const int lora_tiles = has_lora ? static_cast<int>(ceil_div(p.Kp, BK)) : 0;
    const int k_tiles = lora_tiles + static_cast<int>(ceil_div(c.K, BK));

    auto load_stage = [&](int kt, int stage) {
      T* const dA = sA + stage * Math::kAStage;
      T* const dB = sB + stage * Math::kBStage;
      if (kt < lora_tiles) {
        const int64_t k0 = static_cast<int64_t>(kt) * BK;
        load_operand<Math, Math::kAKContig, BM>(dA, gp, p.p, c.m0, c.M, k0, p.Kp);
        load_operand<Math, Math::kBKContig, BN>(dB, gq, p.q, c.n0, p.N, k0, p.Kp);
      } else {
        const int64_t k0 = static_cast<int64_t>(kt - lora_tiles) * BK;
        load_operand<Math, Math::kAKContig, BM>(dA, ga, p.a, c.m0, c.M, k0, c.K);
        load_operand<Math, Math::kBKContig, BN>(dB, gb, p.b, c.n0, p.N, k0, c.K);
      }
    };

    Math math;

    // Multi-stage pipeline: k-tile kt lives in stage kt % kStages, and one commit group per k-tile
    // slot (empty past the end) keeps the group count in step with kt.
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) load_stage(s, s);
      ptx::cp_async_commit();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      // Groups 0..kt are complete once at most kStages - 2 are pending; the barrier publishes
      // every thread's copies and guarantees all warps are done with k-tile kt - 1.
      ptx::cp_async_wait<kStages - 2>();
      __syncthreads();
      // Refill the stage k-tile kt - 1 used: free, since every warp passed the barrier above.
      const int next = kt + kStages - 1;
      if (next < k_tiles) load_stage(next, next % kStages);
      ptx::cp_async_commit();
      math.mma_ktile(sA + (kt % kStages) * Math::kAStage, sB + (kt % kStages) * Math::kBStage);

      if (kt == lora_tiles - 1) {
        // The accumulators hold P_e Q_e^T: apply the LoRA factor before the base GEMM adds in.
        const Acc scale = static_cast<Acc>(p.pro_scale);
        const T* const mask = static_cast<const T*>(p.mask);
        math.for_each([&](int m, int n, Acc& v) {
          v *= scale;
          const int64_t gm = c.m0 + m, gn = c.n0 + n;
          if (mask != nullptr && gm < c.M && gn < p.N) v *= to_acc(mask[(c.row0 + gm) * p.ld_mask + gn]);
        });
      }
    }
    // Drain, and make sure every warp is out of the last k-tile before the next tile's prologue
    // overwrites shared memory.
    ptx::cp_async_wait<0>();
    __syncthreads();

    // Epilogue: scale and store, predicated on the tile's real extent.
    T* const gc = static_cast<T*>(const_cast<void*>(p.c.ptr)) + c.e * p.c.expert_stride + c.row0 * p.c.row_stride;
    const Acc out_scale = static_cast<Acc>(p.out_scale);
    math.for_each([&](int m, int n, Acc& v) {
      const int64_t gm = c.m0 + m, gn = c.n0 + n;
      if (gm < c.M && gn < p.N) gc[gm * p.c.ld + gn] = from_acc<T>(v * out_scale);
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Row offsets and row-tile offsets of the groups: exclusive prefix sums of counts[e] and of
// ceil(counts[e] / row_tile), computed by one block in chunks of kPlanThreads experts (warp
// shuffle scans, then a scan over the warp totals). Counts were validated by the caller.

constexpr int kPlanThreads = 256;
constexpr int kPlanWarps = kPlanThreads / 32;

__global__ void __launch_bounds__(kPlanThreads) plan_kernel(const PlanParams p) {
  SLMOE_DYNAMIC_SMEM(smem_raw);
  int32_t* const warp_rows = reinterpret_cast<int32_t*>(smem_raw);  // [kPlanWarps]
  int32_t* const warp_tiles = warp_rows + kPlanWarps;               // [kPlanWarps]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t carry_rows = 0, carry_tiles = 0;  // totals of the previous chunks, same in every thread
  if (threadIdx.x == 0) {
    p.row_offsets[0] = 0;
    p.tile_offsets[0] = 0;
  }
  for (int base = 0; base < p.num_experts; base += kPlanThreads) {
    const int e = base + static_cast<int>(threadIdx.x);
    int32_t rows = e < p.num_experts ? static_cast<int32_t>(p.counts[e]) : 0;
    int32_t tiles = (rows + p.row_tile - 1) / p.row_tile;
    for (int d = 1; d < 32; d *= 2) {  // inclusive scan within the warp
      const int32_t r = __shfl_up_sync(0xffffffffu, rows, d);
      const int32_t t = __shfl_up_sync(0xffffffffu, tiles, d);
      if (lane >= d) {
        rows += r;
        tiles += t;
      }
    }
    if (lane == 31) {
      warp_rows[warp] = rows;
      warp_tiles[warp] = tiles;
    }
    __syncthreads();
    int32_t before_rows = carry_rows, before_tiles = carry_tiles;
    for (int w = 0; w < kPlanWarps; ++w) {
      if (w < warp) {
        before_rows += warp_rows[w];
        before_tiles += warp_tiles[w];
      }
      carry_rows += warp_rows[w];
      carry_tiles += warp_tiles[w];
    }
    if (e < p.num_experts) {
      p.row_offsets[e + 1] = before_rows + rows;
      p.tile_offsets[e + 1] = before_tiles + tiles;
    }
    __syncthreads();  // warp totals are rewritten by the next chunk
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace slmoe
