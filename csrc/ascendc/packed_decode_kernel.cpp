// AscendC decode kernel of the grouped LoRA expert op over a packed frozen W (Atlas A2/A3,
// dav-c220): the vector units dequantise a chunk of experts into a scratch of the input dtype, on
// which the dense kernel (lora_expert_kernel.cpp) then runs its cube GEMMs with the LoRA shrink and
// expand fused as for a dense W (the host planner packed_tiling.cpp strings the launches together).
//
// NOT compiled by CANN and NOT run on an NPU by this project's CI (no CANN there): this exact file is
// compiled with g++ against the host emulation (csrc/ascendc/emu) and checked there, bit for bit,
// against megatron_slmoe.ops' decode (csrc/ascendc/emu/packed_oracle.py).
//
// Why a scratch in GM and not UB -> L1: on Atlas A2 the vector units (UB) and the cube unit (L1/L0)
// of an AI Core share no local memory; what the vector units produce reaches the cube through GM.
// Decoding each expert once per launch sequence keeps the cube's GM -> L1 -> L0 pipeline of the
// dense kernel unchanged, instead of a decode between every K step of every row tile.
//
// KERNEL_TYPE_AIV_ONLY. Each vector unit takes every numCores-th segment (one row of one expert,
// `width` columns; packed_tiling_data.h) and, per segment:
//   MTE2  packed bytes and the segment's scales GM -> UB (VECIN, two buffers each);
//   V     4-bit (MXFP4 bytes and INT4 words are both little-endian 32-bit words whose nibble t holds
//         element 8w + t): ShiftRight by 4t into eight planes, And 0xF (on uint16 halves: A2's And
//         takes 16-bit types), Gather the planes into element order; MXFP4: ShiftLeft 2 and Gather
//         the E2M1 table; INT4: Adds -8 (stored q + 8), Cast int32 -> float.
//         FP8: Cast uint8 -> half -> int32, ShiftLeft 2, Gather the E4M3 table.
//         Scales: MXFP4 uint8 -> half -> int32 -> Gather of the E8M0 table; INT4 bf16/fp16 Cast to
//         float; then Gather to one scale per element, Mul in fp32 (INT4: rounded to the scale's
//         dtype, as compressed-tensors computes q.to(scale.dtype) * scale), Cast to bf16/fp16 (RINT);
//   MTE3  UB (VECOUT, two buffers) -> the scratch row.
#include "kernel_operator.h"
#include "lora_expert_ascend.h"
#include "packed_tiling_data.h"

// csrc/ascendc/emu compiles injected bugs in with SLMOE_MUTANT(n); real builds never define it.
#ifndef SLMOE_MUTANT
#define SLMOE_MUTANT(n) false
#endif

namespace slmoe_ascend {
namespace {

using AscendC::GlobalTensor;
using AscendC::LocalTensor;
using AscendC::TPosition;

template <typename T>
class PackedDecoder {
 public:
  __aicore__ inline void Init(GM_ADDR packed, GM_ADDR scale, GM_ADDR scratch, GM_ADDR tiling, AscendC::TPipe* pipe) {
    uint8_t* dst = reinterpret_cast<uint8_t*>(&h_);
    for (uint32_t i = 0; i < sizeof(PackedDecodeTiling); ++i) dst[i] = tiling[i];
    decode_ = reinterpret_cast<__gm__ const uint32_t*>(tiling + h_.decodeOffset);
    packed_.SetGlobalBuffer(reinterpret_cast<__gm__ uint8_t*>(packed));
    scale_.SetGlobalBuffer(reinterpret_cast<__gm__ uint8_t*>(scale));
    scratch_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(scratch));
    core_ = static_cast<uint32_t>(AscendC::GetBlockIdx());
    pipe->InitBuffer(packedIn_, 2, h_.ubPackedBytes);
    pipe->InitBuffer(scaleIn_, 2, h_.ubScaleBytes);
    pipe->InitBuffer(out_, 2, Align32Bytes(h_.width * sizeof(T)));
    calcLayout_ = PackedCalcLayoutOf(h_.width, h_.planeWords, h_.scaleSpan);
    pipe->InitBuffer(calc_, calcLayout_.total);
    calc_base_ = calc_.Get<uint8_t>();

