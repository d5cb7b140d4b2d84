// Runs the torch_npu binding (../lora_expert_npu.cpp, included below) on CPU tensors, end to end:
// its checks, dtype routing, contiguity, output allocation, output masks, dh scratch, planning and
// launches, with the AscendC kernel on the host emulation. Only the four torch_npu / ACL facilities
// the binding touches are stood in for, here:
//   OpCommand          runs its custom handler at Run() (torch_npu queues it on the task queue);
//   getCurrentNPUStream, OptionalNPUGuard   no-ops;
//   aclGetDeviceCapability                 reports 4 AI Cores.
// Results are compared with the op's per-expert ATen math (lora_expert_aten.h) in float64; the packed
// ops' (MXFP4, INT4, block FP8: the emulated decode kernel per chunk of experts, then the dense
// kernel; float32's ATen decode) with decode-then-dense, bit for bit (packed_checks).
//
//   npu_binding_test    exit 0 when every check passes
#include <acl/acl.h>
#include <torch_npu/csrc/core/npu/NPUGuard.h>
#include <torch_npu/csrc/core/npu/NPUStream.h>
#include <torch_npu/csrc/framework/OpCommand.h>

#include <cstdio>
#include <exception>
#include <string>

// ----- stand-ins ---------------------------------------------------------------------------------

aclError aclGetDeviceCapability(uint32_t, aclDeviceInfo info, int64_t* value) {
  *value = info == ACL_DEVICE_INFO_AI_CORE_NUM ? 4 : 0;
  return ACL_SUCCESS;
}

namespace c10_npu {
aclrtStream NPUStream::stream() const { return nullptr; }
aclrtStream NPUStream::stream(const bool) const { return nullptr; }
NPUStream getCurrentNPUStream(c10::DeviceIndex) { return NPUStream(); }
OptionalNPUGuard::OptionalNPUGuard(std::optional<c10::Device>) {}
OptionalNPUGuard::OptionalNPUGuard(c10::Device) {}
OptionalNPUGuard::~OptionalNPUGuard() {}
}  // namespace c10_npu

namespace at_npu {
namespace native {
namespace {
PROC_FUNC g_handler;
}
OpCommand::OpCommand() { g_handler = nullptr; }
OpCommand::~OpCommand() {}
OpCommand& OpCommand::Name(const std::string&) { return *this; }
OpCommand& OpCommand::SetCustomHandler(PROC_FUNC func) {
  g_handler = std::move(func);
  return *this;
}
void OpCommand::Run() {
  if (!g_handler || g_handler() != 0) throw std::runtime_error("OpCommand handler missing or failed");
}
}  // namespace native
}  // namespace at_npu

#include "../lora_expert_npu.cpp"  // the binding's functions live in an anonymous namespace

namespace slmoe_emu {
void gm_allow_unregistered(bool allow);  // ascendc_emu.cpp
}

namespace {

int g_failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++g_failures;
    std::printf("FAIL %s\n", what.c_str());
  }
}

double rel_err(const at::Tensor& got, const at::Tensor& want) {
  if (want.numel() == 0) return got.numel() == 0 ? 0.0 : 1.0;
  const auto w = want.to(at::kDouble);
  const double den = w.norm().item<double>();
  const double num = (got.to(at::kDouble) - w).norm().item<double>();
  return den > 0 ? num / den : num;
}

constexpr auto kSerial = [](const std::vector<int64_t>& offsets, int64_t, const auto& fn) {
  for (size_t e = 0; e + 1 < offsets.size(); ++e) fn(static_cast<int64_t>(e));
};

struct Case {
  std::string name;
  std::vector<int64_t> counts;
  int64_t d_in, d_out, r;
  at::ScalarType dtype;
  bool dropout;
  bool strided_x;  // x a column slice of a wider tensor (not contiguous)
  bool probs = false;  // router probabilities scale the output rows
};

