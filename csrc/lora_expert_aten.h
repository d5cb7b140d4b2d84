// The grouped LoRA expert op as ATen calls per expert, on any device. The CPU kernel runs it on its
// thread pool (csrc/cpu); the NPU binding runs it for the dtypes its AscendC kernel does not take
// (csrc/ascendc). Arguments are checked by the caller (lora_expert_checks.h).
//
// Rows arrive grouped by expert; expert e owns rows offsets[e]..offsets[e+1]. Each expert's GEMMs run
// on narrow() views of the grouped buffers and write straight into the output, so there is no
// gather/scatter copy and no per-expert Python.
//
//   h = x_l A^T                     (x_l = LoRA input: x, or x * dropout mask)
//   y = x W^T + s h B^T             (times p per row when probs p are given)
//   dB = s dy^T h,  dh = s dy B,  dA = dh^T x_l,  dx = dy W + (dh A) [* mask]
// With probs the output was p * y, so dB = s dy^T (p h) and dA = (p dh)^T x_l, and dx comes back
// without the row scale (the caller forms p * dx and rowsum(x * dx), see csrc/bindings.cpp).
//
// for_each_expert(offsets, macs_per_row, fn) must call fn(e) once for every expert; it decides
// where and in which order.
//
// The *_tiles forms take W as weight_of(e), a function giving expert e's [d_out, d_in] matrix where
// a GEMM needs it (a packed weight's kernel decodes it into scratch there, csrc/cpu/
// lora_expert_packed.cpp); the plain forms pass the slices of a dense W.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

#include "lora_expert_checks.h"

namespace slmoe {

// W_e [out, in] as the right operand of dx = dy W_e. ATen's CPU GEMM in bf16/fp16 (without
// oneDNN's reduced-precision path) is a dot-product loop over contiguous rows: dy W_e strides
// down W_e's columns and ran 10-40x slower than x W_e^T at K3's expert shapes. On the CPU, the
// product takes a contiguous W_e^T (one transient tile per thread), read back as its transpose.
inline at::Tensor dx_operand(const at::Tensor& w) {
  if (w.device().is_cpu() && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf)) {
    return w.t().contiguous().t();
  }
  return w;
}

template <typename WeightOf, typename ForEachExpert>
std::tuple<at::Tensor, at::Tensor> lora_grouped_linear_fwd_aten_tiles(
    const GroupedDims& d, const std::vector<int64_t>& offsets, const at::Tensor& x_in, const WeightOf& weight_of,
    const at::Tensor& lora_a_in, const at::Tensor& lora_b_in, double scaling,
    const std::optional<at::Tensor>& lora_x_in, const std::optional<at::Tensor>& probs_in,
    const ForEachExpert& for_each_expert) {
  at::AutoDispatchBelowADInplaceOrView guard;
  const auto x = x_in.contiguous();
  const auto lora_a = lora_a_in.contiguous();
  const auto lora_b = lora_b_in.contiguous();
  const auto lora_x = lora_x_in.has_value() ? lora_x_in->contiguous() : x;
  std::optional<at::Tensor> probs;
  if (probs_in.has_value()) probs = probs_in->contiguous().unsqueeze(1);
  auto y = at::empty({d.T, d.d_out}, x.options());
  auto h = at::empty({d.T, d.r}, x.options());

  const int64_t macs_per_row = d.d_in * d.d_out + d.r * (d.d_in + d.d_out);
  for_each_expert(offsets, macs_per_row, [&](int64_t e) {
    const int64_t off = offsets[e], n = offsets[e + 1] - off;
    if (n == 0) return;
    auto h_e = h.narrow(0, off, n);
    auto y_e = y.narrow(0, off, n);
    at::mm_out(h_e, lora_x.narrow(0, off, n), lora_a[e].t());
    at::mm_out(y_e, x.narrow(0, off, n), weight_of(e).t());
    y_e.addmm_(h_e, lora_b[e].t(), /*beta=*/1, /*alpha=*/scaling);
    if (probs.has_value()) y_e.mul_(probs->narrow(0, off, n));  // while the tile is in cache
  });
  return {y, h};
}

template <typename ForEachExpert>
std::tuple<at::Tensor, at::Tensor> lora_grouped_linear_fwd_aten(
    const GroupedDims& d, const std::vector<int64_t>& offsets, const at::Tensor& x_in, const at::Tensor& weight_in,
    const at::Tensor& lora_a_in, const at::Tensor& lora_b_in, double scaling,
    const std::optional<at::Tensor>& lora_x_in, const std::optional<at::Tensor>& probs_in,
    const ForEachExpert& for_each_expert) {
  at::AutoDispatchBelowADInplaceOrView guard;
  const auto weight = weight_in.contiguous();
  return lora_grouped_linear_fwd_aten_tiles(
      d, offsets, x_in, [&](int64_t e) { return weight[e]; }, lora_a_in, lora_b_in, scaling, lora_x_in, probs_in,
      for_each_expert);
}

