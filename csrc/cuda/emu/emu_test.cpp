// Runs the CUDA launchers of lora_expert_kernels.cu on the host emulation (cuda_emu.h) and checks
// y, h, dx, dA, dB against an fp64 loop reference. Built and run by csrc/cuda/emu/run.sh.
//
// "Device" buffers are host buffers with NaN-filled guard zones on both sides: a kernel that reads
// past an operand pulls NaN into its results, one that writes past an output changes the guard.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../lora_expert_cuda.h"

namespace {

using slmoe::cuda::DType;

int g_failures = 0;

size_t elem_size(DType t) {
  switch (t) {
    case DType::kFloat64: return 8;
    case DType::kFloat32: return 4;
    default: return 2;
  }
}
const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat64: return "fp64";
    case DType::kFloat32: return "fp32";
    case DType::kBFloat16: return "bf16";
    default: return "fp16";
  }
}

constexpr size_t kGuard = 64;

// A "device" buffer of n elements of dtype t, `misalign` bytes past a 16-byte boundary.
struct Buf {
  DType t;
  size_t n;
  size_t misalign;
  std::vector<unsigned char> mem;
  Buf(DType t_, size_t n_, size_t misalign_ = 0) : t(t_), n(n_), misalign(misalign_) {
    mem.assign(n * elem_size(t) + 2 * kGuard + 16 + misalign, 0xff);
  }
  unsigned char* base() {
    auto p = reinterpret_cast<uintptr_t>(mem.data()) + kGuard;
    p = (p + 15) / 16 * 16 + misalign;
    return reinterpret_cast<unsigned char*>(p);
  }
  void* ptr() { return base(); }
  double get(size_t i) {
    unsigned char* p = base() + i * elem_size(t);
    switch (t) {
      case DType::kFloat64: { double v; std::memcpy(&v, p, 8); return v; }
      case DType::kFloat32: { float v; std::memcpy(&v, p, 4); return v; }
      case DType::kBFloat16: { __nv_bfloat16 v; std::memcpy(&v, p, 2); return __bfloat162float(v); }
      default: { __half v; std::memcpy(&v, p, 2); return __half2float(v); }
    }
  }
  void set(size_t i, double v) {
    unsigned char* p = base() + i * elem_size(t);
    switch (t) {
      case DType::kFloat64: std::memcpy(p, &v, 8); break;
      case DType::kFloat32: { float f = static_cast<float>(v); std::memcpy(p, &f, 4); break; }
      case DType::kBFloat16: { __nv_bfloat16 b = __float2bfloat16_rn(static_cast<float>(v)); std::memcpy(p, &b, 2); break; }
      default: { __half h = __float2half_rn(static_cast<float>(v)); std::memcpy(p, &h, 2); break; }
    }
  }
  bool guards_intact() {
    const unsigned char* b = base();
    const unsigned char* e = b + n * elem_size(t);
    for (const unsigned char* p = mem.data(); p < b; ++p)
      if (*p != 0xff) return false;
    for (const unsigned char* p = e; p < mem.data() + mem.size(); ++p)
      if (*p != 0xff) return false;
    return true;
  }
  std::vector<double> values() {
    std::vector<double> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = get(i);
    return v;
  }
};

struct Case {
  std::string name;
  DType dtype;
  std::vector<int64_t> counts;
  int64_t d_in, d_out, r;
  bool lora_x = false;  // forward with a separate LoRA input (x * mask) and the mask in backward
  bool need_dx = true, need_da = true, need_db = true;
  size_t misalign = 0;  // bytes added to x's and grad_y's base address
  double scaling = 2.0;
};

double tolerance(DType t) {
  switch (t) {
    case DType::kFloat64: return 1e-12;
    case DType::kFloat32: return 1e-5;
    case DType::kBFloat16: return 1e-2;
    default: return 2e-3;
  }
}

void check(const Case& c, const char* what, Buf& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  bool finite = true;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = got.get(i);
    finite = finite && std::isfinite(g);
    num += (g - want[i]) * (g - want[i]);
    den += want[i] * want[i];
  }
  const double err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  const bool ok = finite && err <= tolerance(c.dtype) && got.guards_intact();
  if (!ok) {
    ++g_failures;
    std::printf("FAIL %-34s %-3s rel_err %.3e (tol %.0e)%s%s\n", c.name.c_str(), what, err, tolerance(c.dtype),
                finite ? "" : " non-finite", got.guards_intact() ? "" : " guard overwritten");
  }
}

