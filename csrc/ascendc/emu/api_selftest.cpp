// Self-test of the emulation against CANN's documented data flow, independent of the LoRA kernel.
//
// CANN documents the cube data flow of Atlas A2 with worked parameters (the DataCopy ND2NZ, LoadData
// 2D, Mmad and Fixpipe pages and their "load_data_l12l0" sample: m = 40, n = 50, k = 70, half, the
// four combinations of A stored [m, k] or [k, m] and B stored [k, n] or [n, k]). A small kernel here
// uses exactly those documented parameter rules; the emulation must then compute A * B. It also
// checks the documented special cases: GEMV at M = 1 (L0A read as a plain vector), accumulation in
// L0C across Mmads, and DataCopyPad's 32-byte row padding (dummy = the row's first element).
// Then the emulation's own checks, each misuse in a forked child that must end with status 3 and
// the expected message: double FreeTensor, EnQue past the depth, use before DeQue, a race between
// pipes, a DataCopy length off the 32-byte grid, a TPipe past UB, a cross-core wait never answered,
// a Gather past its source, a vector op reading a vector result without PipeBarrier<PIPE_V>.
// The integer / bit / gather operations of the packed dequantiser are checked in an AIV-only launch.
//
//   api_selftest      exit 0 when every check passes
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernel_operator.h"

namespace {

using namespace AscendC;

int g_failures = 0;

uint32_t ceil_div(uint32_t a, uint32_t b) { return (a + b - 1) / b; }
uint32_t ceil_align(uint32_t a, uint32_t b) { return ceil_div(a, b) * b; }

void expect(bool ok, const char* what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what);
  if (!ok) ++g_failures;
}

