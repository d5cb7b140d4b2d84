// AscendC kernel of the grouped LoRA expert op (schema in csrc/bindings.cpp), for Atlas A2/A3
// (dav-c220: 910B, 910_93), built by CANN's AscendC toolchain (CMakeLists.txt here).
//
// NOT compiled by CANN and NOT run on an NPU by this project's CI: there is no CANN here. This
// exact file is compiled with g++ against a host emulation of the AscendC API subset it uses
// (csrc/ascendc/emu) and checked there against an fp64 reference; see csrc/ascendc/README.md.
//
// One kernel runs every GEMM of the op. A launch carries up to two "problems" (lora_tiling_data.h):
//
//     forward   launch 1: h  = lora_x A_e^T                    launch 2: y  = x W_e^T + s h B_e^T
//     backward  launch 1: dh = s dy B_e,  dB_e = s dy_e^T h_e  launch 2: dx = dy W_e + (dh A_e) * mask,
//                                                                         dA_e = dh_e^T lora_x_e
//
// Each AI Core is one cube unit (AIC) and two vector units (AIV), KERNEL_TYPE_MIX_AIC_1_2:
//
//   AIC  for each tile (expert, row block, column block) of its list, for each term:
//          GM --DataCopy ND2NZ--> L1 (A1/B1, two buffers) --LoadData--> L0A/L0B (A2/B2, two buffers)
//          --Mmad, fp32 accumulation over K--> L0C (CO1)
//        then Fixpipe L0C -> a fp32 workspace slot in GM and CrossCoreSetFlag "tile ready".
//   AIV  for the same tiles, each vector unit half of the rows: CrossCoreWaitFlag "tile ready",
//        workspace -> UB (VECIN, two buffers), scale / mask / sum in fp32, Cast to bf16/fp16 (RINT),
//        UB -> GM (VECOUT), CrossCoreSetFlag "slot free". Two workspace slots let the cube unit
//        compute the next tile while the vector units finish this one.
// Tiles of dA/dB for experts without rows ("zero tiles") are only written, as zeros, by the AIVs.
//
// The tile lists come from the host planner (lora_tiling.cpp), which knows the group sizes.
#include "kernel_operator.h"
#include "lora_expert_ascend.h"
#include "lora_tiling_data.h"

// csrc/ascendc/emu compiles injected bugs in with SLMOE_MUTANT(n); real builds never define it.
#ifndef SLMOE_MUTANT
#define SLMOE_MUTANT(n) false
#endif

namespace slmoe_ascend {
namespace {

using AscendC::GlobalTensor;
using AscendC::LocalTensor;
using AscendC::TPosition;

constexpr uint32_t kC0 = 16;              // b16 elements per 32-byte block; cube fractals are 16 x 16
constexpr uint32_t kFractal = kC0 * kC0;  // elements of one 512-byte fractal
constexpr uint32_t kAivPerAic = 2;
constexpr uint8_t kCubeVectorMode = 2;    // CrossCoreSetFlag mode 2: the AIC and both AIVs of one AI Core
constexpr uint16_t kFlagTileReady = 0;    // AIC -> AIVs: a workspace slot holds a finished tile
constexpr uint16_t kFlagSlotFree = 1;     // AIVs -> AIC: the vector units have read the slot

__aicore__ inline uint32_t Align16(uint32_t v) { return (v + kC0 - 1) / kC0 * kC0; }
__aicore__ inline uint32_t MinU32(uint32_t a, uint32_t b) { return a < b ? a : b; }

// The tiling header, copied from GM once; the per-core lists stay in GM and are read per tile.
struct TilingView {
  KernelTiling h;
  __gm__ const uint32_t* coreBegin;
  __gm__ const uint32_t* tiles;      // TileRec as 4 words
  __gm__ const uint64_t* rowOffset;

