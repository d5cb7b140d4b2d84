// CPU impl of the grouped LoRA expert op over a packed (quantised) frozen W (schemas in
// csrc/bindings.cpp): the per-expert ATen math of lora_expert_aten.h, with expert e's W_e decoded
// into a scratch tile of x's dtype wherever a GEMM needs it. One tile per thread lives for the call
// only, so no dequantised copy of W outlives it; the backward decodes again.
//
// The decode is megatron_slmoe/ops/quantized_weights.py's, value for value (layouts and arithmetic
// in csrc/lora_expert_packed.h).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "expert_schedule.h"
#include "lora_expert_aten.h"
#include "lora_expert_checks.h"
#include "lora_expert_packed.h"

namespace slmoe {
namespace {

using cpu::kCpuExperts;

// The 4-bit decoders below compute each value in fp32 with integer and float arithmetic only (no
// table lookups, no branches), so the compiler vectorises their inner loops; all three give the
// per-element formulas of csrc/lora_expert_packed.h bit for bit.

// c10::BFloat16's rounding of an fp32 value (nearest even, NaN to 0x7FC0), without its branch.
inline uint16_t bf16_bits(float f) {
  const auto u = c10::bit_cast<uint32_t>(f);
  const auto rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? uint16_t{0x7FC0} : rounded;
}

// v cast to T and back to fp32: the rounding of a product computed in T.
template <typename T>
inline float rounded_to(float v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return c10::bit_cast<float>(uint32_t{bf16_bits(v)} << 16);
  } else {
    return static_cast<float>(static_cast<T>(v));
  }
}

// A decoded fp32 value into the tile's dtype, rounded as static_cast rounds it.
template <typename out_t>
inline out_t to_tile(float v) {
  if constexpr (std::is_same_v<out_t, c10::BFloat16>) {
    return out_t(bf16_bits(v), out_t::from_bits());
  } else {
    return static_cast<out_t>(v);
  }
}

// E2M1 code (bit 3 the sign) -> its value 0, 0.5, 1, 1.5, 2, 3, 4, 6, built as fp32 bits: code c >= 2
// is 2^(c/2 - 1) * (1 + (c & 1) / 2).
inline float e2m1_value(uint32_t code) {
  const uint32_t c = code & 7u;
  const uint32_t magnitude = c >= 2 ? ((c >> 1) + 126u) << 23 | (c & 1u) << 22 : (c == 1 ? 0x3F000000u : 0u);
  return c10::bit_cast<float>((code & 8u) << 28 | magnitude);
}

// Element 2c of a nibble-packed row is the low nibble of its byte c, 2c+1 the high one: MXFP4's
// layout, and INT4's too, its int32 words read as bytes on a little-endian host.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the INT4 decoder reads int32 words as bytes");

// Rows [r0, r1) of expert e's W into `tile` ([out, in], out_t, contiguous).
template <typename out_t>
void decode_rows(const PackedLayout& l, const at::Tensor& packed, const at::Tensor& scale, int64_t e, int64_t r0,
                 int64_t r1, out_t* tile) {
  const int64_t in = l.in;
  if (l.format == Format::kMxfp4) {
    const uint8_t* p = packed.data_ptr<uint8_t>() + e * l.out * (in / 2);
    const uint8_t* s = scale.data_ptr<uint8_t>() + e * l.out * (in / 32);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g = 0; g < in / 32; ++g) {
        const uint8_t sb = s[r * (in / 32) + g];  // 2^(sb - 127), 255 NaN
        const float factor = sb == 255 ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, sb - 127);
        const uint8_t* bytes = p + r * (in / 2) + g * 16;
        out_t* dst = tile + r * in + g * 32;
        for (int64_t c = 0; c < 16; ++c) {
          dst[2 * c] = to_tile<out_t>(e2m1_value(bytes[c] & 0xFu) * factor);
          dst[2 * c + 1] = to_tile<out_t>(e2m1_value(bytes[c] >> 4) * factor);
        }
      }
    }
  } else if (l.format == Format::kInt4) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(packed.data_ptr<int32_t>()) + e * l.out * (in / 2);
    const int64_t cols = l.block_cols, groups = in / cols;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scale.scalar_type(), "decode_int4", [&] {
      using scale_t = scalar_t;
      const scale_t* s = scale.data_ptr<scale_t>() + e * l.out * groups;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
          const float sv = static_cast<float>(s[r * groups + g]);
          const uint8_t* bytes = p + r * (in / 2) + g * (cols / 2);
          out_t* dst = tile + r * in + g * cols;
          // (nibble - 8) * scale rounded to the scale's dtype, as torch multiplies two such tensors.
          for (int64_t c = 0; c < cols / 2; ++c) {
            dst[2 * c] = to_tile<out_t>(rounded_to<scale_t>(static_cast<float>(int{bytes[c] & 0xF} - 8) * sv));
            dst[2 * c + 1] = to_tile<out_t>(rounded_to<scale_t>(static_cast<float>(int{bytes[c] >> 4} - 8) * sv));
          }
        }
      }
    });
  } else {
    // FP8 byte -> float by a table (Float8_e4m3fn's values; measured faster here than decoding the
    // bits, which does not vectorise).
    static const std::array<float, 256> kFp8 = [] {
      std::array<float, 256> table{};
      for (int b = 0; b < 256; ++b) {
        table[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
      }
      return table;
    }();
    const auto* p = reinterpret_cast<const uint8_t*>(packed.data_ptr<at::Float8_e4m3fn>()) + e * l.out * in;
    const int64_t scale_rows = (l.out + l.block_rows - 1) / l.block_rows;
    const int64_t scale_cols = (in + l.block_cols - 1) / l.block_cols;
    const float* s = scale.data_ptr<float>() + e * scale_rows * scale_cols;
    for (int64_t r = r0; r < r1; ++r) {
      const float* srow = s + (r / l.block_rows) * scale_cols;
      for (int64_t c0 = 0; c0 < in; c0 += l.block_cols) {
        const float factor = srow[c0 / l.block_cols];
        const int64_t c1 = std::min(in, c0 + l.block_cols);
        for (int64_t c = c0; c < c1; ++c) tile[r * in + c] = to_tile<out_t>(kFp8[p[r * in + c]] * factor);
      }
    }
  }
}