// C[m, n] = A * B on the cube with the documented parameters; A is [m, k] or (a_t) [k, m],
// B is [n, k] or (b_t) [k, n], all half; C float.
void documented_matmul(half* a_gm, half* b_gm, float* c_gm, uint32_t m, uint32_t n, uint32_t k, bool a_t, bool b_t) {
  const uint32_t f = 16, frac = 256;
  TPipe pipe;
  TQue<TPosition::A1, 1> qa1;
  TQue<TPosition::B1, 1> qb1;
  TQue<TPosition::A2, 1> qa2;
  TQue<TPosition::B2, 1> qb2;
  TQue<TPosition::CO1, 1> qc;
  const uint32_t ma = ceil_align(m, f), na = ceil_align(n, f), ka = ceil_align(k, f);
  pipe.InitBuffer(qa1, 1, ma * ka * 2);
  pipe.InitBuffer(qb1, 1, ka * na * 2);
  pipe.InitBuffer(qa2, 1, ma * ka * 2);
  pipe.InitBuffer(qb2, 1, ka * na * 2);
  pipe.InitBuffer(qc, 1, ma * na * 4);
  GlobalTensor<half> ga, gb;
  GlobalTensor<float> gc;
  ga.SetGlobalBuffer(a_gm);
  gb.SetGlobalBuffer(b_gm);
  gc.SetGlobalBuffer(c_gm);

  // GM -> L1: rows x cols of the stored matrix, Z blocks of CeilAlign(rows, 16) rows.
  auto nd2nz = [](uint32_t rows, uint32_t cols) {
    Nd2NzParams p;
    p.ndNum = 1;
    p.nValue = static_cast<uint16_t>(rows);
    p.dValue = static_cast<uint16_t>(cols);
    p.srcNdMatrixStride = 0;
    p.srcDValue = static_cast<uint16_t>(cols);
    p.dstNzC0Stride = static_cast<uint16_t>(ceil_align(rows, 16));
    p.dstNzNStride = 1;
    p.dstNzMatrixStride = 0;
    return p;
  };
  LocalTensor<half> a1 = qa1.AllocTensor<half>();
  DataCopy(a1, ga, a_t ? nd2nz(k, m) : nd2nz(m, k));
  qa1.EnQue(a1);
  LocalTensor<half> b1 = qb1.AllocTensor<half>();
  DataCopy(b1, gb, b_t ? nd2nz(k, n) : nd2nz(n, k));
  qb1.EnQue(b1);
  a1 = qa1.DeQue<half>();
  b1 = qb1.DeQue<half>();

  // L1 -> L0A (NZ -> ZZ) and L1 -> L0B (-> ZN), one LoadData per row block (A) / k block (B).
  LocalTensor<half> a2 = qa2.AllocTensor<half>();
  LoadData2DParams la;
  la.repeatTimes = static_cast<uint8_t>(ceil_div(k, f));
  if (!a_t) {
    la.srcStride = static_cast<uint16_t>(ceil_div(m, f));
    for (uint32_t i = 0; i < ceil_div(m, f); ++i) LoadData(a2[i * ceil_div(k, f) * frac], a1[i * frac], la);
  } else {
    la.srcStride = 1;
    la.ifTranspose = true;
    for (uint32_t i = 0; i < ceil_div(m, f); ++i) {
      LoadData(a2[i * ceil_div(k, f) * frac], a1[i * ceil_div(k, f) * frac], la);
    }
  }
  qa2.EnQue(a2);
  LocalTensor<half> b2 = qb2.AllocTensor<half>();
  LoadData2DParams lb;
  lb.repeatTimes = static_cast<uint8_t>(ceil_div(n, f));
  if (!b_t) {
    lb.srcStride = 1;
    for (uint32_t i = 0; i < ceil_div(k, f); ++i) {
      LoadData(b2[i * ceil_div(n, f) * frac], b1[i * ceil_div(n, f) * frac], lb);
    }
  } else {
    lb.srcStride = static_cast<uint16_t>(ceil_div(k, f));
    lb.ifTranspose = true;
    for (uint32_t i = 0; i < ceil_div(k, f); ++i) LoadData(b2[i * ceil_div(n, f) * frac], b1[i * frac], lb);
  }
  qb2.EnQue(b2);
  qa1.FreeTensor(a1);
  qb1.FreeTensor(b1);
  a2 = qa2.DeQue<half>();
  b2 = qb2.DeQue<half>();

  LocalTensor<float> c = qc.AllocTensor<float>();
  MmadParams mp;
  mp.m = static_cast<uint16_t>(m);
  mp.n = static_cast<uint16_t>(n);
  mp.k = static_cast<uint16_t>(k);
  Mmad(c, a2, b2, mp);
  qc.EnQue(c);
  qa2.FreeTensor(a2);
  qb2.FreeTensor(b2);
  c = qc.DeQue<float>();
  FixpipeParamsV220 fp;
  fp.nSize = static_cast<uint16_t>(n);
  fp.mSize = static_cast<uint16_t>(m);
  fp.srcStride = static_cast<uint16_t>(ceil_align(m, 16));
  fp.dstStride = n;
  fp.quantPre = QuantMode_t::NoQuant;
  Fixpipe<float, float, CFG_ROW_MAJOR>(gc, c, fp);
  qc.FreeTensor(c);
}

void check_matmul(bool a_t, bool b_t) {
  const uint32_t m = 40, n = 50, k = 70;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<half> a(m * k), b(k * n);
  std::vector<float> c(m * n, std::nanf(""));
  for (auto& v : a) v = half(u(rng));
  for (auto& v : b) v = half(u(rng));
  slmoe_emu::gm_clear();
  slmoe_emu::gm_register(a.data(), a.size() * 2, false, "A");
  slmoe_emu::gm_register(b.data(), b.size() * 2, false, "B");
  slmoe_emu::gm_register(c.data(), c.size() * 4, true, "C");
  slmoe_emu::launch_mix(1, [&] {
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
    if ASCEND_IS_AIC { documented_matmul(a.data(), b.data(), c.data(), m, n, k, a_t, b_t); }
  });
  double err = 0;
  for (uint32_t i = 0; i < m; ++i) {
    for (uint32_t j = 0; j < n; ++j) {
      double ref = 0;
      for (uint32_t kk = 0; kk < k; ++kk) {
        const float av = static_cast<float>(a_t ? a[kk * m + i] : a[i * k + kk]);
        const float bv = static_cast<float>(b_t ? b[kk * n + j] : b[j * k + kk]);
        ref += static_cast<double>(av) * bv;
      }
      err = std::max(err, std::fabs(c[i * n + j] - ref));
    }
  }
  char what[96];
  std::snprintf(what, sizeof what, "documented cube flow, A %s, B %s: max |C - A B| = %.1e", a_t ? "[k, m]" : "[m, k]",
                b_t ? "[k, n]" : "[n, k]", err);
  expect(err < 1e-4, what);
}