  __aicore__ inline void Load(GM_ADDR tiling) {
    // Byte copy: character types may alias the struct, so no strict-aliasing assumption breaks it.
    uint8_t* dst = reinterpret_cast<uint8_t*>(&h);
    for (uint32_t i = 0; i < sizeof(KernelTiling); ++i) dst[i] = tiling[i];
    coreBegin = reinterpret_cast<__gm__ const uint32_t*>(tiling + h.coreTileBeginOffset);
    tiles = reinterpret_cast<__gm__ const uint32_t*>(tiling + h.tilesOffset);
    rowOffset = reinterpret_cast<__gm__ const uint64_t*>(tiling + h.rowOffsetOffset);
  }
  // Tiles [begin, end) of AI Core `core`.
  __aicore__ inline void CoreRange(uint32_t core, uint32_t& begin, uint32_t& end) const {
    begin = coreBegin[core];
    end = coreBegin[core + 1];
    if (SLMOE_MUTANT(20) && core + 1 < h.numCores) ++end;  // mutant 20: also runs the next core's first tile
  }
  __aicore__ inline TileRec Tile(uint32_t i) const {
    TileRec t;
    t.problem = tiles[4 * i];
    t.expert = tiles[4 * i + 1];
    t.mBlock = tiles[4 * i + 2];
    t.nBlock = tiles[4 * i + 3];
    return t;
  }
};

// Everything both units need to know about one tile.
struct Tile {
  const ProblemDesc* p;
  uint32_t expert;
  uint64_t rowOffset;          // first row of the expert's group
  uint64_t expertRows;
  TileExtent x;                // rows [x.m0, x.m0 + x.mLen), columns [x.n0, x.n0 + x.nLen) of C
  uint32_t k[kMaxTerms];       // K of each term; 0: the term contributes nothing
  uint32_t activeTerms;
};

__aicore__ inline Tile MakeTile(const TilingView& tv, const TileRec& rec) {
  Tile t;
  t.p = &tv.h.problems[rec.problem];
  t.expert = rec.expert;
  const uint32_t e = rec.expert + (SLMOE_MUTANT(5) ? 1 : 0);  // mutant 5: neighbour's group offset
  t.rowOffset = tv.rowOffset[e];
  t.expertRows = tv.rowOffset[rec.expert + 1] - tv.rowOffset[rec.expert];
  t.x = TileExtentOf(*t.p, rec, ProblemRows(*t.p, t.expertRows));
  if (SLMOE_MUTANT(1) && t.x.mLen > 1) t.x.mLen -= 1;  // mutant 1: off-by-one row tail
  t.activeTerms = 0;
  for (uint32_t i = 0; i < t.p->numTerms; ++i) {
    t.k[i] = TermK(t.p->terms[i], t.expertRows);
    if (t.k[i] > 0) ++t.activeTerms;
  }
  return t;
}

// Workspace of one AI Core's slot: term i of the slot's tile at i * baseM * baseN floats, rows of
// Align16(nLen) floats (64-byte multiples, so the vector units can copy whole row blocks).
__aicore__ inline uint64_t SlotOffset(const KernelTiling& h, uint32_t core, uint32_t slot) {
  const uint32_t s = SLMOE_MUTANT(10) ? 0 : slot;  // mutant 10: both tiles in flight share slot 0
  return (static_cast<uint64_t>(core) * kWorkspaceSlots + s) * h.wsSlotFloats;
}

__aicore__ inline uint32_t WorkspaceLd(uint32_t nLen) { return SLMOE_MUTANT(21) ? nLen : Align16(nLen); }

// ---------------------------------------------------------------------------------------------
// Cube unit: GM -> L1 -> L0A/L0B -> Mmad -> L0C -> Fixpipe -> workspace.
template <typename T>
class CubeUnit {
 public:
  __aicore__ inline void Init(const TilingView* tv, GM_ADDR const* tensors, GM_ADDR workspace,
                              AscendC::TPipe* pipe) {
    tv_ = tv;
    tensors_ = tensors;
    ws_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(workspace));
    core_ = static_cast<uint32_t>(AscendC::GetBlockIdx());
    const KernelTiling& h = tv_->h;
    pipe->InitBuffer(a1_, 2, h.a1Bytes);
    pipe->InitBuffer(b1_, 2, h.b1Bytes);
    pipe->InitBuffer(a2_, 2, h.a2Bytes);
    pipe->InitBuffer(b2_, 2, h.b2Bytes);
    // Two accumulators: both terms of a two-term tile, or two one-term tiles in flight.
    pipe->InitBuffer(c1_, SLMOE_MUTANT(3) ? 1 : 2, h.c1Bytes);  // mutant 3: one CO1 buffer
  }