void run(const Case& c) {
  const int64_t E = static_cast<int64_t>(c.counts.size());
  int64_t T = 0;
  for (int64_t n : c.counts) T += n;
  at::manual_seed(11);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = c.strided_x ? at::randn({T, c.d_in + 3}, f64).narrow(1, 2, c.d_in) : at::randn({T, c.d_in}, f64);
  const at::Tensor w = at::randn({E, c.d_out, c.d_in}, f64) / std::sqrt(double(c.d_in));
  const at::Tensor a = at::randn({E, c.r, c.d_in}, f64) / std::sqrt(double(c.d_in));
  const at::Tensor b = at::randn({E, c.d_out, c.r}, f64) / std::sqrt(double(std::max<int64_t>(c.r, 1)));
  const at::Tensor dy = at::randn({T, c.d_out}, f64);
  const at::Tensor mask = (at::rand({T, c.d_in}, f64) > 0.3).to(at::kDouble) / 0.7;
  const at::Tensor counts = at::tensor(c.counts, at::TensorOptions().dtype(at::kLong));
  const at::Tensor p = at::rand({T}, f64);
  const double s = 2.0;
  const auto dt = c.dtype;
  // Inputs rounded to the dtype; the reference computes in float64 from the rounded values.
  const at::Tensor xq = x.to(dt), wq = w.to(dt), aq = a.to(dt), bq = b.to(dt), dyq = dy.to(dt), mq = mask.to(dt);
  const at::Tensor lxq = c.dropout ? (xq * mq) : xq;
  const std::optional<at::Tensor> lora_x = c.dropout ? std::optional<at::Tensor>(lxq) : std::nullopt;
  const std::optional<at::Tensor> lora_mask = c.dropout ? std::optional<at::Tensor>(mq) : std::nullopt;
  const std::optional<at::Tensor> probs = c.probs ? std::optional<at::Tensor>(p.to(dt)) : std::nullopt;

  const auto [y, h] = slmoe::lora_grouped_linear_fwd_npu(xq, wq, aq, bq, counts, s, lora_x, probs);
  const auto d = slmoe::check_forward_inputs(xq, wq, aq, bq, counts, lora_x, probs);
  const auto offsets = slmoe::group_offsets(counts, T);
  const auto up = [](const at::Tensor& t) { return t.to(at::kDouble); };
  const std::optional<at::Tensor> lora_x64 = c.dropout ? std::optional<at::Tensor>(up(lxq)) : std::nullopt;
  const std::optional<at::Tensor> probs64 = c.probs ? std::optional<at::Tensor>(up(*probs)) : std::nullopt;
  const auto [y_ref, h_ref] = slmoe::lora_grouped_linear_fwd_aten(d, offsets, up(xq), up(wq), up(aq), up(bq), s,
                                                                  lora_x64, probs64, kSerial);
  const double tol = dt == at::kBFloat16 ? 1e-2 : (dt == at::kHalf ? 2e-3 : 1e-5);
  expect(y.scalar_type() == dt && h.scalar_type() == dt, c.name + ": output dtype");
  expect(rel_err(y, y_ref) < tol, c.name + ": y " + std::to_string(rel_err(y, y_ref)));
  expect(rel_err(h, h_ref) < tol, c.name + ": h " + std::to_string(rel_err(h, h_ref)));

  for (int outs = 0; outs < 8; ++outs) {
    const std::array<bool, 3> om = {bool(outs & 1), bool(outs & 2), bool(outs & 4)};
    const at::Tensor lx_in = c.dropout ? lxq : xq;
    const auto [dx, da, db] = slmoe::lora_grouped_linear_bwd_npu(dyq, lx_in, wq, aq, bq, h, counts, s, lora_mask, om,
                                                                 probs);
    const std::optional<at::Tensor> mask64 = c.dropout ? std::optional<at::Tensor>(up(mq)) : std::nullopt;
    const auto [dx_ref, da_ref, db_ref] = slmoe::lora_grouped_linear_bwd_aten(
        d, offsets, up(dyq), up(lx_in), up(wq), up(aq), up(bq), up(h), s, mask64, {true, true, true}, probs64,
        kSerial);
    const std::string tag = c.name + " output_mask " + std::to_string(outs);
    expect(dx.defined() == om[0] && da.defined() == om[1] && db.defined() == om[2], tag + ": undefined outputs");
    if (om[0]) expect(rel_err(dx, dx_ref) < tol, tag + ": dx " + std::to_string(rel_err(dx, dx_ref)));
    if (om[1]) expect(rel_err(da, da_ref) < tol, tag + ": dA " + std::to_string(rel_err(da, da_ref)));
    if (om[2]) expect(rel_err(db, db_ref) < tol, tag + ": dB " + std::to_string(rel_err(db, db_ref)));
  }
  std::printf("ok   %s\n", c.name.c_str());
}