// GEMV: with M = 1 the cube reads L0A as K contiguous elements (CANN's GEMV page), not as fractals.
void check_gemv() {
  const uint32_t n = 32, k = 64;
  std::vector<half> a(k), b(n * k);
  std::vector<float> c(16 * n, std::nanf(""));
  for (uint32_t i = 0; i < k; ++i) a[i] = half(0.01f * static_cast<float>(i));
  for (uint32_t i = 0; i < n * k; ++i) b[i] = half(static_cast<float>(i % 7) - 3.f);
  slmoe_emu::gm_clear();
  slmoe_emu::gm_register(a.data(), a.size() * 2, false, "A");
  slmoe_emu::gm_register(b.data(), b.size() * 2, false, "B");
  slmoe_emu::gm_register(c.data(), c.size() * 4, true, "C");
  slmoe_emu::launch_mix(1, [&] {
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
    if ASCEND_IS_AIC {
      TPipe pipe;
      TQue<TPosition::A1, 1> qa1;
      TQue<TPosition::B1, 1> qb1;
      TQue<TPosition::A2, 1> qa2;
      TQue<TPosition::B2, 1> qb2;
      TQue<TPosition::CO1, 1> qc;
      pipe.InitBuffer(qa1, 1, 16 * k * 2);
      pipe.InitBuffer(qb1, 1, n * k * 2);
      pipe.InitBuffer(qa2, 1, 16 * k * 2);
      pipe.InitBuffer(qb2, 1, n * k * 2);
      pipe.InitBuffer(qc, 1, 16 * n * 4);
      GlobalTensor<half> ga, gb;
      GlobalTensor<float> gc;
      ga.SetGlobalBuffer(a.data());
      gb.SetGlobalBuffer(b.data());
      gc.SetGlobalBuffer(c.data());
      // The vector as a [k / 16, 16] ND matrix: its Z blocks are the vector's contiguous 16s.
      Nd2NzParams p;
      p.ndNum = 1;
      p.nValue = static_cast<uint16_t>(k / 16);
      p.dValue = 16;
      p.srcDValue = 16;
      p.dstNzC0Stride = static_cast<uint16_t>(k / 16);
      p.dstNzNStride = 1;
      LocalTensor<half> a1 = qa1.AllocTensor<half>();
      DataCopy(a1, ga, p);
      qa1.EnQue(a1);
      Nd2NzParams pb = p;
      pb.nValue = static_cast<uint16_t>(n);
      pb.dValue = static_cast<uint16_t>(k);
      pb.srcDValue = static_cast<uint16_t>(k);
      pb.dstNzC0Stride = static_cast<uint16_t>(n);
      LocalTensor<half> b1 = qb1.AllocTensor<half>();
      DataCopy(b1, gb, pb);
      qb1.EnQue(b1);
      a1 = qa1.DeQue<half>();
      b1 = qb1.DeQue<half>();
      LocalTensor<half> a2 = qa2.AllocTensor<half>();
      LoadData2DParams la;
      la.repeatTimes = 1;
      la.srcStride = 1;
      LoadData(a2, a1, la);  // one fractal: the whole vector (k = 64 <= 256)
      qa2.EnQue(a2);
      LocalTensor<half> b2 = qb2.AllocTensor<half>();
      LoadData2DParams lb;
      lb.repeatTimes = static_cast<uint8_t>(n / 16);
      lb.srcStride = 1;
      for (uint32_t i = 0; i < k / 16; ++i) LoadData(b2[i * (n / 16) * 256], b1[i * (n / 16) * 256], lb);
      qb2.EnQue(b2);
      qa1.FreeTensor(a1);
      qb1.FreeTensor(b1);
      a2 = qa2.DeQue<half>();
      b2 = qb2.DeQue<half>();
      LocalTensor<float> cl = qc.AllocTensor<float>();
      MmadParams mp;
      mp.m = 1;
      mp.n = static_cast<uint16_t>(n);
      mp.k = static_cast<uint16_t>(k);
      Mmad(cl, a2, b2, mp);
      qc.EnQue(cl);
      qa2.FreeTensor(a2);
      qb2.FreeTensor(b2);
      cl = qc.DeQue<float>();
      FixpipeParamsV220 fp;
      fp.nSize = static_cast<uint16_t>(n);
      fp.mSize = 1;
      fp.srcStride = 16;
      fp.dstStride = n;
      Fixpipe<float, float, CFG_ROW_MAJOR>(gc, cl, fp);
      qc.FreeTensor(cl);
    }
  });
  double err = 0;
  for (uint32_t j = 0; j < n; ++j) {
    double ref = 0;
    for (uint32_t kk = 0; kk < k; ++kk) ref += static_cast<double>(static_cast<float>(a[kk])) * static_cast<float>(b[j * k + kk]);
    err = std::max(err, std::fabs(c[j] - ref));
  }
  expect(err < 1e-3, "GEMV at M = 1 reads L0A as a contiguous vector");
}