  __aicore__ inline void Run() {
    uint32_t begin, end;
    tv_->CoreRange(core_, begin, end);
    uint32_t issued = 0;  // tiles handed to the vector units
    for (uint32_t i = begin; i < end; ++i) {
      const Tile t = MakeTile(*tv_, tv_->Tile(i));
      if (t.activeTerms == 0) continue;  // zero tile: the vector units write zeros
      LocalTensor<float> acc[kMaxTerms];
      for (uint32_t term = 0; term < t.p->numTerms; ++term) {
        if (t.k[term] == 0) continue;
        acc[term] = c1_.AllocTensor<float>();
        ComputeTerm(t, term, acc[term]);
        c1_.EnQue(acc[term]);
      }
      // The slot of tile `issued` was last used by tile `issued - 2`: wait until its AIVs read it.
      if (issued >= kWorkspaceSlots && !SLMOE_MUTANT(9)) {  // mutant 9: overwrite a slot still being read
        AscendC::CrossCoreWaitFlag<kCubeVectorMode, PIPE_FIX>(kFlagSlotFree);
      }
      const uint64_t slot = SlotOffset(tv_->h, core_, issued % kWorkspaceSlots);
      for (uint32_t term = 0; term < t.p->numTerms; ++term) {
        if (t.k[term] == 0) continue;
        acc[term] = c1_.DeQue<float>();
        CopyOut(t, acc[term], slot + static_cast<uint64_t>(term) * t.p->baseM * t.p->baseN);
        c1_.FreeTensor(acc[term]);
      }
      AscendC::CrossCoreSetFlag<kCubeVectorMode, PIPE_FIX>(kFlagTileReady);
      ++issued;
    }
    // Every "slot free" the vector units raise is consumed, so the flag counters end at zero.
    const uint32_t pending = issued < kWorkspaceSlots ? issued : kWorkspaceSlots;
    for (uint32_t i = 0; i < pending && !SLMOE_MUTANT(24); ++i) {  // mutant 24: flags left set
      AscendC::CrossCoreWaitFlag<kCubeVectorMode, PIPE_FIX>(kFlagSlotFree);
    }
  }

 private:
  // M of the Mmad: M = 1 would switch the cube to GEMV, which reads L0A as ND, not as the ZZ
  // fractals LoadData wrote; compute a 16-row block instead and store only the valid row.
  __aicore__ inline uint32_t MmadM(uint32_t mLen) const { return (mLen == 1 && !SLMOE_MUTANT(11)) ? kC0 : mLen; }