    // The tables and offset patterns, once: GM -> UB, then PIPE_ALL orders them before every use.
    GlobalTensor<uint32_t> t;
    t.SetGlobalBuffer(reinterpret_cast<__gm__ uint32_t*>(tiling));
    AscendC::DataCopy(Calc<uint32_t>(calcLayout_.lut), t[h_.lutOffset / 4], kLutFloats);
    AscendC::DataCopy(Calc<uint32_t>(calcLayout_.interleave), t[h_.interleaveOffset / 4], Align8(h_.width));
    AscendC::DataCopy(Calc<uint32_t>(calcLayout_.group), t[h_.groupOffset / 4], Align8(h_.width));
    if (FourBit()) AscendC::Duplicate(Calc<uint32_t>(calcLayout_.mask), 0xFu, static_cast<int32_t>(8 * h_.planeWords));
    AscendC::PipeBarrier<PIPE_ALL>();
  }

  __aicore__ inline void Run() {
    const uint64_t perExpert = h_.dOut * h_.segmentsPerRow;
    const uint64_t total = h_.experts * perExpert;
    for (uint64_t s = core_; s < total; s += h_.numCores) {
      const uint64_t local = s / perExpert;
      if (decode_[local] == 0) continue;  // an expert without rows: nobody reads its tile
      const uint64_t rest = s % perExpert;
      const uint64_t row = rest / h_.segmentsPerRow;
      const uint32_t seg = static_cast<uint32_t>(rest % h_.segmentsPerRow);
      if (SLMOE_MUTANT(40) && h_.segmentsPerRow > 1 && seg == h_.segmentsPerRow - 1) continue;  // mutant 40
      const uint64_t c0 = static_cast<uint64_t>(seg) * h_.width;
      const uint32_t len = static_cast<uint32_t>(h_.dIn - c0 < h_.width ? h_.dIn - c0 : h_.width);
      CopyIn(h_.e0 + local, row, c0, len);
      Compute(len);
      CopyOut(local, row, c0, len);
    }
  }

 private:
  __aicore__ inline bool FourBit() const { return h_.format != kPackedBlockFp8; }
  __aicore__ inline static uint32_t Align8(uint32_t v) { return (v + 7u) / 8u * 8u; }
  template <typename U>
  __aicore__ inline LocalTensor<U> Calc(uint32_t byteOffset) const {
    return calc_base_[byteOffset].template ReinterpretCast<U>();
  }
  __aicore__ inline uint32_t ScaleBytes() const {
    if (h_.format == kPackedMxfp4) return 1;
    if (h_.format == kPackedInt4 && h_.scaleType != kScaleF32) return 2;
    return 4;
  }