// DataCopyPad GM -> UB: rows of 47 bytes padded to 32-byte multiples with the row's first element,
// and back to GM without the padding (CANN's DataCopyPad pages, example 2).
void check_datacopypad() {
  std::vector<int16_t> src(3 * 30), dst(3 * 30, -1);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<int16_t>(i + 1);
  std::vector<int16_t> seen(3 * 32, 0);
  slmoe_emu::gm_clear();
  slmoe_emu::gm_register(src.data(), src.size() * 2, false, "src");
  slmoe_emu::gm_register(dst.data(), dst.size() * 2, true, "dst");
  slmoe_emu::launch_mix(1, [&] {
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
    if (ASCEND_IS_AIV && GetSubBlockIdx() == 0) {
      TPipe pipe;
      TQue<TPosition::VECIN, 1> q;
      pipe.InitBuffer(q, 1, 3 * 64);
      GlobalTensor<half> gs, gd;
      gs.SetGlobalBuffer(reinterpret_cast<half*>(src.data()));
      gd.SetGlobalBuffer(reinterpret_cast<half*>(dst.data()));
      LocalTensor<half> t = q.AllocTensor<half>();
      DataCopyExtParams in;
      in.blockCount = 3;
      in.blockLen = 46;   // 23 halves
      in.srcStride = 14;  // 7 halves skipped between rows
      in.dstStride = 0;
      DataCopyPadExtParams<half> pad;
      DataCopyPad(t, gs, in, pad);
      q.EnQue(t);
      t = q.DeQue<half>();
      PipeBarrier<PIPE_ALL>();  // VECIN orders MTE2 -> V; the copy back out runs on MTE3
      std::memcpy(seen.data(), t.emu_data("selftest"), seen.size() * 2);
      DataCopyExtParams out = in;
      out.srcStride = 0;
      out.dstStride = 14;
      DataCopyPad(gd, t, out);
      q.FreeTensor(t);
    }
  });
  bool ok = true;
  for (int r = 0; r < 3; ++r) {
    for (int i = 0; i < 32; ++i) {
      const int16_t want = i < 23 ? src[r * 30 + i] : src[r * 30];
      ok = ok && seen[r * 32 + i] == want;
    }
    for (int i = 0; i < 30; ++i) ok = ok && dst[r * 30 + i] == (i < 23 ? src[r * 30 + i] : -1);
  }
  expect(ok, "DataCopyPad pads each row to 32 bytes with its first element and drops the padding on the way out");
}