  // acc = sum over K of A B for one term: K staged through L1 in kL1 chunks, each cut into baseK
  // steps for L0A/L0B; fp32 accumulation in L0C.
  __aicore__ inline void ComputeTerm(const Tile& t, uint32_t term, LocalTensor<float>& acc) {
    const ProblemDesc& p = *t.p;
    const TermDesc& d = p.terms[term];
    const uint32_t K = t.k[term];
    const uint32_t mmadM = MmadM(t.x.mLen);
    GlobalTensor<T> a, b;
    a.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(tensors_[d.a.tensor]) + OperandOrigin(d.a, t.expert, t.rowOffset));
    b.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(tensors_[d.b.tensor]) + OperandOrigin(d.b, t.expert, t.rowOffset));
    for (uint32_t kc = 0; kc < K; kc += p.kL1) {
      const uint32_t kcLen = MinU32(p.kL1, K - kc);
      LocalTensor<T> a1 = a1_.AllocTensor<T>();
      CopyA(a1, a, d.a, t.x, kc, kcLen);
      a1_.EnQue(a1);
      LocalTensor<T> b1 = b1_.AllocTensor<T>();
      CopyB(b1, b, d.b, t.x, kc, kcLen);
      b1_.EnQue(b1);
      a1 = a1_.DeQue<T>();
      b1 = b1_.DeQue<T>();
      for (uint32_t ks = 0; ks < kcLen; ks += p.baseK) {
        const uint32_t ksLen = SLMOE_MUTANT(2) ? p.baseK : MinU32(p.baseK, kcLen - ks);  // mutant 2: K tail
        LocalTensor<T> a2 = a2_.AllocTensor<T>();
        SplitA(a2, a1, d.a.layout, t.x.mLen, kcLen, ks, ksLen);
        a2_.EnQue(a2);
        LocalTensor<T> b2 = b2_.AllocTensor<T>();
        SplitB(b2, b1, d.b.layout, t.x.nLen, kcLen, ks, ksLen);
        b2_.EnQue(b2);
        a2 = a2_.DeQue<T>();
        b2 = b2_.DeQue<T>();
        AscendC::MmadParams mp;
        mp.m = static_cast<uint16_t>(mmadM);
        mp.n = static_cast<uint16_t>(t.x.nLen);
        mp.k = static_cast<uint16_t>(ksLen);
        mp.cmatrixInitVal = (kc == 0 && ks == 0);  // first step overwrites, later steps accumulate
        mp.cmatrixSource = false;
        AscendC::Mmad(acc, a2, b2, mp);
        // Small Mmads accumulating into one L0C block must be ordered explicitly (CANN's Mmad rule).
        if ((mmadM / 16) * (t.x.nLen / 16) < 10 && !SLMOE_MUTANT(19)) AscendC::PipeBarrier<PIPE_M>();
        a2_.FreeTensor(a2);
        b2_.FreeTensor(b2);
      }
      a1_.FreeTensor(a1);
      b1_.FreeTensor(b1);
    }
  }

  // A rows [m0, m0 + mLen) x K [kc, kc + kcLen) into L1 as NZ: 16-column blocks of Align16(rows)
  // rows each (a stored [K, M] operand lands as its [kcLen x mLen] block, transposed later).
  __aicore__ inline void CopyA(LocalTensor<T>& dst, const GlobalTensor<T>& src, const OperandDesc& d,
                               const TileExtent& x, uint32_t kc, uint32_t kcLen) {
    AscendC::Nd2NzParams nz;
    nz.ndNum = 1;
    nz.srcNdMatrixStride = 0;
    nz.srcDValue = static_cast<uint16_t>(d.ld);
    nz.dstNzNStride = 1;
    nz.dstNzMatrixStride = 0;
    if (d.layout == kLayoutRowMajor) {
      nz.nValue = static_cast<uint16_t>(x.mLen);
      nz.dValue = static_cast<uint16_t>(kcLen);
      nz.dstNzC0Stride = static_cast<uint16_t>(Align16(x.mLen));
      AscendC::DataCopy(dst, src[static_cast<uint64_t>(x.m0) * d.ld + kc], nz);
    } else {
      nz.nValue = static_cast<uint16_t>(kcLen);
      nz.dValue = static_cast<uint16_t>(x.mLen);
      nz.dstNzC0Stride = static_cast<uint16_t>(Align16(kcLen));
      AscendC::DataCopy(dst, src[static_cast<uint64_t>(kc) * d.ld + x.m0], nz);
    }
  }

  // B K [kc, kc + kcLen) x columns [n0, n0 + nLen) into L1 as NZ (stored [N, K]: as its [nLen x kcLen]
  // block; stored [K, N]: as its [kcLen x nLen] block).
  __aicore__ inline void CopyB(LocalTensor<T>& dst, const GlobalTensor<T>& src, const OperandDesc& d,
                               const TileExtent& x, uint32_t kc, uint32_t kcLen) {
    AscendC::Nd2NzParams nz;
    nz.ndNum = 1;
    nz.srcNdMatrixStride = 0;
    nz.srcDValue = static_cast<uint16_t>(d.ld);
    nz.dstNzNStride = 1;
    nz.dstNzMatrixStride = 0;
    if (d.layout == kLayoutRowMajor) {
      nz.nValue = static_cast<uint16_t>(x.nLen);
      nz.dValue = static_cast<uint16_t>(kcLen);
      nz.dstNzC0Stride = static_cast<uint16_t>(Align16(x.nLen));
      AscendC::DataCopy(dst, src[static_cast<uint64_t>(x.n0) * d.ld + kc], nz);
    } else {
      nz.nValue = static_cast<uint16_t>(kcLen);
      nz.dValue = static_cast<uint16_t>(x.nLen);
      nz.dstNzC0Stride = static_cast<uint16_t>(Align16(kcLen));
      AscendC::DataCopy(dst, src[static_cast<uint64_t>(kc) * d.ld + x.n0], nz);
    }
  }

  // K step [ks, ks + ksLen) of the L1 block into L0A as ZZ: fractal (row block, k block) at
  // row block * ksBlocks + k block, each row-major.
  __aicore__ inline void SplitA(LocalTensor<T>& dst, const LocalTensor<T>& src, uint32_t layout, uint32_t mLen,
                                uint32_t kcLen, uint32_t ks, uint32_t ksLen) {
    const uint32_t mBlocks = Align16(mLen) / kC0;
    const uint32_t ksBlocks = Align16(ksLen) / kC0;
    AscendC::LoadData2DParams ld;
    ld.repeatTimes = static_cast<uint8_t>(ksBlocks);
    ld.dstGap = 0;
    for (uint32_t mb = 0; mb < mBlocks; ++mb) {
      if (layout == kLayoutRowMajor) {
        // L1 NZ of [mLen x kcLen]: fractal (mb, kb) at kb * mBlocks + mb.
        ld.srcStride = static_cast<uint16_t>(mBlocks);
        ld.ifTranspose = false;
        AscendC::LoadData(dst[mb * ksBlocks * kFractal], src[((ks / kC0) * mBlocks + mb) * kFractal], ld);
      } else {
        // L1 NZ of [kcLen x mLen]: fractal (kb, mb) at mb * kcBlocks + kb; transpose each fractal.
        const uint32_t kcBlocks = Align16(kcLen) / kC0;
        ld.srcStride = 1;
        ld.ifTranspose = !SLMOE_MUTANT(13);  // mutant 13: transposed A loaded as is
        AscendC::LoadData(dst[mb * ksBlocks * kFractal], src[(mb * kcBlocks + ks / kC0) * kFractal], ld);
      }
    }
  }

  // K step [ks, ks + ksLen) of the L1 block into L0B as ZN: fractal (k block, column block) at
  // k block * nBlocks + column block, each column-major.
  __aicore__ inline void SplitB(LocalTensor<T>& dst, const LocalTensor<T>& src, uint32_t layout, uint32_t nLen,
                                uint32_t kcLen, uint32_t ks, uint32_t ksLen) {
    const uint32_t nBlocks = Align16(nLen) / kC0;
    const uint32_t ksBlocks = Align16(ksLen) / kC0;
    AscendC::LoadData2DParams ld;
    ld.repeatTimes = static_cast<uint8_t>(nBlocks);
    ld.dstGap = 0;
    for (uint32_t i = 0; i < ksBlocks; ++i) {
      const uint32_t kb = ks / kC0 + i;
      if (layout == kLayoutRowMajor) {
        // L1 NZ of [nLen x kcLen]: fractal (nb, kb) at kb * nBlocks + nb, already column-major per (k, n).
        ld.srcStride = 1;
        ld.ifTranspose = false;
        AscendC::LoadData(dst[i * nBlocks * kFractal], src[kb * nBlocks * kFractal], ld);
      } else {
        // L1 NZ of [kcLen x nLen]: fractal (kb, nb) at nb * kcBlocks + kb; transpose each fractal.
        const uint32_t kcBlocks = Align16(kcLen) / kC0;
        ld.srcStride = static_cast<uint16_t>(kcBlocks);
        ld.ifTranspose = !SLMOE_MUTANT(22);  // mutant 22: [K, N] B loaded as is
        AscendC::LoadData(dst[i * nBlocks * kFractal], src[kb * kFractal], ld);
      }
    }
  }

  // L0C (NZ, Align16(Mmad M) rows per 16-column block) -> workspace rows of WorkspaceLd(nLen) floats.
  __aicore__ inline void CopyOut(const Tile& t, const LocalTensor<float>& acc, uint64_t wsOffset) {
    AscendC::FixpipeParamsV220 fp;
    fp.nSize = static_cast<uint16_t>(t.x.nLen);
    fp.mSize = static_cast<uint16_t>(t.x.mLen);
    fp.srcStride = static_cast<uint16_t>(SLMOE_MUTANT(12) ? t.p->baseM : Align16(MmadM(t.x.mLen)));  // mutant 12
    fp.dstStride = WorkspaceLd(t.x.nLen);
    fp.quantPre = QuantMode_t::NoQuant;
    fp.ndNum = 1;
    fp.srcNdStride = 0;
    fp.dstNdStride = 0;
    AscendC::Fixpipe<float, float, AscendC::CFG_ROW_MAJOR>(ws_[wsOffset], acc, fp);
  }

  const TilingView* tv_;
  GM_ADDR const* tensors_;
  GlobalTensor<float> ws_;
  uint32_t core_;
  AscendC::TQue<TPosition::A1, 1> a1_;
  AscendC::TQue<TPosition::B1, 1> b1_;
  AscendC::TQue<TPosition::A2, 1> a2_;
  AscendC::TQue<TPosition::B2, 1> b2_;
  AscendC::TQue<TPosition::CO1, kMaxTerms> c1_;  // a two-term tile enqueues both accumulators
};