  // Scales [first, first + n) of row `scaleRow` of expert e, and the segment's packed bytes.
  __aicore__ inline void CopyIn(uint64_t e, uint64_t row, uint64_t c0, uint32_t len) {
    const uint64_t perRow = FourBit() ? h_.dIn / 2 : h_.dIn;
    const uint64_t first = FourBit() ? c0 / 2 : c0;
    LocalTensor<uint8_t> pk = packedIn_.AllocTensor<uint8_t>();
    AscendC::DataCopyExtParams cp;
    cp.blockCount = 1;
    cp.blockLen = FourBit() ? len / 2 : len;
    AscendC::DataCopyPadExtParams<uint8_t> pad;
    AscendC::DataCopyPad(pk, packed_[(e * h_.dOut + row) * perRow + first], cp, pad);
    packedIn_.EnQue(pk);

    // mutant 38: FP8's scale row from the column block size
    const uint64_t br = SLMOE_MUTANT(38) && h_.format == kPackedBlockFp8 ? h_.blockCols : h_.blockRows;
    const uint64_t scaleRow = row / br;
    const uint64_t g0 = c0 / h_.blockCols;
    const uint64_t g1 = (c0 + len + h_.blockCols - 1) / h_.blockCols;
    LocalTensor<uint8_t> sc = scaleIn_.AllocTensor<uint8_t>();
    cp.blockLen = static_cast<uint32_t>((g1 - g0) * ScaleBytes());
    AscendC::DataCopyPad(sc, scale_[((e * h_.scaleRows + scaleRow) * h_.scaleCols + g0) * ScaleBytes()], cp, pad);
    scaleIn_.EnQue(sc);
    scaleCount_ = static_cast<uint32_t>(g1 - g0);
  }

  __aicore__ inline void Compute(uint32_t len) {
    LocalTensor<uint8_t> pk = packedIn_.DeQue<uint8_t>();
    LocalTensor<uint8_t> sc = scaleIn_.DeQue<uint8_t>();
    LocalTensor<float> value = Calc<float>(calcLayout_.value);
    LocalTensor<float> scaleElem = Calc<float>(calcLayout_.scaleElem);
    LocalTensor<uint32_t> codes = Calc<uint32_t>(calcLayout_.codes);
    LocalTensor<float> lut = Calc<float>(calcLayout_.lut);
    AscendC::PipeBarrier<PIPE_V>();  // the previous segment's vector reads of this scratch

    // One scale per element: the segment's scales as fp32, gathered by (j / blockCols) * 4.
    LocalTensor<float> scaleF32 = ScalesToF32(sc);
    AscendC::Gather(scaleElem, scaleF32, Calc<uint32_t>(calcLayout_.group), 0, len);

    if (FourBit()) {
      UnpackNibbles(pk, len);
      LocalTensor<uint32_t> planes = Calc<uint32_t>(calcLayout_.planes);
      if (h_.format == kPackedMxfp4) {
        AscendC::ShiftLeft(planes, planes, 2u, static_cast<int32_t>(8 * h_.planeWords));  // code -> byte offset
        AscendC::PipeBarrier<PIPE_V>();
      }
      AscendC::Gather(codes, planes, Calc<uint32_t>(calcLayout_.interleave), 0, len);
      AscendC::PipeBarrier<PIPE_V>();
      if (h_.format == kPackedMxfp4) {
        AscendC::Gather(value, lut, codes, 256 * 4, len);  // the E2M1 table
      } else {
        LocalTensor<int32_t> q = codes.ReinterpretCast<int32_t>();
        if (!SLMOE_MUTANT(35)) {  // mutant 35: the stored q + 8 taken as q
          AscendC::Adds(q, q, -8, static_cast<int32_t>(len));
          AscendC::PipeBarrier<PIPE_V>();
        }
        AscendC::Cast(value, q, AscendC::RoundMode::CAST_NONE, len);
      }
    } else {
      LocalTensor<half> h16 = Calc<half>(calcLayout_.half16);
      AscendC::Cast(h16, pk, AscendC::RoundMode::CAST_NONE, len);
      AscendC::PipeBarrier<PIPE_V>();
      AscendC::Cast(codes.ReinterpretCast<int32_t>(), h16, AscendC::RoundMode::CAST_RINT, len);
      AscendC::PipeBarrier<PIPE_V>();
      AscendC::ShiftLeft(codes, codes, 2u, static_cast<int32_t>(len));
      AscendC::PipeBarrier<PIPE_V>();
      AscendC::Gather(value, lut, codes, 0, len);  // the E4M3 table
    }
    AscendC::PipeBarrier<PIPE_V>();
    AscendC::Mul(value, value, scaleElem, static_cast<int32_t>(len));
    AscendC::PipeBarrier<PIPE_V>();
    if (h_.format == kPackedInt4 && !SLMOE_MUTANT(37)) {  // mutant 37: not rounded to the scale's dtype
      if (h_.scaleType == kScaleBf16) RoundThrough<bfloat16_t>(value, len);
      if (h_.scaleType == kScaleF16) RoundThrough<half>(value, len);
    }
    LocalTensor<T> out = out_.AllocTensor<T>();
    AscendC::Cast(out, value, AscendC::RoundMode::CAST_RINT, len);
    out_.EnQue(out);
    packedIn_.FreeTensor(pk);
    scaleIn_.FreeTensor(sc);
  }