void run_case(const Case& c, std::mt19937_64& rng) {
  const DType t = c.dtype;
  const int64_t E = static_cast<int64_t>(c.counts.size());
  int64_t T = 0;
  for (int64_t n : c.counts) T += n;
  const int64_t d_in = c.d_in, d_out = c.d_out, r = c.r;
  std::normal_distribution<double> normal;

  auto fill = [&](Buf& b, double scale) {
    for (size_t i = 0; i < b.n; ++i) b.set(i, normal(rng) * scale);
  };
  Buf x(t, T * d_in, c.misalign), w(t, E * d_out * d_in), a(t, E * r * d_in), bb(t, E * d_out * r);
  Buf gy(t, T * d_out, c.misalign), mask(t, T * d_in), lx(t, T * d_in);
  fill(x, 1.0);
  fill(w, 1.0 / std::sqrt(double(d_in > 0 ? d_in : 1)));
  fill(a, 1.0 / std::sqrt(double(d_in > 0 ? d_in : 1)));
  fill(bb, 1.0 / std::sqrt(double(r > 0 ? r : 1)));
  fill(gy, 1.0);
  std::bernoulli_distribution keep(0.7);
  for (size_t i = 0; i < mask.n; ++i) {
    mask.set(i, keep(rng) ? 1.0 / 0.7 : 0.0);
    lx.set(i, x.get(i) * mask.get(i));  // rounded to dtype, as x * mask in torch
  }
  Buf& lora_in = c.lora_x ? lx : x;

  // counts live in "device" memory as int64
  std::vector<int64_t> counts = c.counts;
  std::vector<int32_t> ws(slmoe::cuda::lora_workspace_elems(E), -7);

  Buf y(t, T * d_out), h(t, T * r);
  slmoe::cuda::LoraFwdArgs fa{};
  fa.dtype = t;
  fa.T = T; fa.E = E; fa.d_in = d_in; fa.d_out = d_out; fa.r = r;
  fa.scaling = c.scaling;
  fa.x = x.ptr();
  fa.lora_x = c.lora_x ? lx.ptr() : nullptr;
  fa.weight = w.ptr(); fa.lora_a = a.ptr(); fa.lora_b = bb.ptr();
  fa.tokens_per_expert = counts.data();
  fa.y = y.ptr(); fa.h = h.ptr();
  fa.workspace = ws.data();
  if (slmoe::cuda::lora_grouped_linear_fwd(fa, nullptr) != cudaSuccess) {
    ++g_failures;
    std::printf("FAIL %s: forward launch error\n", c.name.c_str());
    return;
  }

  Buf dx(t, T * d_in), da(t, E * r * d_in), db(t, E * d_out * r), dh(t, T * r);
  slmoe::cuda::LoraBwdArgs ba{};
  ba.dtype = t;
  ba.T = T; ba.E = E; ba.d_in = d_in; ba.d_out = d_out; ba.r = r;
  ba.scaling = c.scaling;
  ba.grad_y = gy.ptr();
  ba.lora_x = lora_in.ptr();
  ba.weight = w.ptr(); ba.lora_a = a.ptr(); ba.lora_b = bb.ptr();
  ba.h = h.ptr();
  ba.lora_mask = c.lora_x ? mask.ptr() : nullptr;
  ba.tokens_per_expert = counts.data();
  ba.dx = c.need_dx ? dx.ptr() : nullptr;
  ba.da = c.need_da ? da.ptr() : nullptr;
  ba.db = c.need_db ? db.ptr() : nullptr;
  ba.dh = dh.ptr();
  ba.workspace = ws.data();
  if (slmoe::cuda::lora_grouped_linear_bwd(ba, nullptr) != cudaSuccess) {
    ++g_failures;
    std::printf("FAIL %s: backward launch error\n", c.name.c_str());
    return;
  }

  // fp64 reference from the dtype-rounded inputs; the backward uses the kernel's own h (as the
  // op does: h is saved in the dtype) so the comparison isolates the backward.
  std::vector<double> X = x.values(), LX = lora_in.values(), W = w.values(), A = a.values(), B = bb.values();
  std::vector<double> GY = gy.values(), M = mask.values(), Hk = h.values();
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
      for (int64_t j = 0; j < r; ++j) {
        for (int64_t o = 0; o < d_out; ++o) dhv[j] += s * GY[i * d_out + o] * B[(e * d_out + o) * r + j];
      }
      for (int64_t k = 0; k < d_in; ++k) {
        double base = 0, lora = 0;
        for (int64_t o = 0; o < d_out; ++o) base += GY[i * d_out + o] * W[(e * d_out + o) * d_in + k];
        for (int64_t j = 0; j < r; ++j) lora += dhv[j] * A[(e * r + j) * d_in + k];
        DX[i * d_in + k] = base + (c.lora_x ? lora * M[i * d_in + k] : lora);
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
    for (int64_t i = 0; c.need_da && i < r * d_in; ++i)
      if (da.get(e * r * d_in + i) != 0.0) { ++g_failures; std::printf("FAIL %s: dA of empty expert %lld not zero\n", c.name.c_str(), (long long)e); break; }
    for (int64_t i = 0; c.need_db && i < d_out * r; ++i)
      if (db.get(e * d_out * r + i) != 0.0) { ++g_failures; std::printf("FAIL %s: dB of empty expert %lld not zero\n", c.name.c_str(), (long long)e); break; }
  }
  std::printf("ok   %-34s %s T=%lld E=%lld %lldx%lld r=%lld\n", c.name.c_str(), dtype_name(t), (long long)T,
              (long long)E, (long long)d_in, (long long)d_out, (long long)r);
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  std::mt19937_64 rng(1234);
  std::vector<Case> cases;
  const std::vector<int64_t> uneven{0, 5, 0, 7, 3, 0};  // the CPU tests' groups, d not multiples of 8
  for (DType t : {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat64}) {
    for (int64_t r : {4, 8, 16, 32}) {
      if (quick && r != 8) continue;
      cases.push_back({std::string("uneven_unaligned_r") + std::to_string(r), t, uneven, 13, 37, r});
    }
    // 16-byte aligned rows: the cp.async path; several row tiles per expert, two column tiles,
    // three base k-tiles plus the LoRA k-tile.
    cases.push_back({"aligned_multi_tile", t, {130, 0, 3, 260, 1}, 72, 136, 16});
    Case masked{"dropout_mask", t, uneven, 13, 37, 8};
    masked.lora_x = true;
    cases.push_back(masked);
  }
  Case masked_aligned{"dropout_mask_aligned", DType::kBFloat16, {40, 0, 90}, 64, 48, 16};
  masked_aligned.lora_x = true;
  cases.push_back(masked_aligned);
  Case only_da{"only_dA", DType::kBFloat16, uneven, 16, 24, 8};
  only_da.need_dx = only_da.need_db = false;
  cases.push_back(only_da);
  Case only_dx{"only_dx", DType::kFloat32, uneven, 16, 24, 8};
  only_dx.need_da = only_dx.need_db = false;
  cases.push_back(only_dx);
  cases.push_back({"no_rows", DType::kBFloat16, {0, 0, 0}, 16, 24, 8});
  cases.push_back({"rank_0", DType::kBFloat16, {3, 0, 4}, 16, 24, 0});
  cases.push_back({"rank_72_two_col_tiles", DType::kBFloat16, {20, 0, 9}, 32, 40, 72});
  cases.push_back({"rank_64", DType::kFloat16, {33, 1}, 40, 24, 64});
  Case misaligned{"misaligned_base", DType::kBFloat16, {17, 0, 30}, 64, 48, 16};
  misaligned.misalign = 2;
  cases.push_back(misaligned);
  {
    std::vector<int64_t> many(300);
    std::uniform_int_distribution<int> pick(0, 2);
    for (auto& n : many) n = pick(rng);
    cases.push_back({"300_experts_plan_chunks", DType::kBFloat16, many, 16, 24, 8});
  }

  for (const Case& c : cases) run_case(c, rng);
  if (g_failures) {
    std::printf("%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("all %zu cases passed\n", cases.size());
  return 0;
}