// ---------------------------------------------------------------------------------------------
// Vector units: workspace -> UB -> factors and sum in fp32 -> cast -> C. Each of the two vector
// units of an AI Core takes half of every tile's rows.
template <typename T>
class VectorUnit {
 public:
  __aicore__ inline void Init(const TilingView* tv, GM_ADDR const* tensors, GM_ADDR workspace,
                              AscendC::TPipe* pipe) {
    tv_ = tv;
    tensors_ = tensors;
    ws_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(workspace));
    const uint32_t block = static_cast<uint32_t>(AscendC::GetBlockIdx());
    core_ = block / kAivPerAic;
    sub_ = SLMOE_MUTANT(23) ? 0 : static_cast<uint32_t>(AscendC::GetSubBlockIdx());  // mutant 23
    const KernelTiling& h = tv_->h;
    pipe->InitBuffer(acc_, 2, h.accBytes);
    pipe->InitBuffer(out_, 2, h.outBytes);
    if (h.maskBytes > 0) {
      pipe->InitBuffer(mask_, 2, h.maskBytes);
      pipe->InitBuffer(maskF32_, h.maskF32Bytes);
    }
  }

  __aicore__ inline void Run() {
    uint32_t begin, end;
    tv_->CoreRange(core_, begin, end);
    uint32_t consumed = 0;  // tiles received from the cube unit, in its order
    for (uint32_t i = begin; i < end; ++i) {
      const Tile t = MakeTile(*tv_, tv_->Tile(i));
      const uint32_t half = (t.x.mLen + 1) / 2;
      const uint32_t r0 = MinU32(sub_ * half, t.x.mLen);
      const uint32_t r1 = MinU32(r0 + half, t.x.mLen);
      if (t.activeTerms == 0) {
        if (!SLMOE_MUTANT(18)) WriteZeros(t, r0, r1);  // mutant 18: experts without rows keep garbage
        continue;
      }
      if (!SLMOE_MUTANT(8)) {  // mutant 8: read the workspace before the cube unit wrote it
        AscendC::CrossCoreWaitFlag<kCubeVectorMode, PIPE_MTE2>(kFlagTileReady);
      }
      const uint64_t slot = SlotOffset(tv_->h, core_, consumed % kWorkspaceSlots);
      for (uint32_t r = r0; r < r1; r += t.p->epiRows) {
        Epilogue(t, slot, r, MinU32(t.p->epiRows, r1 - r));
      }
      // The slot's last reads were issued on MTE2; the flag is raised once they are done.
      AscendC::CrossCoreSetFlag<kCubeVectorMode, PIPE_MTE2>(kFlagSlotFree);
      ++consumed;
    }
  }

 private:
  // Rows [r, r + rows) of the tile: C = sum over terms of F_t (.) acc_t, rounded once.
  __aicore__ inline void Epilogue(const Tile& t, uint64_t slot, uint32_t r, uint32_t rows) {
    const ProblemDesc& p = *t.p;
    const uint32_t ld = WorkspaceLd(t.x.nLen);
    const uint32_t count = rows * ld;
    // Copy in: every active term's rows; the mask rows of a masked term.
    LocalTensor<float> acc = acc_.AllocTensor<float>();
    uint32_t used = 0;
    for (uint32_t term = 0; term < p.numTerms; ++term) {
      if (t.k[term] == 0) continue;
      const uint64_t src = slot + static_cast<uint64_t>(term) * p.baseM * p.baseN + static_cast<uint64_t>(r) * ld;
      AscendC::DataCopy(acc[used * count], ws_[src], count);
      ++used;
    }
    acc_.EnQue(acc);
    int32_t maskedTerm = -1;
    for (uint32_t term = 0; term < p.numTerms; ++term) {
      if (t.k[term] > 0 && p.terms[term].mask.tensor != kNoTensor && !SLMOE_MUTANT(14)) maskedTerm = term;
    }
    LocalTensor<T> mask;
    if (maskedTerm >= 0) {
      mask = mask_.AllocTensor<T>();
      CopyInRows(mask, p.terms[maskedTerm].mask, t, r, rows);
      mask_.EnQue(mask);
    }

    // Compute in fp32: each term times its factors, then the sum.
    acc = acc_.DeQue<float>();
    used = 0;
    for (uint32_t term = 0; term < p.numTerms; ++term) {
      if (t.k[term] == 0) continue;
      LocalTensor<float> part = acc[used * count];
      if (static_cast<int32_t>(term) == maskedTerm) {
        LocalTensor<T> m = SLMOE_MUTANT(6) ? mask : mask_.DeQue<T>();  // mutant 6: use before DeQue
        LocalTensor<float> mf = maskF32_.Get<float>();
        AscendC::Cast(mf, m, AscendC::RoundMode::CAST_NONE, count);
        if (!SLMOE_MUTANT(7)) AscendC::PipeBarrier<PIPE_V>();  // mutant 7: Mul reads mf too early
        AscendC::Mul(part, part, mf, count);
        AscendC::PipeBarrier<PIPE_V>();
        mask_.FreeTensor(m);
      }
      const float scale = SLMOE_MUTANT(4) ? 1.0f : p.terms[term].scale;  // mutant 4: scaling dropped
      if (scale != 1.0f) {
        AscendC::Muls(part, part, scale, count);
        AscendC::PipeBarrier<PIPE_V>();
      }
      if (used > 0) {
        AscendC::Add(acc, acc, part, count);
        AscendC::PipeBarrier<PIPE_V>();
      }
      ++used;
    }
    // A per-row factor (e.g. router probabilities) would multiply `acc` here, before the cast.
    LocalTensor<T> out = out_.AllocTensor<T>();
    AscendC::Cast(out, acc, SLMOE_MUTANT(15) ? AscendC::RoundMode::CAST_NONE : AscendC::RoundMode::CAST_RINT, count);
    out_.EnQue(out);
    acc_.FreeTensor(acc);
    CopyOutRows(t, r, rows);
  }

  __aicore__ inline void WriteZeros(const Tile& t, uint32_t r0, uint32_t r1) {
    for (uint32_t r = r0; r < r1; r += t.p->epiRows) {
      const uint32_t rows = MinU32(t.p->epiRows, r1 - r);
      LocalTensor<T> out = out_.AllocTensor<T>();
      AscendC::Duplicate(out, static_cast<T>(0.0f), rows * Align16(t.x.nLen));
      out_.EnQue(out);
      CopyOutRows(t, r, rows);
    }
  }

  // The output chunk (rows of Align16(nLen) elements in UB) to C, nLen elements per row.
  __aicore__ inline void CopyOutRows(const Tile& t, uint32_t r, uint32_t rows) {
    const OperandDesc& c = t.p->c;
    GlobalTensor<T> dst;
    dst.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(tensors_[c.tensor]) + OperandOrigin(c, t.expert, t.rowOffset));
    LocalTensor<T> out = out_.DeQue<T>();
    AscendC::DataCopyExtParams cp;
    cp.blockCount = static_cast<uint16_t>(rows);
    cp.blockLen = t.x.nLen * static_cast<uint32_t>(sizeof(T));
    cp.srcStride = 0;  // UB rows are blockLen rounded up to 32 bytes
    cp.dstStride = (c.ld - t.x.nLen) * static_cast<uint32_t>(sizeof(T));
    AscendC::DataCopyPad(dst[static_cast<uint64_t>(t.x.m0 + r) * c.ld + t.x.n0], out, cp);
    out_.FreeTensor(out);
  }

  // Rows of an elementwise factor laid out like C into UB, padded to 32 bytes per row.
  __aicore__ inline void CopyInRows(LocalTensor<T>& dst, const OperandDesc& d, const Tile& t, uint32_t r,
                                    uint32_t rows) {
    GlobalTensor<T> src;
    src.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(tensors_[d.tensor]) + OperandOrigin(d, t.expert, t.rowOffset));
    AscendC::DataCopyExtParams cp;
    cp.blockCount = static_cast<uint16_t>(rows);
    cp.blockLen = t.x.nLen * static_cast<uint32_t>(sizeof(T));
    cp.srcStride = (d.ld - t.x.nLen) * static_cast<uint32_t>(sizeof(T));
    cp.dstStride = 0;
    AscendC::DataCopyPadExtParams<T> pad;
    pad.isPad = false;
    AscendC::DataCopyPad(dst, src[static_cast<uint64_t>(t.x.m0 + r) * d.ld + t.x.n0], cp, pad);
  }

  const TilingView* tv_;
  GM_ADDR const* tensors_;
  GlobalTensor<float> ws_;
  uint32_t core_;
  uint32_t sub_;
  AscendC::TQue<TPosition::VECIN, 1> acc_;
  AscendC::TQue<TPosition::VECIN, 1> mask_;
  AscendC::TQue<TPosition::VECOUT, 1> out_;
  AscendC::TBuf<TPosition::VECCALC> maskF32_;
};

