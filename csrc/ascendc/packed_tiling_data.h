// Tiling data of the AscendC packed-weight decode kernel (packed_decode_kernel.cpp): the bytes the
// host planner (packed_tiling.cpp) writes and the vector units read from global memory. Plain old
// data, fixed-width fields, 8-byte multiples (as lora_tiling_data.h).
//
// The decode writes experts e0 .. e0 + experts - 1 of a packed [E, d_out, d_in] weight (formats in
// csrc/lora_expert_packed.h) into a scratch [experts, d_out, d_in] of the kernel's dtype; the dense
// kernel (lora_expert_kernel.cpp) then runs on the scratch. Its unit of work is a "segment": one row
// of one expert, columns [c0, c0 + width) (the row's last segment may be shorter).
//
// Layout of the buffer (offsets in bytes from its start, each 32-byte aligned):
//     PackedDecodeTiling     header
//     uint32_t decode[experts]          1: the expert owns rows and is decoded; 0: skipped
//     float    lut[kLutFloats]          MXFP4: E8M0 value of each scale byte [0, 256), E2M1 value of
//                                       each code at [256, 272); FP8: E4M3 value of each byte
//     uint32_t interleave[width]        4-bit formats: byte offset, in the eight nibble planes of a
//                                       segment, of its element j: ((j % 8) * planeWords + j / 8) * 4
//     uint32_t group[width]             byte offset of element j's scale among the segment's scales:
//                                       (j / blockCols) * 4
#pragma once

#if !defined(__CCE_AICORE__) && !defined(__CCE_KT_TEST__)
#include <cstdint>
#endif

namespace slmoe_ascend {

constexpr uint32_t kPackedTilingMagic = 0x534c4d50u;  // "SLMP"
constexpr uint32_t kLutFloats = 272;                   // 256 + 16, a multiple of 8 (32-byte DataCopy)

enum PackedFormat : uint32_t { kPackedMxfp4 = 0, kPackedInt4 = 1, kPackedBlockFp8 = 2 };  // as slmoe::cuda
enum ScaleType : uint32_t { kScaleF32 = 0, kScaleBf16 = 1, kScaleF16 = 2 };

struct PackedDecodeTiling {
  uint32_t magic;
  uint32_t format;        // PackedFormat
  uint32_t scaleType;     // ScaleType (pack-quantized; MXFP4: uint8 E8M0, FP8: fp32)
  uint32_t blockRows;     // rows of one scale (FP8; 1 otherwise)
  uint32_t blockCols;     // inputs of one scale
  uint32_t width;         // columns of a segment: a multiple of blockCols unless one segment spans d_in
  uint32_t planeWords;    // 32-bit words of one nibble plane, a multiple of 8
  uint32_t scaleSpan;     // scales one segment reads, at most
  uint32_t segmentsPerRow;
  uint32_t numCores;      // vector units launched (AIV-only kernel)
  uint64_t dOut, dIn;
  uint64_t e0, experts;   // decode experts e0 .. e0 + experts - 1 into scratch experts 0 .. experts - 1
  uint64_t scaleRows, scaleCols;  // of one expert
  uint32_t decodeOffset, lutOffset, interleaveOffset, groupOffset;
  uint32_t ubPackedBytes, ubScaleBytes;  // VECIN buffers of one segment
  uint32_t totalBytes, pad;
};

}  // namespace slmoe_ascend

namespace slmoe_ascend {

#if defined(__CCE_AICORE__)
#define SLMOE_PACKED_INLINE __aicore__ inline
#else
#define SLMOE_PACKED_INLINE inline
#endif

SLMOE_PACKED_INLINE uint32_t Align32Bytes(uint32_t bytes) { return (bytes + 31u) / 32u * 32u; }

// Byte offsets of a vector unit's VECCALC scratch for one segment, in one place for the planner (UB
// budget) and the kernel (carving the buffer).
struct PackedCalcLayout {
  uint32_t lut, interleave, group, mask, planes, codes, value, scaleElem, scaleF32, scaleHalf, scaleS32, half16;
  uint32_t total;
};

SLMOE_PACKED_INLINE PackedCalcLayout PackedCalcLayoutOf(uint32_t width, uint32_t planeWords, uint32_t scaleSpan) {
  PackedCalcLayout l;
  uint32_t at = 0;
  l.lut = at, at += Align32Bytes(kLutFloats * 4);
  l.interleave = at, at += Align32Bytes(width * 4);
  l.group = at, at += Align32Bytes(width * 4);
  l.mask = at, at += Align32Bytes(8 * planeWords * 4);
  l.planes = at, at += Align32Bytes(8 * planeWords * 4);
  l.codes = at, at += Align32Bytes(width * 4);
  l.value = at, at += Align32Bytes(width * 4);
  l.scaleElem = at, at += Align32Bytes(width * 4);
  l.scaleF32 = at, at += Align32Bytes(scaleSpan * 4);
  l.scaleHalf = at, at += Align32Bytes(scaleSpan * 2);
  l.scaleS32 = at, at += Align32Bytes(scaleSpan * 4);
  l.half16 = at, at += Align32Bytes(width * 2);
  l.total = at;
  return l;
}

}  // namespace slmoe_ascend