template <typename WeightOf, typename ForEachExpert>
std::tuple<at::Tensor, at::Tensor, at::Tensor> lora_grouped_linear_bwd_aten_tiles(
    const GroupedDims& d, const std::vector<int64_t>& offsets, const at::Tensor& grad_y_in,
    const at::Tensor& lora_x_in, const WeightOf& weight_of, const at::Tensor& lora_a_in,
    const at::Tensor& lora_b_in, const at::Tensor& h_in, double scaling,
    const std::optional<at::Tensor>& lora_mask_in, std::array<bool, 3> output_mask,
    const std::optional<at::Tensor>& probs_in, const ForEachExpert& for_each_expert) {
  const bool need_dx = output_mask[0], need_da = output_mask[1], need_db = output_mask[2];
  at::AutoDispatchBelowADInplaceOrView guard;
  const auto dy = grad_y_in.contiguous();
  const auto lora_x = lora_x_in.contiguous();
  const auto lora_a = lora_a_in.contiguous();
  const auto lora_b = lora_b_in.contiguous();
  const auto h = h_in.contiguous();
  std::optional<at::Tensor> mask;
  if (lora_mask_in.has_value()) mask = lora_mask_in->contiguous();
  std::optional<at::Tensor> probs;
  if (probs_in.has_value()) probs = probs_in->contiguous().unsqueeze(1);

  const auto opts = lora_x.options();
  at::Tensor dx = need_dx ? at::empty({d.T, d.d_in}, opts) : at::Tensor();
  at::Tensor da = need_da ? at::empty({d.E, d.r, d.d_in}, opts) : at::Tensor();
  at::Tensor db = need_db ? at::empty({d.E, d.d_out, d.r}, opts) : at::Tensor();
  // dh feeds both dA and dx; one [T, r] buffer, each expert writes its own rows.
  at::Tensor dh = (need_dx || need_da) ? at::empty({d.T, d.r}, opts) : at::Tensor();

  const int64_t macs_per_row = d.d_in * d.d_out + 2 * d.r * (d.d_in + d.d_out);
  for_each_expert(offsets, macs_per_row, [&](int64_t e) {
    const int64_t off = offsets[e], n = offsets[e + 1] - off;
    if (n == 0) {
      // No rows routed here: the adapter's gradient is exactly zero.
      if (need_da) da[e].zero_();
      if (need_db) db[e].zero_();
      return;
    }
    const auto dy_e = dy.narrow(0, off, n);
    // The output's row scale reaches dA and dB through the rank-wide h and dh (cheaper than dy).
    const auto p_e = probs.has_value() ? std::optional<at::Tensor>(probs->narrow(0, off, n)) : std::nullopt;
    if (need_db) {
      auto db_e = db[e];
      const auto h_e = h.narrow(0, off, n);
      at::mm_out(db_e, dy_e.t(), p_e.has_value() ? h_e * *p_e : h_e);
      db_e.mul_(scaling);
    }
    if (!need_dx && !need_da) return;
    auto dh_e = dh.narrow(0, off, n);
    at::mm_out(dh_e, dy_e, lora_b[e]);
    dh_e.mul_(scaling);
    if (need_da) {
      auto da_e = da[e];
      at::mm_out(da_e, (p_e.has_value() ? dh_e * *p_e : dh_e).t(), lora_x.narrow(0, off, n));
    }
    if (need_dx) {
      auto dx_e = dx.narrow(0, off, n);
      at::mm_out(dx_e, dy_e, dx_operand(weight_of(e)));
      if (mask.has_value()) {
        // Dropout hit only the LoRA input, so only the LoRA term of dx is masked.
        dx_e.addcmul_(at::mm(dh_e, lora_a[e]), mask->narrow(0, off, n));
      } else {
        dx_e.addmm_(dh_e, lora_a[e]);
      }
    }
  });
  return {dx, da, db};
}

template <typename ForEachExpert>
std::tuple<at::Tensor, at::Tensor, at::Tensor> lora_grouped_linear_bwd_aten(
    const GroupedDims& d, const std::vector<int64_t>& offsets, const at::Tensor& grad_y_in,
    const at::Tensor& lora_x_in, const at::Tensor& weight_in, const at::Tensor& lora_a_in,
    const at::Tensor& lora_b_in, const at::Tensor& h_in, double scaling,
    const std::optional<at::Tensor>& lora_mask_in, std::array<bool, 3> output_mask,
    const std::optional<at::Tensor>& probs_in, const ForEachExpert& for_each_expert) {
  at::AutoDispatchBelowADInplaceOrView guard;
  const auto weight = weight_in.contiguous();
  return lora_grouped_linear_bwd_aten_tiles(
      d, offsets, grad_y_in, lora_x_in, [&](int64_t e) { return weight[e]; }, lora_a_in, lora_b_in, h_in, scaling,
      lora_mask_in, output_mask, probs_in, for_each_expert);
}

}  // namespace slmoe