template <typename T>
__aicore__ inline void RunLoraGroupedGemm(GM_ADDR const* tensors, GM_ADDR workspace, GM_ADDR tiling) {
  TilingView tv;
  tv.Load(tiling);
  AscendC::TPipe pipe;
  if ASCEND_IS_AIC {
    CubeUnit<T> cube;
    cube.Init(&tv, tensors, workspace, &pipe);
    cube.Run();
  }
  if ASCEND_IS_AIV {
    VectorUnit<T> vec;
    vec.Init(&tv, tensors, workspace, &pipe);
    vec.Run();
  }
}

}  // namespace
}  // namespace slmoe_ascend

#define SLMOE_LORA_KERNEL(NAME, TYPE)                                                                            \
  extern "C" __global__ __aicore__ void NAME(GM_ADDR x, GM_ADDR loraX, GM_ADDR weight, GM_ADDR loraA,          \
                                             GM_ADDR loraB, GM_ADDR gradY, GM_ADDR mask, GM_ADDR h, GM_ADDR dh, \
                                             GM_ADDR y, GM_ADDR dx, GM_ADDR da, GM_ADDR db, GM_ADDR workspace,  \
                                             GM_ADDR tiling) {                                                  \
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);                                                          \
    GM_ADDR tensors[slmoe_ascend::kNumTensors] = {x, loraX, weight, loraA, loraB, gradY, mask,                  \
                                                  h, dh,    y,      dx,    da,    db};                          \
    slmoe_ascend::RunLoraGroupedGemm<TYPE>(tensors, workspace, tiling);                                         \
  }