// Round to nearest even on the way out, in both 16-bit types.
void check_rounding() {
  bool ok = half(1.0f + 1.0f / 2048).bits == half(1.0f).bits && half(1.0f + 3.0f / 2048).bits == half(1.0f + 2.0f / 1024).bits;
  ok = ok && bfloat16_t(1.0f + 1.0f / 256).bits == bfloat16_t(1.0f).bits &&
       bfloat16_t(1.0f + 3.0f / 256).bits == bfloat16_t(1.0f + 2.0f / 128).bits;
  ok = ok && half(65520.0f).bits == 0x7c00 && half(65519.0f).bits == 0x7bff && half(5.96e-8f).bits == 0x0001;
  ok = ok && static_cast<float>(half(0.1f)) == 0.0999755859375f && static_cast<float>(bfloat16_t(0.1f)) == 0.10009765625f;
  expect(ok, "half / bfloat16_t conversions round to nearest even (overflow, subnormals)");
}

// Runs `body` on the first vector unit of a one-block launch in a forked child; the child must end
// with the emulation's status 3 and print `message`.
void expect_caught(const char* what, const char* message, const std::function<void()>& body) {
  int fds[2];
  if (pipe(fds) != 0) std::abort();
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    dup2(fds[1], 2);
    slmoe_emu::launch_mix(1, [&] {
      KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
      if (ASCEND_IS_AIV && GetSubBlockIdx() == 0) body();
    });
    std::_Exit(0);
  }
  close(fds[1]);
  std::string err;
  char buf[512];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) err.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 3 && err.find(message) != std::string::npos;
  expect(ok, (std::string("caught: ") + what).c_str());
  if (!ok) std::printf("     child status %d, stderr: %s\n", status, err.c_str());
}

