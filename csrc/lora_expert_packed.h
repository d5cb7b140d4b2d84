// The packed (quantised) frozen weight of the grouped LoRA expert op: its formats and the checks of
// a call's packed layout, shared by every device's impl so a bad layout fails with the same message.
//
// The formats are megatron_slmoe/ops/quantized_weights.py's, decoded value for value:
//   mxfp4-pack-quantized  uint8 [E, out, in/2]: element 2c in the low nibble of byte c, 2c+1 in the
//                         high; E2M1 code (bit 3 the sign) times 2^(s-127), s the uint8 scale of
//                         its 32 inputs [E, out, in/32]; computed in fp32 (exact), then cast.
//   pack-quantized        int32 [E, out, in/8]: element i at bits 4*(i%8) of word i/8, stored q+8;
//                         q * scale computed in the scale's dtype [E, out, in/group] (bf16, fp16 or
//                         fp32: compressed-tensors' q.to(scale.dtype) * scale), then cast.
//   block-fp8             float8_e4m3fn [E, out, in] times its fp32 block factor [E, ceil(out/br),
//                         ceil(in/bc)], in fp32, then cast.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "lora_expert_checks.h"

namespace slmoe {

enum class Format { kMxfp4, kInt4, kBlockFp8 };

// The packed layout of one call: format, experts, logical [out, in], the [rows, cols] of one scale.
struct PackedLayout {
  Format format;
  int64_t E, out, in, block_rows, block_cols;
};

// Checks packed/scale against `format`, `block` and the logical `matrix_shape`, on x's device.
inline PackedLayout check_packed(const at::Tensor& packed, const at::Tensor& scale, const std::string& format,
                                 at::IntArrayRef block, at::IntArrayRef matrix_shape, const at::Tensor& x) {
  const char* name = "lora_grouped_linear_packed";
  TORCH_CHECK_VALUE(block.size() == 2 && matrix_shape.size() == 2, name, ": block and matrix_shape are [rows, cols]");
  PackedLayout l{Format::kMxfp4, packed.dim() == 3 ? packed.size(0) : -1, matrix_shape[0], matrix_shape[1],
                 block[0], block[1]};
  TORCH_CHECK_VALUE(packed.dim() == 3, name, ": packed weight must be 3-D [E, d_out, *], got ", packed.sizes());
  TORCH_CHECK_VALUE(packed.device() == x.device() && scale.device() == x.device(), name,
                    ": packed weight and scale must be on x's device ", x.device());
  at::ScalarType packed_type;
  int64_t per_word;
  if (format == "mxfp4-pack-quantized") {
    l.format = Format::kMxfp4, packed_type = at::kByte, per_word = 2;
    TORCH_CHECK_VALUE(l.block_rows == 1 && l.block_cols == 32, name, ": ", format, " blocks are [1, 32], got ",
                      block);
    TORCH_CHECK_TYPE(scale.scalar_type() == at::kByte, name, ": ", format, " scale must be uint8, got ",
                     scale.scalar_type());
  } else if (format == "pack-quantized") {
    l.format = Format::kInt4, packed_type = at::kInt, per_word = 8;
    TORCH_CHECK_VALUE(l.block_rows == 1 && (l.block_cols == 32 || l.block_cols == 64 || l.block_cols == 128), name,
                      ": ", format, " groups are [1, 32|64|128], got ", block);
    const auto st = scale.scalar_type();
    TORCH_CHECK_TYPE(st == at::kBFloat16 || st == at::kHalf || st == at::kFloat, name, ": ", format,
                     " scale must be bfloat16, float16 or float32, got ", st);
  } else if (format == "block-fp8") {
    l.format = Format::kBlockFp8, packed_type = at::kFloat8_e4m3fn, per_word = 1;
    TORCH_CHECK_VALUE(l.block_rows > 0 && l.block_cols > 0, name, ": block-fp8 blocks must be positive, got ",
                      block);
    TORCH_CHECK_TYPE(scale.scalar_type() == at::kFloat, name, ": block-fp8 scale must be float32, got ",
                     scale.scalar_type());
  } else {
    TORCH_CHECK_VALUE(false, name, ": unknown quantised format '", format,
                      "' (known: mxfp4-pack-quantized, pack-quantized, block-fp8)");
  }
  TORCH_CHECK_TYPE(packed.scalar_type() == packed_type, name, ": ", format, " packed weight must be ", packed_type,
                   ", got ", packed.scalar_type());
  TORCH_CHECK_VALUE(l.in % per_word == 0 && (l.format == Format::kBlockFp8 || l.in % l.block_cols == 0), name,
                    ": ", format, " input width ", l.in, " is not a multiple of its group ", l.block_cols);
  check_shape(packed, {l.E, l.out, l.in / per_word}, "packed", "[E, d_out, d_in / values per element]");
  const int64_t scale_rows = (l.out + l.block_rows - 1) / l.block_rows;
  const int64_t scale_cols = (l.in + l.block_cols - 1) / l.block_cols;
  check_shape(scale, {l.E, scale_rows, scale_cols}, "scale", "[E, ceil(d_out / rows), ceil(d_in / cols)]");
  return l;
}

// The dense op's checks on a one-element stand-in of W's logical shape [E, d_out, d_in] (x's dtype
// and device, expanded), so the dense and packed ops refuse bad LoRA factors, counts and probs alike.
inline at::Tensor logical_weight(const PackedLayout& l, const at::Tensor& x) {
  return at::zeros({1, 1, 1}, x.options()).expand({l.E, l.out, l.in});
}

}  // namespace slmoe
