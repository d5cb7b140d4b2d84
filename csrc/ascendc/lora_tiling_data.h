// Tiling data of the AscendC grouped LoRA expert kernel: the bytes the host planner (lora_tiling.cpp)
// writes and the kernel (lora_expert_kernel.cpp) reads from global memory.
//
// Plain old data only, the same layout on the host (x86_64/aarch64, g++) and on the AI Core
// (bisheng): fixed-width fields, every struct a multiple of 8 bytes, no pointers. The device
// addresses of the tensors are kernel arguments; the tiling names them by TensorId.
//
// One launch runs up to kMaxProblems grouped GEMMs ("problems"). For problem p and expert e:
//
//     C_e[M_e, N] = sum over terms t of  F_t (.) (A_t,e  B_t,e)      (fp32 accumulation)
//
// where F_t is a scalar (scale) and optionally an elementwise factor (mask) and A/B/C are row-major
// matrices found through OperandDesc. M_e and K_t,e are either fixed or the expert's row count
// (the "grouped" dimension). The output C is rounded to the kernel's dtype once, at the end.
//
// Layout of the buffer (offsets in bytes from its start, each 8-byte aligned):
//     KernelTiling                     header, fixed size
//     uint32_t coreTileBegin[numCores + 1]   core c runs tiles [coreTileBegin[c], coreTileBegin[c+1])
//     TileRec  tiles[numTiles]
//     uint64_t rowOffset[numExperts + 1]     first row of each expert's group; rowOffset[E] = T
#pragma once

#if !defined(__CCE_AICORE__) && !defined(__CCE_KT_TEST__)
#include <cstdint>
#endif