// The vector operations of a packed-weight dequantiser (Atlas A2 semantics as CANN documents them),
// in an AIV-only launch: ShiftRight / ShiftLeft on 32-bit words (logical for unsigned, arithmetic
// for signed), And on uint16_t halves of 32-bit words (A2 has no 32-bit And), Adds on int32_t,
// Cast uint8_t -> half -> int32_t -> float, and Gather by byte offsets (interleave and table lookup).
void check_vector_int_ops() {
  constexpr uint32_t n = 64;
  std::vector<uint32_t> words(n);
  std::vector<uint8_t> bytes(n);
  std::mt19937 rng(3);
  for (uint32_t i = 0; i < n; ++i) words[i] = static_cast<uint32_t>(rng()), bytes[i] = static_cast<uint8_t>(rng());
  words[0] = 0x80000001u;  // the sign bit: logical vs arithmetic shift
  std::vector<uint32_t> shr(n), nib(n), shl(n), gat(n);
  std::vector<int32_t> sar(n), adds(n), b2i(n);
  std::vector<float> b2f(n), lut(n);
  slmoe_emu::gm_clear();
  slmoe_emu::gm_register(words.data(), n * 4, false, "words");
  slmoe_emu::gm_register(bytes.data(), n, false, "bytes");
  slmoe_emu::launch_aiv(1, [&] {
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
    TPipe pipe;
    TQue<TPosition::VECIN, 1> qin;
    TBuf<TPosition::VECCALC> calc;
    pipe.InitBuffer(qin, 1, n * 4 + n);
    pipe.InitBuffer(calc, 16 * n * 4);
    GlobalTensor<uint32_t> gw;
    GlobalTensor<uint8_t> gb;
    gw.SetGlobalBuffer(words.data());
    gb.SetGlobalBuffer(bytes.data());
    LocalTensor<uint8_t> in = qin.AllocTensor<uint8_t>();
    DataCopy(in.ReinterpretCast<uint32_t>(), gw, n);
    DataCopy(in[n * 4], gb, n);
    qin.EnQue(in);
    in = qin.DeQue<uint8_t>();
    LocalTensor<uint32_t> w = in.ReinterpretCast<uint32_t>();
    LocalTensor<uint32_t> c = calc.Get<uint32_t>();
    auto at = [&](uint32_t k) { return c[k * n]; };  // slot k of n words
    ShiftRight(at(0), w, 4u, n);
    ShiftRight(at(1).ReinterpretCast<int32_t>(), w.ReinterpretCast<int32_t>(), 4, n);
    Duplicate(at(2), 0xF0F0u, n);
    PipeBarrier<PIPE_V>();
    And(at(3).ReinterpretCast<uint16_t>(), at(0).ReinterpretCast<uint16_t>(), at(2).ReinterpretCast<uint16_t>(),
        2 * n);
    ShiftLeft(at(4), w, 3u, n);
    Adds(at(5).ReinterpretCast<int32_t>(), w.ReinterpretCast<int32_t>(), -8, n);
    Cast(at(6).ReinterpretCast<half>(), in[n * 4], RoundMode::CAST_NONE, n);
    PipeBarrier<PIPE_V>();
    Cast(at(7).ReinterpretCast<int32_t>(), at(6).ReinterpretCast<half>(), RoundMode::CAST_RINT, n);
    PipeBarrier<PIPE_V>();
    Cast(at(8).ReinterpretCast<float>(), at(7).ReinterpretCast<int32_t>(), RoundMode::CAST_NONE, n);
    ShiftLeft(at(9), at(7).ReinterpretCast<uint32_t>(), 2u, n);  // byte offsets of 4-byte elements
    for (uint32_t i = 0; i < n; ++i) at(10).emu_data("selftest")[i] = ((i % 8) * 8 + i / 8) * 4;  // transpose 8x8
    PipeBarrier<PIPE_ALL>();
    Gather(at(11), w, at(10), 0, n);
    // a 256-entry float table: entry k = k / 2 - 3, looked up at each byte
    LocalTensor<float> table = c[12 * n].ReinterpretCast<float>();
    for (uint32_t k = 0; k < 256; ++k) table.emu_data("selftest")[k] = static_cast<float>(k) / 2 - 3;
    PipeBarrier<PIPE_ALL>();
    Gather(at(9).ReinterpretCast<float>(), table, at(9), 0, n);
    PipeBarrier<PIPE_ALL>();
    std::memcpy(shr.data(), at(0).emu_data("selftest"), n * 4);
    std::memcpy(sar.data(), at(1).emu_data("selftest"), n * 4);
    std::memcpy(nib.data(), at(3).emu_data("selftest"), n * 4);
    std::memcpy(shl.data(), at(4).emu_data("selftest"), n * 4);
    std::memcpy(adds.data(), at(5).emu_data("selftest"), n * 4);
    std::memcpy(b2i.data(), at(7).emu_data("selftest"), n * 4);
    std::memcpy(b2f.data(), at(8).emu_data("selftest"), n * 4);
    std::memcpy(gat.data(), at(11).emu_data("selftest"), n * 4);
    std::memcpy(lut.data(), at(9).emu_data("selftest"), n * 4);
    qin.FreeTensor(in);
  });
  slmoe_emu::gm_clear();
  bool ok_shift = true, ok_and = true, ok_adds = true, ok_cast = true, ok_gather = true;
  for (uint32_t i = 0; i < n; ++i) {
    ok_shift = ok_shift && shr[i] == words[i] >> 4 && sar[i] == (static_cast<int32_t>(words[i]) >> 4) &&
               shl[i] == words[i] << 3;
    ok_and = ok_and && nib[i] == ((words[i] >> 4) & 0xF0F0u);
    ok_adds = ok_adds && adds[i] == static_cast<int32_t>(words[i]) - 8;
    ok_cast = ok_cast && b2i[i] == bytes[i] && b2f[i] == static_cast<float>(bytes[i]);
    ok_gather = ok_gather && gat[i] == words[(i % 8) * 8 + i / 8] &&
                lut[i] == static_cast<float>(bytes[i]) / 2 - 3;
  }
  ok_shift = ok_shift && sar[0] < 0 && shr[0] == 0x08000000u;
  expect(ok_shift, "ShiftRight (logical for uint32_t, arithmetic for int32_t) and ShiftLeft on 32-bit words");
  expect(ok_and, "And on the uint16_t halves of 32-bit words (A2: And takes (u)int16_t)");
  expect(ok_adds, "Adds on int32_t");
  expect(ok_cast, "Cast uint8_t -> half (CAST_NONE) -> int32_t (CAST_RINT) -> float (CAST_NONE), exact");
  expect(ok_gather, "Gather by byte offsets: an 8x8 transpose of words and a 256-entry float table lookup");
}