template <typename Error>
void expect_error(const std::string& what, const std::string& message, const std::function<void()>& fn) {
  try {
    fn();
    expect(false, what + ": no error");
  } catch (const Error& e) {
    expect(std::string(e.what()).find(message) != std::string::npos, what + ": message was " + e.what());
  }
}


// ----- packed weights ----------------------------------------------------------------------------
//
// The packed ops (the AscendC decode into a scratch per chunk of experts, then the dense kernel; the
// ATen decode for float32) against decode-then-dense: y, h, dx, dA, dB equal, bit for bit, the dense
// op's on the weight decoded here element by element from the formats' definitions
// (csrc/lora_expert_packed.h), independently of both decoders. The dense op is held to float64 above.

struct PackedCase {
  std::string name, format;
  std::vector<int64_t> counts;
  int64_t d_in, d_out, r;
  std::vector<int64_t> block;
  at::ScalarType dtype, scale_dtype;  // scale_dtype: pack-quantized only
  bool dropout, probs;
  slmoe::PackedLimits limits;
};

struct PackedWeight {
  at::Tensor packed, scale;
  at::Tensor decoded;  // [E, d_out, d_in] float32, before the cast to x's dtype
};

float e2m1(int code) {
  const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  return (code & 8) ? -mag[code & 7] : mag[code & 7];
}

template <typename T>
float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

PackedWeight make_packed(const PackedCase& c, int64_t E) {
  const int64_t out = c.d_out, in = c.d_in, br = c.block[0], bc = c.block[1];
  const auto u8 = at::TensorOptions().dtype(at::kByte);
  PackedWeight w;
  w.decoded = at::empty({E, out, in}, at::TensorOptions().dtype(at::kFloat));
  auto dec = w.decoded.accessor<float, 3>();
  if (c.format == "mxfp4-pack-quantized") {
    w.packed = at::randint(0, 256, {E, out, in / 2}, u8);
    w.scale = at::randint(118, 131, {E, out, in / 32}, u8);
    const auto p = w.packed.accessor<uint8_t, 3>();
    const auto s = w.scale.accessor<uint8_t, 3>();
    for (int64_t e = 0; e < E; ++e)
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) {
          const int code = (i % 2 == 0) ? (p[e][o][i / 2] & 0xF) : (p[e][o][i / 2] >> 4);
          dec[e][o][i] = e2m1(code) * std::ldexp(1.0f, int(s[e][o][i / 32]) - 127);
        }
  } else if (c.format == "pack-quantized") {
    w.packed = at::randint(std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(),
                           {E, out, in / 8}, at::TensorOptions().dtype(at::kInt));
    w.scale = (at::rand({E, out, in / bc}) * 0.1 + 0.01).to(c.scale_dtype);
    const auto p = w.packed.accessor<int32_t, 3>();
    const auto s = w.scale.to(at::kFloat);  // exact
    const auto sa = s.accessor<float, 3>();
    for (int64_t e = 0; e < E; ++e)
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) {
          const int q = int((static_cast<uint32_t>(p[e][o][i / 8]) >> (4 * (i % 8))) & 0xF) - 8;
          const float v = float(q) * sa[e][o][i / bc];  // exact in float; rounded in the scale's dtype
          dec[e][o][i] = c.scale_dtype == at::kBFloat16 ? round_to<c10::BFloat16>(v)
                         : c.scale_dtype == at::kHalf   ? round_to<c10::Half>(v)
                                                        : v;
        }
  } else {
    auto bytes = at::randint(0, 256, {E, out, in}, u8);
    bytes.masked_fill_(bytes.bitwise_and(0x7F) == 0x7F, 0);  // no NaN codes
    w.packed = bytes.view(at::kFloat8_e4m3fn);
    w.scale = at::rand({E, (out + br - 1) / br, (in + bc - 1) / bc}) * 0.05;
    const auto p = bytes.accessor<uint8_t, 3>();
    const auto s = w.scale.accessor<float, 3>();
    for (int64_t e = 0; e < E; ++e)
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) {
          const float v = static_cast<float>(c10::Float8_e4m3fn(p[e][o][i], c10::Float8_e4m3fn::from_bits()));
          dec[e][o][i] = v * s[e][o / br][i / bc];
        }
  }
  return w;
}