  // The segment's scales (in VECIN) as fp32 in VECCALC (FP8 and fp32 INT4 scales are fp32 already).
  __aicore__ inline LocalTensor<float> ScalesToF32(const LocalTensor<uint8_t>& sc) {
    LocalTensor<float> f = Calc<float>(calcLayout_.scaleF32);
    if (h_.format == kPackedMxfp4) {  // E8M0 byte s -> the table's 2^(s-127)
      LocalTensor<half> sh = Calc<half>(calcLayout_.scaleHalf);
      LocalTensor<int32_t> si = Calc<int32_t>(calcLayout_.scaleS32);
      AscendC::Cast(sh, sc, AscendC::RoundMode::CAST_NONE, scaleCount_);
      AscendC::PipeBarrier<PIPE_V>();
      AscendC::Cast(si, sh, AscendC::RoundMode::CAST_RINT, scaleCount_);
      AscendC::PipeBarrier<PIPE_V>();
      LocalTensor<uint32_t> su = si.ReinterpretCast<uint32_t>();
      AscendC::ShiftLeft(su, su, 2u, static_cast<int32_t>(scaleCount_));
      AscendC::PipeBarrier<PIPE_V>();
      AscendC::Gather(f, Calc<float>(calcLayout_.lut), su, 0, scaleCount_);
    } else if (h_.format == kPackedInt4 && h_.scaleType == kScaleBf16) {
      AscendC::Cast(f, sc.ReinterpretCast<bfloat16_t>(), AscendC::RoundMode::CAST_NONE, scaleCount_);
    } else if (h_.format == kPackedInt4 && h_.scaleType == kScaleF16) {
      AscendC::Cast(f, sc.ReinterpretCast<half>(), AscendC::RoundMode::CAST_NONE, scaleCount_);
    } else {
      return sc.ReinterpretCast<float>();
    }
    AscendC::PipeBarrier<PIPE_V>();
    return f;
  }

  // Nibble t of each 32-bit word into plane t (planes of planeWords words): shift, then & 0xF.
  __aicore__ inline void UnpackNibbles(const LocalTensor<uint8_t>& pk, uint32_t len) {
    LocalTensor<uint32_t> words = pk.ReinterpretCast<uint32_t>();
    LocalTensor<uint32_t> planes = Calc<uint32_t>(calcLayout_.planes);
    const int32_t n = static_cast<int32_t>(len / 8);
    for (uint32_t t = 0; t < 8; ++t) {
      // mutant 31: nibbles of a word in reverse order; mutant 32: the two nibbles of a byte swapped
      const uint32_t nibble = SLMOE_MUTANT(31) ? 7 - t : SLMOE_MUTANT(32) ? (t ^ 1u) : t;
      AscendC::ShiftRight(planes[t * h_.planeWords], words, 4 * nibble, n);
    }
    if (!SLMOE_MUTANT(42)) AscendC::PipeBarrier<PIPE_V>();  // mutant 42: And reads the planes too early
    const int32_t halves = static_cast<int32_t>(2 * 8 * h_.planeWords);
    AscendC::And(planes.ReinterpretCast<uint16_t>(), planes.ReinterpretCast<uint16_t>(),
                 Calc<uint16_t>(calcLayout_.mask), halves);
    AscendC::PipeBarrier<PIPE_V>();
  }