// weight_of(e) for the ATen math: expert e decoded into this thread's scratch tile. The tiles are
// made on first use and freed with this object, at the end of the call.
class DecodedTiles {
 public:
  DecodedTiles(const PackedLayout& l, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& like)
      : l_(l), packed_(packed.contiguous()), scale_(scale.contiguous()), like_(like),
        tiles_(static_cast<size_t>(at::get_num_threads())) {
  }

  at::Tensor operator()(int64_t e) const {
    const auto thread = static_cast<size_t>(at::get_thread_num());
    TORCH_INTERNAL_ASSERT(thread < tiles_.size(), "lora_grouped_linear_packed: thread ", thread, " of ",
                          tiles_.size());
    auto& tile = tiles_[thread];
    if (!tile.defined()) tile = at::empty({l_.out, l_.in}, like_.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tile.scalar_type(), "decode_tile", [&] {
      scalar_t* dst = tile.data_ptr<scalar_t>();
      // A big expert runs alone with all threads (expert_schedule.h): decode its rows in parallel;
      // inside a worker's bin of small experts this runs on that thread alone.
      at::parallel_for(0, l_.out, 16, [&](int64_t r0, int64_t r1) {
        decode_rows<scalar_t>(l_, packed_, scale_, e, r0, r1, dst);
      });
    });
    return tile;
  }

 private:
  PackedLayout l_;
  at::Tensor packed_, scale_, like_;
  mutable std::vector<at::Tensor> tiles_;
};

std::tuple<at::Tensor, at::Tensor> lora_grouped_linear_packed_fwd_cpu(
    const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b, const at::Tensor& tokens_per_expert,
    double scaling, const std::optional<at::Tensor>& lora_x, const std::optional<at::Tensor>& probs,
    const at::Tensor& packed, const at::Tensor& scale, c10::string_view format, at::IntArrayRef block,
    at::IntArrayRef matrix_shape) {
  const auto l = check_packed(packed, scale, std::string(format), block, matrix_shape, x);
  const auto d =
      check_forward_inputs(x, logical_weight(l, x), lora_a, lora_b, tokens_per_expert, lora_x, probs);
  const auto offsets = group_offsets(tokens_per_expert, d.T);
  const DecodedTiles tiles(l, packed, scale, x);
  return lora_grouped_linear_fwd_aten_tiles(d, offsets, x, tiles, lora_a, lora_b, scaling, lora_x, probs,
                                            kCpuExperts);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lora_grouped_linear_packed_bwd_cpu(
    const at::Tensor& grad_y, const at::Tensor& lora_x, const at::Tensor& lora_a, const at::Tensor& lora_b,
    const at::Tensor& h, const at::Tensor& tokens_per_expert, double scaling,
    const std::optional<at::Tensor>& lora_mask, std::array<bool, 3> output_mask,
    const std::optional<at::Tensor>& probs, const at::Tensor& packed, const at::Tensor& scale,
    c10::string_view format, at::IntArrayRef block, at::IntArrayRef matrix_shape) {
  const auto l = check_packed(packed, scale, std::string(format), block, matrix_shape, lora_x);
  const auto d = check_backward_inputs(grad_y, lora_x, logical_weight(l, lora_x), lora_a, lora_b, h,
                                       tokens_per_expert, lora_mask, probs);
  const auto offsets = group_offsets(tokens_per_expert, d.T);
  const DecodedTiles tiles(l, packed, scale, lora_x);
  return lora_grouped_linear_bwd_aten_tiles(d, offsets, grad_y, lora_x, tiles, lora_a, lora_b, h, scaling,
                                            lora_mask, output_mask, probs, kCpuExperts);
}

}  // namespace

TORCH_LIBRARY_IMPL(slmoe, CPU, m) {
  m.impl("lora_grouped_linear_packed_fwd", &lora_grouped_linear_packed_fwd_cpu);
  m.impl("lora_grouped_linear_packed_bwd", &lora_grouped_linear_packed_bwd_cpu);
}

}  // namespace slmoe