namespace slmoe_ascend {

constexpr uint32_t kTilingMagic = 0x534c4d41u;  // "SLMA"
constexpr uint32_t kTilingVersion = 1;
constexpr uint32_t kMaxProblems = 2;
constexpr uint32_t kMaxTerms = 2;
constexpr uint32_t kNoTensor = 0xffffffffu;

// The kernel's tensor arguments, in argument order.
enum TensorId : uint32_t {
  kTensorX = 0,    // [T, d_in]
  kTensorLoraX,    // [T, d_in] LoRA input (x, or x * dropout mask)
  kTensorWeight,   // [E, d_out, d_in]
  kTensorLoraA,    // [E, r, d_in]
  kTensorLoraB,    // [E, d_out, r]
  kTensorGradY,    // [T, d_out]
  kTensorMask,     // [T, d_in] dropout mask
  kTensorH,        // [T, r]
  kTensorDh,       // [T, r]
  kTensorY,        // [T, d_out]
  kTensorDx,       // [T, d_in]
  kTensorDa,       // [E, r, d_in]
  kTensorDb,       // [E, d_out, r]
  kNumTensors
};

// Storage order of a GEMM operand. A is the left factor [M, K], B the right factor [K, N].
enum Layout : uint32_t {
  kLayoutRowMajor = 0,  // A stored [M, K]; B stored [N, K] (as nn.Linear stores its weight); C [M, N]
  kLayoutTransposed,    // A stored [K, M]; B stored [K, N]
};

// Element (i, j) of expert e's stored matrix is at
//     tensor + (grouped ? rowOffset[e] * ld : e * exprStride) + i * ld + j        (in elements)
struct OperandDesc {
  uint32_t tensor;     // TensorId, or kNoTensor
  uint32_t layout;     // Layout
  uint32_t grouped;    // 1: the stored rows are the expert's token rows
  uint32_t ld;         // elements per stored row
  uint64_t exprStride; // elements from one expert's matrix to the next (not grouped)
};

struct TermDesc {
  OperandDesc a;
  OperandDesc b;
  OperandDesc mask;     // elementwise factor over C (same row/column indexing as C), or tensor = kNoTensor
  uint32_t kFixed;      // K, unless kGrouped
  uint32_t kGrouped;    // 1: K is the expert's row count (reductions over tokens: dA, dB)
  float scale;          // scalar factor of this term
  uint32_t pad;
};

struct ProblemDesc {
  uint32_t numTerms;    // 1 or 2
  uint32_t mGrouped;    // 1: M is the expert's row count
  uint32_t mFixed;      // M, unless mGrouped
  uint32_t n;           // N
  uint32_t baseM, baseN, baseK;  // cube tile: C block baseM x baseN, one Mmad step of K = baseK
  uint32_t kL1;         // K extent staged in L1 per copy (a multiple of baseK)
  uint32_t epiRows;     // rows of one vector-unit epilogue chunk
  uint32_t pad;
  TermDesc terms[kMaxTerms];
  OperandDesc c;        // output, row-major
};

struct TileRec {
  uint32_t problem;
  uint32_t expert;
  uint32_t mBlock;      // rows [mBlock * baseM, ...)
  uint32_t nBlock;      // columns [nBlock * baseN, ...)
};

struct KernelTiling {
  uint32_t magic;
  uint32_t version;
  uint32_t numProblems;
  uint32_t numExperts;
  uint32_t numCores;    // the launch's block dim: AI Cores (one cube + two vector units each)
  uint32_t numTiles;
  // TPipe buffer sizes in bytes, the maximum over the problems (each within its budget).
  uint32_t a1Bytes, b1Bytes;      // L1 staging of A and B, two buffers each
  uint32_t a2Bytes, b2Bytes;      // L0A / L0B, two buffers each
  uint32_t c1Bytes;               // L0C accumulator of one term, two buffers
  uint32_t accBytes;              // UB: fp32 accumulators of one epilogue chunk, all terms; two buffers
  uint32_t maskBytes;             // UB: mask chunk in the input dtype, two buffers (0: no mask)
  uint32_t maskF32Bytes;          // UB: mask chunk as fp32 (0: no mask)
  uint32_t outBytes;              // UB: output chunk in the input dtype, two buffers
  uint32_t wsSlotFloats;          // workspace floats of one slot: kMaxTerms * baseM * baseN, max over problems
  uint32_t coreTileBeginOffset;
  uint32_t tilesOffset;
  uint32_t rowOffsetOffset;
  uint32_t pad;
  ProblemDesc problems[kMaxProblems];
};

// Workspace slots per AI Core: the cube unit fills one while the vector units drain the other.
constexpr uint32_t kWorkspaceSlots = 2;

// The rules both sides apply to a tile, in one place (host: planning; AI Core: running).
#if defined(__CCE_AICORE__)
#define SLMOE_TILING_INLINE __aicore__ inline
#else
#define SLMOE_TILING_INLINE inline
#endif

SLMOE_TILING_INLINE uint32_t CeilDivU32(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

// Rows of expert e's output block (M_e), given the expert's row count.
SLMOE_TILING_INLINE uint32_t ProblemRows(const ProblemDesc& p, uint64_t expertRows) {
  return p.mGrouped ? static_cast<uint32_t>(expertRows) : p.mFixed;
}

// K of a term for expert e, given the expert's row count.
SLMOE_TILING_INLINE uint32_t TermK(const TermDesc& t, uint64_t expertRows) {
  return t.kGrouped ? static_cast<uint32_t>(expertRows) : t.kFixed;
}

// Offset (elements) of expert e's matrix within its tensor.
SLMOE_TILING_INLINE uint64_t OperandOrigin(const OperandDesc& d, uint32_t expert, uint64_t expertRowOffset) {
  return d.grouped ? expertRowOffset * d.ld : static_cast<uint64_t>(expert) * d.exprStride;
}

struct TileExtent {
  uint32_t m0, mLen;    // rows of C
  uint32_t n0, nLen;    // columns of C
};

SLMOE_TILING_INLINE TileExtent TileExtentOf(const ProblemDesc& p, const TileRec& t, uint32_t rows) {
  TileExtent x;
  x.m0 = t.mBlock * p.baseM;
  x.mLen = rows - x.m0 < p.baseM ? rows - x.m0 : p.baseM;
  x.n0 = t.nBlock * p.baseN;
  x.nLen = p.n - x.n0 < p.baseN ? p.n - x.n0 : p.baseN;
  return x;
}

}  // namespace slmoe_ascend