void check_misuse_is_caught() {
  using Q = TQue<TPosition::VECIN, 1>;
  static std::vector<float> gm(64, 1.0f);
  slmoe_emu::gm_clear();
  slmoe_emu::gm_register(gm.data(), gm.size() * 4, true, "gm");
  GlobalTensor<float> g;
  g.SetGlobalBuffer(gm.data());
  expect_caught("double FreeTensor", "FreeTensor: tensor is not dequeued", [&] {
    TPipe pipe;
    Q q;
    pipe.InitBuffer(q, 1, 256);
    LocalTensor<float> t = q.AllocTensor<float>();
    q.EnQue(t);
    t = q.DeQue<float>();
    q.FreeTensor(t);
    q.FreeTensor(t);
  });
  expect_caught("EnQue past the depth", "more than the TQue depth 1", [&] {
    TPipe pipe;
    Q q;
    pipe.InitBuffer(q, 2, 256);
    LocalTensor<float> a = q.AllocTensor<float>();
    LocalTensor<float> b = q.AllocTensor<float>();
    q.EnQue(a);
    q.EnQue(b);
  });
  expect_caught("use before DeQue", "use before DeQue", [&] {
    TPipe pipe;
    Q q;
    pipe.InitBuffer(q, 1, 256);
    LocalTensor<float> t = q.AllocTensor<float>();
    DataCopy(t, g, 64);
    q.EnQue(t);
    Muls(t, t, 2.0f, 64);
  });
  expect_caught("MTE2 -> V race without a queue", "race (read after write)", [&] {
    TPipe pipe;
    TBuf<TPosition::VECCALC> b;
    Q q;
    pipe.InitBuffer(q, 1, 256);
    pipe.InitBuffer(b, 256);
    LocalTensor<float> t = q.AllocTensor<float>();
    DataCopy(t, g, 64);  // MTE2
    LocalTensor<float> u = b.Get<float>();
    Muls(u, t, 2.0f, 64);  // V reads it with no EnQue/DeQue in between
  });
  expect_caught("DataCopy off the 32-byte grid", "not a multiple of 32 bytes", [&] {
    TPipe pipe;
    Q q;
    pipe.InitBuffer(q, 1, 256);
    LocalTensor<float> t = q.AllocTensor<float>();
    DataCopy(t, g, 7);
  });
  expect_caught("TPipe past the unified buffer", "do not fit", [&] {
    TPipe pipe;
    Q q;
    pipe.InitBuffer(q, 2, 100 * 1024);
  });
  expect_caught("cross-core wait never answered", "deadlock", [&] { CrossCoreWaitFlag<2, PIPE_MTE2>(3); });
  expect_caught("Gather past its source", "reads byte", [&] {
    TPipe pipe;
    TBuf<TPosition::VECCALC> b;
    pipe.InitBuffer(b, 256);
    LocalTensor<uint32_t> off = b.Get<uint32_t>();
    Duplicate(off, 200u, 8);
    PipeBarrier<PIPE_V>();
    Gather(off[8].ReinterpretCast<float>(), off[48].ReinterpretCast<float>(), off, 0, 8);  // byte 200 of a 64-byte source
  });
  expect_caught("And without a barrier after the Duplicate it reads", "race (read after write)", [&] {
    TPipe pipe;
    TBuf<TPosition::VECCALC> b;
    pipe.InitBuffer(b, 256);
    LocalTensor<uint16_t> t = b.Get<uint16_t>();
    Duplicate(t, static_cast<uint16_t>(15), 32);
    And(t[32], t, t, 32);
  });
  slmoe_emu::gm_clear();
}

}  // namespace

int main() {
  for (int a_t = 0; a_t < 2; ++a_t)
    for (int b_t = 0; b_t < 2; ++b_t) check_matmul(a_t, b_t);
  check_gemv();
  check_datacopypad();
  check_rounding();
  check_vector_int_ops();
  check_misuse_is_caught();
  slmoe_emu::gm_clear();
  if (g_failures) {
    std::printf("api_selftest: %d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("api_selftest: all checks passed\n");
  return 0;
}