void expect_same(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  const bool same = got.defined() == want.defined() &&
                    (!got.defined() || (got.scalar_type() == want.scalar_type() && at::equal(got, want)));
  expect(same, what + (same || !got.defined() || !want.defined()
                           ? std::string()
                           : " differs from decode-then-dense by " + std::to_string(rel_err(got, want))));
}

void run_packed(const PackedCase& c) {
  const int64_t E = static_cast<int64_t>(c.counts.size());
  int64_t T = 0;
  for (int64_t n : c.counts) T += n;
  at::manual_seed(29);
  const auto dt = c.dtype;
  const auto o = at::TensorOptions().dtype(dt);
  const PackedWeight pw = make_packed(c, E);
  const at::Tensor w = pw.decoded.to(dt);  // decode-then-dense's weight
  const at::Tensor x = at::randn({T, c.d_in}, o);
  const at::Tensor a = (at::randn({E, c.r, c.d_in}) / std::sqrt(double(c.d_in))).to(dt);
  const at::Tensor b = (at::randn({E, c.d_out, c.r}) / std::sqrt(double(c.r))).to(dt);
  const at::Tensor dy = at::randn({T, c.d_out}, o);
  const at::Tensor mask = ((at::rand({T, c.d_in}) > 0.3).to(at::kFloat) / 0.7).to(dt);
  const at::Tensor counts = at::tensor(c.counts, at::TensorOptions().dtype(at::kLong));
  const double s = 2.0;
  const std::optional<at::Tensor> lora_x = c.dropout ? std::optional<at::Tensor>(x * mask) : std::nullopt;
  const std::optional<at::Tensor> lora_mask = c.dropout ? std::optional<at::Tensor>(mask) : std::nullopt;
  const std::optional<at::Tensor> probs = c.probs ? std::optional<at::Tensor>(at::rand({T}).to(dt)) : std::nullopt;
  const std::vector<int64_t> shape{c.d_out, c.d_in};

  const auto [y, h] = slmoe::packed_fwd_npu(x, a, b, counts, s, lora_x, probs, pw.packed, pw.scale, c.format,
                                            c.block, shape, c.limits);
  const auto [y_ref, h_ref] = slmoe::lora_grouped_linear_fwd_npu(x, w, a, b, counts, s, lora_x, probs);
  expect_same(y, y_ref, c.name + ": y");
  expect_same(h, h_ref, c.name + ": h");
  // dx alone (decoded), dA and dB alone (nothing decoded), all three; the dense op's other masks
  // are run above.
  for (int outs : {1, 6, 7}) {
    const std::array<bool, 3> om = {bool(outs & 1), bool(outs & 2), bool(outs & 4)};
    const at::Tensor lx = c.dropout ? *lora_x : x;
    const auto [dx, da, db] = slmoe::packed_bwd_npu(dy, lx, a, b, h, counts, s, lora_mask, om, probs, pw.packed,
                                                    pw.scale, c.format, c.block, shape, c.limits);
    const auto [dx_ref, da_ref, db_ref] =
        slmoe::lora_grouped_linear_bwd_npu(dy, lx, w, a, b, h, counts, s, lora_mask, om, probs);
    const std::string tag = c.name + " output_mask " + std::to_string(outs);
    expect_same(dx, dx_ref, tag + ": dx");
    expect_same(da, da_ref, tag + ": dA");
    expect_same(db, db_ref, tag + ": dB");
  }
  std::printf("ok   %s\n", c.name.c_str());
}