SLMOE_LORA_KERNEL(slmoe_lora_grouped_gemm_fp16, half)
SLMOE_LORA_KERNEL(slmoe_lora_grouped_gemm_bf16, bfloat16_t)

// The host emulation runs the kernel on host fibers; CANN builds launch it with <<<>>>.
#ifdef SLMOE_ASCEND_EMU
#define SLMOE_LAUNCH(KERNEL, BLOCKS, STREAM, ...) \
  ((void)(STREAM), ::slmoe_emu::launch_mix((BLOCKS), [&] { KERNEL(__VA_ARGS__); }))
#else
#define SLMOE_LAUNCH(KERNEL, BLOCKS, STREAM, ...) KERNEL<<<(BLOCKS), nullptr, (STREAM)>>>(__VA_ARGS__)
#endif

namespace slmoe_ascend {

void launch_lora_grouped_gemm(DType dtype, uint32_t blockDim, void* stream, void* const tensors[kNumTensors],
                              void* workspace, const void* tiling_on_device) {
  if (blockDim == 0) return;
  auto arg = [&](uint32_t i) { return static_cast<uint8_t*>(tensors[i]); };
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  uint8_t* tiling = static_cast<uint8_t*>(const_cast<void*>(tiling_on_device));
  if (dtype == DType::kBFloat16) {
    SLMOE_LAUNCH(slmoe_lora_grouped_gemm_bf16, blockDim, stream, arg(0), arg(1), arg(2), arg(3), arg(4), arg(5),
                 arg(6), arg(7), arg(8), arg(9), arg(10), arg(11), arg(12), ws, tiling);
  } else {
    SLMOE_LAUNCH(slmoe_lora_grouped_gemm_fp16, blockDim, stream, arg(0), arg(1), arg(2), arg(3), arg(4), arg(5),
                 arg(6), arg(7), arg(8), arg(9), arg(10), arg(11), arg(12), ws, tiling);
  }
}

}  // namespace slmoe_ascend