  // v = float(S(v)): the product rounded to the scale's 16-bit dtype S.
  template <typename S>
  __aicore__ inline void RoundThrough(const LocalTensor<float>& v, uint32_t len) {
    LocalTensor<S> r = Calc<S>(calcLayout_.half16);
    AscendC::Cast(r, v, AscendC::RoundMode::CAST_RINT, len);
    AscendC::PipeBarrier<PIPE_V>();
    AscendC::Cast(v, r, AscendC::RoundMode::CAST_NONE, len);
    AscendC::PipeBarrier<PIPE_V>();
  }

  __aicore__ inline void CopyOut(uint64_t local, uint64_t row, uint64_t c0, uint32_t len) {
    LocalTensor<T> out = out_.DeQue<T>();
    AscendC::DataCopyExtParams cp;
    cp.blockCount = 1;
    cp.blockLen = len * static_cast<uint32_t>(sizeof(T));
    AscendC::DataCopyPad(scratch_[(local * h_.dOut + row) * h_.dIn + c0], out, cp);
    out_.FreeTensor(out);
  }

  PackedDecodeTiling h_;
  __gm__ const uint32_t* decode_;
  GlobalTensor<uint8_t> packed_, scale_;
  GlobalTensor<T> scratch_;
  uint32_t core_ = 0;
  uint32_t scaleCount_ = 0;
  PackedCalcLayout calcLayout_;
  AscendC::TQue<TPosition::VECIN, 1> packedIn_, scaleIn_;
  AscendC::TQue<TPosition::VECOUT, 1> out_;
  AscendC::TBuf<TPosition::VECCALC> calc_;
  LocalTensor<uint8_t> calc_base_;
};

}  // namespace
}  // namespace slmoe_ascend

#define SLMOE_DECODE_KERNEL(NAME, TYPE)                                                                   \
  extern "C" __global__ __aicore__ void NAME(GM_ADDR packed, GM_ADDR scale, GM_ADDR scratch, GM_ADDR tiling) { \
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);                                                       \
    AscendC::TPipe pipe;                                                                                  \
    slmoe_ascend::PackedDecoder<TYPE> decoder;                                                            \
    decoder.Init(packed, scale, scratch, tiling, &pipe);                                                  \
    decoder.Run();                                                                                        \
  }

SLMOE_DECODE_KERNEL(slmoe_packed_decode_fp16, half)
SLMOE_DECODE_KERNEL(slmoe_packed_decode_bf16, bfloat16_t)

#ifdef SLMOE_ASCEND_EMU
#define SLMOE_LAUNCH_AIV(KERNEL, BLOCKS, STREAM, ...) \
  ((void)(STREAM), ::slmoe_emu::launch_aiv((BLOCKS), [&] { KERNEL(__VA_ARGS__); }))
#else
#define SLMOE_LAUNCH_AIV(KERNEL, BLOCKS, STREAM, ...) KERNEL<<<(BLOCKS), nullptr, (STREAM)>>>(__VA_ARGS__)
#endif

namespace slmoe_ascend {

void launch_packed_decode(DType dtype, uint32_t blockDim, void* stream, const void* packed, const void* scale,
                          void* scratch, const void* tiling_on_device) {
  if (blockDim == 0) return;
  auto p = [](const void* v) { return static_cast<uint8_t*>(const_cast<void*>(v)); };
  if (dtype == DType::kBFloat16) {
    SLMOE_LAUNCH_AIV(slmoe_packed_decode_bf16, blockDim, stream, p(packed), p(scale), p(scratch), p(tiling_on_device));
  } else {
    SLMOE_LAUNCH_AIV(slmoe_packed_decode_fp16, blockDim, stream, p(packed), p(scale), p(scratch), p(tiling_on_device));
  }
}

}  // namespace slmoe_ascend