void packed_checks() {
  // Two experts a chunk (three chunks, one without rows), decode segments of at most 64 columns
  // (96 inputs: two segments a row; FP8's 80: a short last one, and a partial scale block).
  const std::vector<int64_t> uneven{0, 5, 0, 0, 3, 4};
  const slmoe::PackedLimits small{2, 64};
  const auto f32 = at::kFloat, bf = at::kBFloat16;
  for (auto dt : {at::kBFloat16, at::kHalf, at::kFloat}) {
    const std::string n = dt == at::kBFloat16 ? "bf16" : (dt == at::kHalf ? "fp16" : "fp32 (ATen decode)");
    run_packed({n + " mxfp4", "mxfp4-pack-quantized", uneven, 96, 37, 8, {1, 32}, dt, f32, false, false, small});
    run_packed({n + " int4 g32 bf16 scale, dropout, probs", "pack-quantized", uneven, 96, 37, 8, {1, 32}, dt, bf,
                true, true, small});
    run_packed({n + " block-fp8 [4, 32]", "block-fp8", uneven, 80, 37, 8, {4, 32}, dt, f32, false, true, small});
  }
  run_packed({"fp16 int4 g64 fp16 scale, one expert a chunk", "pack-quantized", uneven, 128, 24, 4, {1, 64},
              at::kHalf, at::kHalf, true, false, {1, 64}});
  run_packed({"bf16 mxfp4, the registered op's chunks and segments", "mxfp4-pack-quantized", uneven, 96, 37, 8,
              {1, 32}, at::kBFloat16, f32, false, true, {}});
  run_packed({"bf16 int4 no rows", "pack-quantized", {0, 0, 0}, 64, 24, 4, {1, 32}, at::kBFloat16, f32, false,
              false, small});

  // The registered ops are these with the default limits.
  const auto bfo = at::TensorOptions().dtype(at::kBFloat16);
  const auto u8 = at::TensorOptions().dtype(at::kByte);
  const auto counts = at::tensor(std::vector<int64_t>{2}, at::TensorOptions().dtype(at::kLong));
  const at::Tensor x = at::randn({2, 64}, bfo), a = at::randn({1, 4, 64}, bfo), b = at::randn({1, 8, 4}, bfo);
  const at::Tensor p = at::randint(0, 256, {1, 8, 32}, u8), sc = at::randint(120, 130, {1, 8, 2}, u8);
  const auto [y0, h0] = slmoe::packed_fwd_npu(x, a, b, counts, 1.0, std::nullopt, std::nullopt, p, sc,
                                              "mxfp4-pack-quantized", {1, 32}, {8, 64}, {});
  const auto [y1, h1] = slmoe::lora_grouped_linear_packed_fwd_npu(x, a, b, counts, 1.0, std::nullopt, std::nullopt,
                                                                  p, sc, "mxfp4-pack-quantized", {1, 32}, {8, 64});
  expect(at::equal(y0, y1) && at::equal(h0, h1), "registered packed forward: the default limits");

  // A planner refusal is one line naming it; the shared layout checks come first.
  const auto fp8 = at::zeros({1, 8, 96}, u8).view(at::kFloat8_e4m3fn);
  expect_error<c10::ValueError>("planner refusal", "lora_grouped_linear_packed (NPU): scale blocks of 80 columns", [&] {
    slmoe::packed_fwd_npu(at::zeros({2, 96}, bfo), at::zeros({1, 4, 96}, bfo), at::zeros({1, 8, 4}, bfo), counts,
                          1.0, std::nullopt, std::nullopt, fp8, at::ones({1, 8, 2}), "block-fp8", {1, 80}, {8, 96},
                          {1, 64});
  });
  expect_error<c10::TypeError>("packed float64", "float64 is not supported on Ascend NPUs", [&] {
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    slmoe::lora_grouped_linear_packed_fwd_npu(at::zeros({2, 64}, f64), at::zeros({1, 4, 64}, f64),
                                              at::zeros({1, 8, 4}, f64), counts, 1.0, std::nullopt, std::nullopt, p,
                                              sc, "mxfp4-pack-quantized", {1, 32}, {8, 64});
  });
  expect_error<c10::ValueError>("packed layout", "lora_grouped_linear_packed: mxfp4-pack-quantized blocks are", [&] {
    slmoe::lora_grouped_linear_packed_fwd_npu(x, a, b, counts, 1.0, std::nullopt, std::nullopt, p, sc,
                                              "mxfp4-pack-quantized", {1, 16}, {8, 64});
  });
}
}  // namespace

