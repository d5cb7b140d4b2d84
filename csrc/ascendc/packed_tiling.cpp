// Host planner of the packed-weight path (packed_tiling.h): decode tilings with their lookup tables
// and offset patterns, and the chunk loop over experts.
#include "packed_tiling.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

// csrc/ascendc/emu compiles injected bugs in with SLMOE_MUTANT(n); real builds never define it.
#ifndef SLMOE_MUTANT
#define SLMOE_MUTANT(n) false
#endif

namespace slmoe_ascend {
namespace {

uint32_t align_up(uint32_t v, uint32_t a) { return (v + a - 1) / a * a; }

// E8M0 byte -> 2^(s-127): 0 is the subnormal 2^-127, 255 NaN.
float e8m0(uint32_t s) {
  if (SLMOE_MUTANT(33)) s -= 1;  // mutant 33: bias 128
  if (s == 255u) return std::numeric_limits<float>::quiet_NaN();
  return s == 0u ? std::ldexp(1.0f, -127) : std::ldexp(1.0f, static_cast<int>(s) - 127);
}

// E2M1 code (bit 3 the sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6.
float e2m1(uint32_t code) {
  static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  return (code & 8u) ? -mag[code & 7u] : mag[code & 7u];
}

// float8_e4m3fn byte -> float: bias 7, subnormals m * 2^-9, S.1111.111 NaN, no infinities.
float e4m3(uint32_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  float mag;
  if (e == 15u && m == 7u) {
    mag = std::numeric_limits<float>::quiet_NaN();
  } else if (e == 0u && !SLMOE_MUTANT(39)) {  // mutant 39: subnormals read as normals
    mag = std::ldexp(static_cast<float>(m), -9);
  } else {
    mag = std::ldexp(1.0f + static_cast<float>(m) / 8.0f, static_cast<int>(e) - 7);
  }
  return (b & 0x80u) ? -mag : mag;
}

template <typename T>
T* at(std::vector<uint8_t>& buf, uint32_t offset) {
  return reinterpret_cast<T*>(buf.data() + offset);
}

}  // namespace

std::string plan_decode(const PackedWeightDesc& w, int64_t d_out, int64_t d_in, int64_t e0, int64_t experts,
                        const int64_t* counts, const HwCaps& caps, uint32_t maxWidth, DecodePlan* out) {
  *out = DecodePlan();
  const bool four_bit = w.format == kPackedMxfp4 || w.format == kPackedInt4;
  if (w.format == kPackedMxfp4 && (w.blockRows != 1 || w.blockCols != 32)) return "mxfp4 blocks are [1, 32]";
  if (w.format == kPackedInt4 && (w.blockRows != 1 || (w.blockCols != 32 && w.blockCols != 64 && w.blockCols != 128))) {
    return "pack-quantized groups are [1, 32|64|128]";
  }
  if (w.format == kPackedBlockFp8 && (w.blockRows == 0 || w.blockCols == 0)) return "block-fp8 blocks must be positive";
  if (w.format > kPackedBlockFp8) return "unknown packed format";
  if (four_bit && d_in % w.blockCols != 0) return "the input width is not a multiple of the format's group";
  if (d_out <= 0 || d_in <= 0 || experts <= 0) return "";
  uint64_t segments_rows = 0;
  for (int64_t e = 0; e < experts; ++e) segments_rows += (counts == nullptr || counts[e0 + e] > 0) ? d_out : 0;
  if (segments_rows == 0) return "";

  // Segment width: the whole row when it fits, else a multiple of the scale block (and of 32, so
  // 4-bit segments start on whole bytes and words) within maxWidth.
  uint32_t width;
  if (static_cast<uint64_t>(d_in) <= maxWidth) {
    width = static_cast<uint32_t>(d_in);
  } else {
    const uint64_t unit = std::lcm<uint64_t>(32, w.blockCols);
    if (unit > maxWidth) {
      return "scale blocks of " + std::to_string(w.blockCols) + " columns do not fit a decode segment of at most " +
             std::to_string(maxWidth);
    }
    width = static_cast<uint32_t>(maxWidth / unit * unit);
  }
  const uint32_t group = SLMOE_MUTANT(34) && w.format == kPackedMxfp4 ? 16      // mutant 34: scale per 16
                         : SLMOE_MUTANT(36) && w.format == kPackedInt4 ? 32     // mutant 36: groups of 32
                                                                       : w.blockCols;
  const uint32_t plane_words = four_bit ? align_up(width / 8, 8) : 0;
  const uint32_t scale_span = (width + w.blockCols - 1) / w.blockCols + 1;  // +1: a segment not on a block edge
  const PackedCalcLayout calc = PackedCalcLayoutOf(width, plane_words, scale_span);
  const uint32_t packed_bytes = Align32Bytes(four_bit ? width / 2 : width);
  const uint32_t scale_bytes = Align32Bytes(scale_span * 4);
  if (calc.total + 2 * (packed_bytes + scale_bytes + Align32Bytes(width * 2)) > caps.ubBytes) {
    return "a decode segment does not fit the unified buffer";
  }

  PackedDecodeTiling h{};
  h.magic = kPackedTilingMagic;
  h.format = w.format;
  h.scaleType = w.scaleType;
  h.blockRows = w.blockRows;
  h.blockCols = w.blockCols;
  h.width = width;
  h.planeWords = plane_words;
  h.scaleSpan = scale_span;
  h.segmentsPerRow = static_cast<uint32_t>((d_in + width - 1) / width);
  h.dOut = static_cast<uint64_t>(d_out);
  h.dIn = static_cast<uint64_t>(d_in);
  h.e0 = static_cast<uint64_t>(e0);
  h.experts = static_cast<uint64_t>(experts);
  h.scaleRows = (d_out + w.blockRows - 1) / w.blockRows;
  h.scaleCols = (d_in + w.blockCols - 1) / w.blockCols;
  h.ubPackedBytes = packed_bytes;
  h.ubScaleBytes = scale_bytes;
  uint32_t size = Align32Bytes(sizeof(PackedDecodeTiling));
  h.decodeOffset = size, size += Align32Bytes(static_cast<uint32_t>(experts) * 4);
  h.lutOffset = size, size += Align32Bytes(kLutFloats * 4);
  h.interleaveOffset = size, size += Align32Bytes(width * 4);
  h.groupOffset = size, size += Align32Bytes(width * 4);
  h.totalBytes = size;
  const uint64_t segments = segments_rows * h.segmentsPerRow;
  const uint64_t vector_units = 2ull * caps.numAic;
  h.numCores = static_cast<uint32_t>(std::min<uint64_t>(segments, vector_units));

  std::vector<uint8_t>& buf = out->tiling;
  buf.assign(size, 0);
  std::memcpy(buf.data(), &h, sizeof h);
  for (int64_t e = 0; e < experts; ++e) {
    const bool has_rows = counts == nullptr || counts[e0 + e] > 0;
    at<uint32_t>(buf, h.decodeOffset)[e] = (SLMOE_MUTANT(41) ? !has_rows : has_rows) ? 1u : 0u;  // mutant 41
  }
  float* lut = at<float>(buf, h.lutOffset);
  for (uint32_t i = 0; i < 256; ++i) lut[i] = w.format == kPackedBlockFp8 ? e4m3(i) : e8m0(i);
  for (uint32_t i = 0; i < 16; ++i) lut[256 + i] = e2m1(i);
  for (uint32_t j = 0; j < width; ++j) {
    at<uint32_t>(buf, h.interleaveOffset)[j] = ((j % 8) * plane_words + j / 8) * 4;
    at<uint32_t>(buf, h.groupOffset)[j] = (j / group) * 4;
  }
  out->blockDim = h.numCores;
  return "";
}

namespace {

// The chunk loop both directions share: experts in chunks of scratchExperts, a decode where the
// chunk needs W, then the dense plans on the chunk's rows.
template <typename PlanDense>
std::string plan_chunks(const LoraDims& d, const int64_t* counts, const PackedWeightDesc& w, int64_t scratchExperts,
                        bool decode_needed, bool skip_empty, const HwCaps& caps, uint32_t maxWidth,
                        const PlanDense& plan_dense, std::vector<PackedStep>* steps) {
  steps->clear();
  if (scratchExperts < 1) return "the scratch must hold at least one expert";
  int64_t row0 = 0;
  for (int64_t e0 = 0; e0 < d.E; e0 += scratchExperts) {
    PackedStep s;
    s.e0 = e0;
    s.experts = std::min(scratchExperts, d.E - e0);
    for (int64_t e = e0; e < e0 + s.experts; ++e) s.rows += counts[e];
    s.row0 = SLMOE_MUTANT(43) ? 0 : row0;  // mutant 43: every chunk's rows from row 0
    row0 += s.rows;
    if (s.rows == 0 && skip_empty) continue;
    if (decode_needed && s.rows > 0) {
      const std::string err = plan_decode(w, d.d_out, d.d_in, e0, s.experts, counts, caps, maxWidth, &s.decode);
      if (!err.empty()) return err;
    }
    LoraDims c = d;
    c.T = s.rows;
    c.E = s.experts;
    s.dense = plan_dense(c, counts + e0);
    steps->push_back(std::move(s));
  }
  return "";
}

}  // namespace

std::string plan_packed_forward(const LoraDims& d, const int64_t* counts, const PackedWeightDesc& w,
                                int64_t scratchExperts, const HwCaps& caps, uint32_t maxWidth,
                                std::vector<PackedStep>* steps) {
  // A chunk without rows has nothing to compute (the forward writes rows only).
  return plan_chunks(d, counts, w, scratchExperts, true, true, caps, maxWidth,
                     [&](const LoraDims& c, const int64_t* cc) { return plan_forward(c, cc, caps); }, steps);
}

std::string plan_packed_backward(const LoraDims& d, const int64_t* counts, const PackedWeightDesc& w,
                                 int64_t scratchExperts, bool has_mask, bool need_dx, bool need_da, bool need_db,
                                 const HwCaps& caps, uint32_t maxWidth, std::vector<PackedStep>* steps) {
  // Every chunk runs: experts without rows still get zero dA and dB.
  return plan_chunks(d, counts, w, scratchExperts, need_dx, false, caps, maxWidth,
                     [&](const LoraDims& c, const int64_t* cc) {
                       return plan_backward(c, cc, has_mask, need_dx, need_da, need_db, caps);
                     },
                     steps);
}

}  // namespace slmoe_ascend
