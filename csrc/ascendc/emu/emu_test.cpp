// Runs the AscendC kernel (../lora_expert_kernel.cpp, built against the emulation in include/) through
// the planner and launcher the torch_npu binding uses, and checks h, y, dx, dA, dB against an fp64
// loop reference over the shapes of tests/kernels/test_lora_expert_op.py (ranks 4-32, uneven and empty
// groups, d not multiples of 16) and more: dropout mask, partial output masks, no rows, rank 0,
// one-row experts (the cube's GEMV mode), a dominant expert, 300 experts, multi-tile sizes, and
// "tiny" hardware budgets that force many K chunks, K steps, column tiles and epilogue chunks.
//
//   emu_test [--quick]     exit 0 when every case passes, 1 when a check fails; the emulation
//                          itself exits 3 on an API violation or a race (see kernel_operator.h)
//
// Global memory buffers are registered with the emulation: inputs read-only, each launch's outputs
// and workspace writable, everything NaN-filled first, so a missed or misplaced write shows.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "../lora_expert_ascend.h"
#include "../lora_tiling.h"
#include "kernel_operator.h"

namespace {

using slmoe_ascend::DType;
using slmoe_ascend::HwCaps;

int g_failures = 0;

const char* dtype_name(DType t) { return t == DType::kBFloat16 ? "bf16" : "fp16"; }

// A "device" buffer of 2-byte elements.
struct Buf {
  DType t;
  std::vector<uint16_t> v;
  Buf(DType t_, size_t n) : t(t_), v(n, 0xffff) {}  // NaN
  double get(size_t i) const {
    if (t == DType::kBFloat16) {
      bfloat16_t b;
      b.bits = v[i];
      return static_cast<float>(b);
    }
    half h;
    h.bits = v[i];
    return static_cast<float>(h);
  }
  void set(size_t i, double x) {
    v[i] = t == DType::kBFloat16 ? bfloat16_t(static_cast<float>(x)).bits : half(static_cast<float>(x)).bits;
  }
  void* ptr() { return v.empty() ? nullptr : v.data(); }
  std::vector<double> values() const {
    std::vector<double> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = get(i);
    return out;
  }
};

struct Case {
  std::string name;
  DType dtype;
  std::vector<int64_t> counts;
  int64_t d_in, d_out, r;
  bool dropout = false;
  bool need_dx = true, need_da = true, need_db = true;
  HwCaps caps;
  double scaling = 2.0;
};

// Budgets small enough that small matrices need several K chunks and steps, column tiles,
// epilogue chunks and tiles per core.
HwCaps tiny_caps() {
  HwCaps c;
  c.numAic = 3;
  c.l1Bytes = 12 * 1024;
  c.l0aBytes = 2 * 1024;
  c.l0bBytes = 2 * 1024;
  c.l0cBytes = 8 * 1024;
  c.ubBytes = 4 * 1024;
  return c;
}

HwCaps a2_caps(uint32_t cores) {
  HwCaps c;
  c.numAic = cores;
  return c;
}

double tolerance(DType t) { return t == DType::kBFloat16 ? 1e-2 : 2e-3; }

struct ErrStat {
  double rel = 0;   // ||got - want|| / ||want||, worst case
  double abs = 0;   // max |got - want| / max |want|, worst case
};
std::map<std::string, ErrStat> g_err;  // "<dtype> <output>"

void check(const Case& c, const char* what, const Buf& got, const std::vector<double>& want) {
  double num = 0, den = 0, max_diff = 0, max_ref = 0;
  bool finite = true;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = got.get(i);
    finite = finite && std::isfinite(g);
    num += (g - want[i]) * (g - want[i]);
    den += want[i] * want[i];
    max_diff = std::max(max_diff, std::fabs(g - want[i]));
    max_ref = std::max(max_ref, std::fabs(want[i]));
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  const double abs_rel = max_ref > 0 ? max_diff / max_ref : max_diff;
  ErrStat& s = g_err[std::string(dtype_name(c.dtype)) + " " + what];
  if (finite) {
    s.rel = std::max(s.rel, rel);
    s.abs = std::max(s.abs, abs_rel);
  }
  if (!finite || rel > tolerance(c.dtype)) {
    ++g_failures;
    std::printf("FAIL %-28s %s %-2s rel_err %.3e (tol %.0e)%s\n", c.name.c_str(), dtype_name(c.dtype), what, rel,
                tolerance(c.dtype), finite ? "" : " non-finite");
  }
}

// Runs the launches of one plan the way the binding does: tiling bytes and a NaN workspace in
// "device" memory, every tensor the launch writes registered writable, the rest read-only.
void run(const std::vector<slmoe_ascend::LaunchPlan>& plans, DType dtype, void* const tensors[slmoe_ascend::kNumTensors],
         const size_t tensor_bytes[slmoe_ascend::kNumTensors]) {
  for (const auto& plan : plans) {
    if (plan.blockDim == 0) continue;
    const auto& h = slmoe_ascend::tiling_header(plan);
    std::vector<uint8_t> tiling = plan.tiling;
    std::vector<float> ws(plan.workspaceBytes / sizeof(float), std::nanf(""));
    bool writes[slmoe_ascend::kNumTensors] = {};
    for (uint32_t p = 0; p < h.numProblems; ++p) writes[h.problems[p].c.tensor] = true;
    slmoe_emu::gm_clear();
    for (uint32_t i = 0; i < slmoe_ascend::kNumTensors; ++i) {
      if (tensors[i] == nullptr || tensor_bytes[i] == 0) continue;
      if (!writes[i] && tensor_bytes[i] > 0) slmoe_emu::gm_register(tensors[i], tensor_bytes[i], false, "input");
    }
    for (uint32_t i = 0; i < slmoe_ascend::kNumTensors; ++i) {
      if (writes[i] && tensors[i] != nullptr) slmoe_emu::gm_register(tensors[i], tensor_bytes[i], true, "output");
    }
    slmoe_emu::gm_register(ws.data(), ws.size() * sizeof(float), true, "workspace");
    slmoe_emu::gm_register(tiling.data(), tiling.size(), false, "tiling");
    slmoe_ascend::launch_lora_grouped_gemm(dtype, plan.blockDim, nullptr, tensors, ws.data(), tiling.data());
  }
  slmoe_emu::gm_clear();
}

void run_case(const Case& c, std::mt19937_64& rng) {
  using namespace slmoe_ascend;
  const DType t = c.dtype;
  const int64_t E = static_cast<int64_t>(c.counts.size());
  int64_t T = 0;
  for (int64_t n : c.counts) T += n;
  const int64_t d_in = c.d_in, d_out = c.d_out, r = c.r;
  std::normal_distribution<double> normal;
  auto fill = [&](Buf& b, double scale) {
    for (size_t i = 0; i < b.v.size(); ++i) b.set(i, normal(rng) * scale);
  };
  Buf x(t, T * d_in), w(t, E * d_out * d_in), a(t, E * r * d_in), bb(t, E * d_out * r), gy(t, T * d_out);
  Buf mask(t, T * d_in), lx(t, T * d_in);
  fill(x, 1.0);
  fill(w, 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(d_in, 1))));
  fill(a, 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(d_in, 1))));
  fill(bb, 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(r, 1))));
  fill(gy, 1.0);
  std::bernoulli_distribution keep(0.7);
  for (size_t i = 0; i < mask.v.size(); ++i) {
    mask.set(i, keep(rng) ? 1.0 / 0.7 : 0.0);
    lx.set(i, x.get(i) * mask.get(i));  // rounded to the dtype, as x * mask in torch
  }
  Buf& lora_in = c.dropout ? lx : x;
  Buf h(t, T * r), y(t, T * d_out), dh(t, T * r), dx(t, T * d_in), da(t, E * r * d_in), db(t, E * d_out * r);

  LoraDims dims;
  dims.T = T;
  dims.E = E;
  dims.d_in = d_in;
  dims.d_out = d_out;
  dims.r = r;
  dims.scaling = c.scaling;
  void* tensors[kNumTensors] = {};
  size_t bytes[kNumTensors] = {};
  auto put = [&](TensorId id, Buf& b) {
    tensors[id] = b.ptr();
    bytes[id] = b.v.size() * 2;
  };
  put(kTensorX, x);
  put(kTensorLoraX, lora_in);
  put(kTensorWeight, w);
  put(kTensorLoraA, a);
  put(kTensorLoraB, bb);
  put(kTensorH, h);
  put(kTensorY, y);
  run(plan_forward(dims, c.counts.data(), c.caps), t, tensors, bytes);

  put(kTensorGradY, gy);
  if (c.dropout) put(kTensorMask, mask);
  put(kTensorDh, dh);
  put(kTensorDx, dx);
  put(kTensorDa, da);
  put(kTensorDb, db);
  run(plan_backward(dims, c.counts.data(), c.dropout, c.need_dx, c.need_da, c.need_db, c.caps), t, tensors, bytes);

  // fp64 reference from the dtype-rounded inputs. y uses the fp64 h; the backward uses the kernel's h
  // (the op saves h in the dtype), so each comparison isolates one launch chain.
  const std::vector<double> X = x.values(), LX = lora_in.values(), W = w.values(), A = a.values(), B = bb.values();
  const std::vector<double> GY = gy.values(), M = mask.values(), Hk = h.values();
  std::vector<double> Y(T * d_out, 0), H(T * r, 0), DX(T * d_in, 0), DA(E * r * d_in, 0), DB(E * d_out * r, 0);
  const double s = c.scaling;
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = row; i < row + c.counts[e]; ++i) {
      for (int64_t j = 0; j < r; ++j) {
        double acc = 0;
        for (int64_t k = 0; k < d_in; ++k) acc += LX[i * d_in + k] * A[(e * r + j) * d_in + k];
        H[i * r + j] = acc;
      }
      for (int64_t o = 0; o < d_out; ++o) {
        double base = 0, lora = 0;
        for (int64_t k = 0; k < d_in; ++k) base += X[i * d_in + k] * W[(e * d_out + o) * d_in + k];
        for (int64_t j = 0; j < r; ++j) lora += H[i * r + j] * B[(e * d_out + o) * r + j];
        Y[i * d_out + o] = base + s * lora;
      }
      std::vector<double> dhv(r, 0);
      for (int64_t j = 0; j < r; ++j)
        for (int64_t o = 0; o < d_out; ++o) dhv[j] += s * GY[i * d_out + o] * B[(e * d_out + o) * r + j];
      for (int64_t k = 0; k < d_in; ++k) {
        double base = 0, lora = 0;
        for (int64_t o = 0; o < d_out; ++o) base += GY[i * d_out + o] * W[(e * d_out + o) * d_in + k];
        for (int64_t j = 0; j < r; ++j) lora += dhv[j] * A[(e * r + j) * d_in + k];
        DX[i * d_in + k] = base + (c.dropout ? lora * M[i * d_in + k] : lora);
      }
      for (int64_t j = 0; j < r; ++j)
        for (int64_t k = 0; k < d_in; ++k) DA[(e * r + j) * d_in + k] += dhv[j] * LX[i * d_in + k];
      for (int64_t o = 0; o < d_out; ++o)
        for (int64_t j = 0; j < r; ++j) DB[(e * d_out + o) * r + j] += s * GY[i * d_out + o] * Hk[i * r + j];
    }
    row += c.counts[e];
  }
  check(c, "h", h, H);
  check(c, "y", y, Y);
  if (c.need_dx) check(c, "dx", dx, DX);
  if (c.need_da) check(c, "dA", da, DA);
  if (c.need_db) check(c, "dB", db, DB);
  // Experts without rows get exactly zero adapter gradients.
  for (int64_t e = 0; e < E; ++e) {
    if (c.counts[e] != 0) continue;
    for (int64_t i = 0; c.need_da && i < r * d_in; ++i) {
      if (da.get(e * r * d_in + i) != 0.0) {
        ++g_failures;
        std::printf("FAIL %s: dA of empty expert %lld not zero\n", c.name.c_str(), static_cast<long long>(e));
        break;
      }
    }
    for (int64_t i = 0; c.need_db && i < d_out * r; ++i) {
      if (db.get(e * d_out * r + i) != 0.0) {
        ++g_failures;
        std::printf("FAIL %s: dB of empty expert %lld not zero\n", c.name.c_str(), static_cast<long long>(e));
        break;
      }
    }
  }
  std::printf("ok   %-28s %s T=%lld E=%lld %lldx%lld r=%lld\n", c.name.c_str(), dtype_name(t),
              static_cast<long long>(T), static_cast<long long>(E), static_cast<long long>(d_in),
              static_cast<long long>(d_out), static_cast<long long>(r));
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  std::mt19937_64 rng(1234);
  std::vector<Case> cases;
  const std::vector<int64_t> uneven{0, 5, 0, 7, 3, 0};  // tests/kernels/test_lora_expert_op.py: COUNTS, D_IN, D_OUT
  for (DType t : {DType::kBFloat16, DType::kFloat16}) {
    for (int64_t r : {4, 8, 16, 32}) {
      cases.push_back({"uneven_r" + std::to_string(r), t, uneven, 13, 37, r, false, true, true, true, a2_caps(4)});
    }
    cases.push_back({"dropout_mask", t, uneven, 13, 37, 8, true, true, true, true, a2_caps(4)});
    cases.push_back({"tiny_budgets_mask", t, {40, 0, 1, 77}, 100, 70, 24, true, true, true, true, tiny_caps()});
    if (!quick || t == DType::kBFloat16) {
      // with the mask, the epilogue chunk is bounded by UB rather than by the tile's rows
      cases.push_back({"multi_tile_mask", t, {130, 0, 3, 260, 1}, 136, 72, 16, true, true, true, true, a2_caps(3)});
    }
  }
  cases.push_back({"dominant_expert", DType::kBFloat16, {1, 300, 0, 2}, 40, 48, 16, false, true, true, true, a2_caps(4)});
  cases.push_back({"only_dA", DType::kBFloat16, uneven, 16, 24, 8, false, false, true, false, a2_caps(4)});
  cases.push_back({"only_dx_mask", DType::kFloat16, uneven, 16, 24, 8, true, true, false, false, a2_caps(4)});
  cases.push_back({"only_dB", DType::kFloat16, uneven, 16, 24, 8, false, false, false, true, a2_caps(4)});
  cases.push_back({"no_rows", DType::kBFloat16, {0, 0, 0}, 16, 24, 8, false, true, true, true, a2_caps(4)});
  cases.push_back({"rank_0", DType::kBFloat16, {3, 0, 4}, 16, 24, 0, false, true, true, true, a2_caps(4)});
  cases.push_back({"narrow_dims", DType::kFloat16, {3, 0, 2}, 3, 1, 4, false, true, true, true, a2_caps(2)});
  {
    std::vector<int64_t> many(300);
    std::uniform_int_distribution<int> pick(0, 2);
    for (auto& n : many) n = pick(rng);
    cases.push_back({"300_experts", DType::kBFloat16, many, 16, 24, 8, false, true, true, true, a2_caps(24)});
  }

  for (const Case& c : cases) {
    run_case(c, rng);
    if (g_failures && std::getenv("SLMOE_EMU_MUTATION")) break;  // a mutant needs one failure
  }
  std::printf("\nworst error vs fp64 over the cases (norm-relative | max-abs / max|ref|):\n");
  for (const auto& [key, s] : g_err) std::printf("  %-8s %.2e | %.2e\n", key.c_str(), s.rel, s.abs);
  if (g_failures) {
    std::printf("%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("all %zu cases passed\n", cases.size());
  return 0;
}