int main() {
  slmoe_emu::gm_allow_unregistered(true);  // the binding allocates its outputs itself
  const std::vector<int64_t> uneven{0, 5, 0, 7, 3, 0};
  for (auto dt : {at::kBFloat16, at::kHalf, at::kFloat}) {
    const std::string n = dt == at::kBFloat16 ? "bf16" : (dt == at::kHalf ? "fp16" : "fp32 (ATen path)");
    run({n + " uneven", uneven, 13, 37, 8, dt, false, false});
    run({n + " dropout, strided x", uneven, 13, 37, 16, dt, true, true});
    run({n + " probs, dropout", uneven, 13, 37, 8, dt, true, false, true});
  }
  run({"bf16 no rows", {0, 0, 0}, 16, 24, 4, at::kBFloat16, false, false});
  run({"bf16 rank 0", {3, 0, 4}, 16, 24, 0, at::kBFloat16, false, false});

  const auto f = at::TensorOptions().dtype(at::kDouble);
  const auto counts = at::tensor(std::vector<int64_t>{2}, at::TensorOptions().dtype(at::kLong));
  expect_error<c10::TypeError>("float64", "float64 is not supported on Ascend NPUs", [&] {
    slmoe::lora_grouped_linear_fwd_npu(at::zeros({2, 4}, f), at::zeros({1, 3, 4}, f), at::zeros({1, 2, 4}, f),
                                       at::zeros({1, 3, 2}, f), counts, 1.0, std::nullopt, std::nullopt);
  });
  const auto bf = at::TensorOptions().dtype(at::kBFloat16);
  expect_error<c10::ValueError>("d_in limit", "d_in, d_out and r must be at most 65535", [&] {
    slmoe::lora_grouped_linear_fwd_npu(at::zeros({2, 65536}, bf), at::zeros({1, 1, 65536}, bf),
                                       at::zeros({1, 1, 65536}, bf), at::zeros({1, 1, 1}, bf), counts, 1.0,
                                       std::nullopt, std::nullopt);
  });
  expect_error<c10::ValueError>("shared checks", "tokens_per_expert sums to 2 but x has 3 rows", [&] {
    slmoe::lora_grouped_linear_fwd_npu(at::zeros({3, 4}, bf), at::zeros({1, 3, 4}, bf), at::zeros({1, 2, 4}, bf),
                                       at::zeros({1, 3, 2}, bf), counts, 1.0, std::nullopt, std::nullopt);
  });
  packed_checks();
  if (g_failures) {
    std::printf("npu_binding_test: %d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("npu_binding_test: all checks passed\n");
  return 0;
}
