// Runs the torch_npu binding (../lora_expert_npu.cpp, included below) on CPU tensors, end to end:
// its checks, dtype routing, contiguity, output allocation, output masks, dh scratch, planning and
// launches, with the AscendC kernel on the host emulation. Only the four torch_npu / ACL facilities
// the binding touches are stood in for, here:
//   OpCommand          runs its custom handler at Run() (torch_npu queues it on the task queue);
//   getCurrentNPUStream, OptionalNPUGuard   no-ops;
//   aclGetDeviceCapability                 reports 4 AI Cores.
// Results are compared with the op's per-expert ATen math (lora_expert_aten.h) in float64.
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
  if (g_failures) {
    std::printf("npu_binding_test: %d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("npu_binding_test: all checks passed\n");
  return 0;
}
