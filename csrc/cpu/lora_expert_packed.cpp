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
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "expert_schedule.h"
#include "lora_expert_aten.h"
#include "lora_expert_checks.h"
#include "lora_expert_packed.h"

namespace slmoe {
namespace {

using cpu::kCpuExperts;

constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// MXFP4's decode as a table: [scale byte s][packed byte b] -> the pair (low, high element) in the
// tile's dtype, each the fp32 product E2M1 * 2^(s-127) cast as the per-element formula would cast
// it (s = 255 gives NaN). 256 x 256 pairs; a byte then decodes with one lookup and no conversion.
at::Tensor mxfp4_pair_table(at::ScalarType dtype) {
  std::vector<float> factors(256), pairs(512);
  for (int s = 0; s < 256; ++s) {
    factors[s] = s == 255 ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, s - 127);
  }
  for (int b = 0; b < 256; ++b) pairs[2 * b] = kE2M1[b & 0xF], pairs[2 * b + 1] = kE2M1[b >> 4];
  const auto f = at::from_blob(factors.data(), {256, 1, 1}, at::kFloat);
  const auto v = at::from_blob(pairs.data(), {1, 256, 2}, at::kFloat);
  return (f * v).to(dtype).contiguous();
}

// Rows [r0, r1) of expert e's W into `tile` ([out, in], out_t, contiguous); `mx_pairs` is
// mxfp4_pair_table in out_t for MXFP4.
template <typename out_t>
void decode_rows(const PackedLayout& l, const at::Tensor& packed, const at::Tensor& scale, int64_t e, int64_t r0,
                 int64_t r1, out_t* tile, const out_t* mx_pairs) {
  const int64_t in = l.in;
  if (l.format == Format::kMxfp4) {
    const uint8_t* p = packed.data_ptr<uint8_t>() + e * l.out * (in / 2);
    const uint8_t* s = scale.data_ptr<uint8_t>() + e * l.out * (in / 32);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g = 0; g < in / 32; ++g) {
        const out_t* pairs = mx_pairs + 512 * int64_t{s[r * (in / 32) + g]};
        const uint8_t* bytes = p + r * (in / 2) + g * 16;
        out_t* dst = tile + r * in + g * 32;
        for (int64_t c = 0; c < 16; ++c) {
          dst[2 * c] = pairs[2 * bytes[c]];
          dst[2 * c + 1] = pairs[2 * bytes[c] + 1];
        }
      }
    }
  } else if (l.format == Format::kInt4) {
    const int32_t* p = packed.data_ptr<int32_t>() + e * l.out * (in / 8);
    const int64_t groups = in / l.block_cols;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scale.scalar_type(), "decode_int4", [&] {
      using scale_t = scalar_t;
      const scale_t* s = scale.data_ptr<scale_t>() + e * l.out * groups;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t w = 0; w < in / 8; ++w) {
          const uint32_t word = static_cast<uint32_t>(p[r * (in / 8) + w]);
          const float sv = static_cast<float>(s[r * groups + (w * 8) / l.block_cols]);
          for (int64_t t = 0; t < 8; ++t) {
            const float q = static_cast<float>(static_cast<int>((word >> (4 * t)) & 0xF) - 8);
            // Rounded to the scale's dtype, as torch multiplies two tensors of that dtype.
            tile[r * in + w * 8 + t] = static_cast<out_t>(static_cast<float>(static_cast<scale_t>(q * sv)));
          }
        }
      }
    });
  } else {
    // FP8 byte -> float by a table (the same values as Float8_e4m3fn's conversion, without its
    // per-element bit work).
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
        for (int64_t c = c0; c < c1; ++c) tile[r * in + c] = static_cast<out_t>(kFp8[p[r * in + c]] * factor);
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
    if (l.format == Format::kMxfp4) mx_pairs_ = mxfp4_pair_table(like.scalar_type());
  }

  at::Tensor operator()(int64_t e) const {
    const auto thread = static_cast<size_t>(at::get_thread_num());
    TORCH_INTERNAL_ASSERT(thread < tiles_.size(), "lora_grouped_linear_packed: thread ", thread, " of ",
                          tiles_.size());
    auto& tile = tiles_[thread];
    if (!tile.defined()) tile = at::empty({l_.out, l_.in}, like_.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tile.scalar_type(), "decode_tile", [&] {
      scalar_t* dst = tile.data_ptr<scalar_t>();
      const scalar_t* mx_pairs = mx_pairs_.defined() ? mx_pairs_.data_ptr<scalar_t>() : nullptr;
      // A big expert runs alone with all threads (expert_schedule.h): decode its rows in parallel;
      // inside a worker's bin of small experts this runs on that thread alone.
      at::parallel_for(0, l_.out, 16, [&](int64_t r0, int64_t r1) {
        decode_rows<scalar_t>(l_, packed_, scale_, e, r0, r1, dst, mx_pairs);
      });
    });
    return tile;
  }

 private:
  PackedLayout l_;
  at::Tensor packed_, scale_, like_, mx_pairs_;
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
