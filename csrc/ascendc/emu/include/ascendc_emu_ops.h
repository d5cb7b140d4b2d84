// Instructions of the emulated AscendC subset (included by the emulation's kernel_operator.h).
//
// Each instruction checks what CANN documents for Atlas A2 (positions, alignment, parameter
// ranges), declares the bytes it reads and writes to the race detector under its pipe, and then
// moves or computes the data. Layout conventions (b16 = half / bfloat16_t; fractal = 16 x 16 b16,
// 512 bytes):
//   L1 NZ (from ND2NZ):  element (r, c) at (c / 16) * dstNzC0Stride * 16 + r * dstNzNStride * 16 + c % 16
//   L0A ZZ (Mmad A, M x K): fractal (r / 16, k / 16) at (r / 16) * ceil(K / 16) + k / 16, row-major inside
//   L0B ZN (Mmad B, K x N): fractal (k / 16, n / 16) at (k / 16) * ceil(N / 16) + n / 16, column-major inside
//   L0C NZ (Mmad C, M x N): element (i, j) at (j / 16) * Ma * 16 + i * 16 + j % 16, Ma = ceil16(M) (16 when M = 1)
#pragma once

namespace slmoe_emu {

template <typename T>
constexpr bool kIsB16 = std::is_same<T, half>::value || std::is_same<T, bfloat16_t>::value;

template <typename T>
constexpr bool kIsInt16or32 = std::is_same<T, int16_t>::value || std::is_same<T, uint16_t>::value ||
                              std::is_same<T, int32_t>::value || std::is_same<T, uint32_t>::value;

template <typename T>
inline float to_f32(T v) {
  return static_cast<float>(v);
}
template <typename T>
inline T from_f32(float v) {
  return T(v);  // half / bfloat16_t: round to nearest even
}

template <typename T>
const char* type_name() {
  if (std::is_same<T, float>::value) return "float";
  if (std::is_same<T, half>::value) return "half";
  if (std::is_same<T, bfloat16_t>::value) return "bfloat16_t";
  if (std::is_same<T, uint8_t>::value) return "uint8_t";
  if (std::is_same<T, int32_t>::value) return "int32_t";
  return "other";
}

inline bool is_ub(AscendC::TPosition p) {
  return p == AscendC::TPosition::VECIN || p == AscendC::TPosition::VECOUT || p == AscendC::TPosition::VECCALC;
}

inline void require_align(const TensorRef& t, uint32_t align, const char* what) {
  if (t.addr % align != 0) fail("%s: local address %u is not %u-byte aligned", what, t.addr, align);
}

inline void require_room(const TensorRef& t, uint64_t bytes, const char* what) {
  if (bytes > t.bytes) {
    fail("%s: touches %llu bytes of a tensor that has %u", what, static_cast<unsigned long long>(bytes), t.bytes);
  }
}

template <typename T>
inline void require_ub(const AscendC::LocalTensor<T>& t, const char* what) {
  if (!is_ub(t.emu_ref().pos)) fail("%s: operand is not in the unified buffer (VECIN/VECOUT/VECCALC)", what);
  require_align(t.emu_ref(), 32, what);
}

}  // namespace slmoe_emu

namespace AscendC {

// ----- data movement ---------------------------------------------------------------------------

// GM -> L1 with ND -> NZ conversion (MTE2). Columns past dValue in the last 32-byte block are zeroed;
// rows past nValue are not written.
template <typename T>
void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const Nd2NzParams& p) {
  using namespace slmoe_emu;
  const char* what = "DataCopy(GM->L1, ND2NZ)";
  const TensorRef& d = dst.emu_ref();
  if (d.pos != TPosition::A1 && d.pos != TPosition::B1) fail("%s: destination must be A1/B1", what);
  require_align(d, 32, what);
  if (p.ndNum == 0 || p.nValue == 0 || p.dValue == 0) return;  // NOP, as documented
  if (p.ndNum != 1) fail("%s: ndNum > 1 is not emulated", what);
  if (p.dstNzC0Stride == 0 || p.dstNzNStride == 0 || p.srcDValue == 0) fail("%s: zero stride", what);
  constexpr uint32_t c0 = 32 / sizeof(T);
  const uint32_t blocks = (p.dValue + c0 - 1) / c0;
  const uint64_t end = (static_cast<uint64_t>(blocks - 1) * p.dstNzC0Stride +
                        static_cast<uint64_t>(p.nValue - 1) * p.dstNzNStride + 1) * c0;
  require_room(d, end * sizeof(T), what);
  op_begin(PIPE_MTE2, what);
  for (uint32_t r = 0; r < p.nValue; ++r) {
    op_gm(src.emu_ptr() + static_cast<uint64_t>(r) * p.srcDValue, p.dValue * sizeof(T), false);
  }
  for (uint32_t b = 0; b < blocks; ++b) {
    for (uint32_t r = 0; r < p.nValue; ++r) {
      op_local(d, ((b * p.dstNzC0Stride + r * p.dstNzNStride) * c0) * sizeof(T), 32, true);
    }
  }
  T* out = dst.emu_data(what);
  for (uint32_t r = 0; r < p.nValue; ++r) {
    const T* row = src.emu_ptr() + static_cast<uint64_t>(r) * p.srcDValue;
    for (uint32_t b = 0; b < blocks; ++b) {
      T* blk = out + (b * p.dstNzC0Stride + r * p.dstNzNStride) * c0;
      for (uint32_t i = 0; i < c0; ++i) {
        const uint32_t c = b * c0 + i;
        blk[i] = c < p.dValue ? row[c] : T(0.0f);
      }
    }
  }
  op_end();
}

// GM -> UB, count elements (MTE2); count * sizeof(T) must be a multiple of 32 (the hardware would
// silently copy less).
template <typename T>
void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const uint32_t count) {
  using namespace slmoe_emu;
  const char* what = "DataCopy(GM->UB)";
  require_ub(dst, what);
  if ((static_cast<uint64_t>(count) * sizeof(T)) % 32 != 0) {
    fail("%s: %u elements of %zu bytes is not a multiple of 32 bytes", what, count, sizeof(T));
  }
  if (reinterpret_cast<uintptr_t>(src.emu_ptr()) % sizeof(T) != 0) fail("%s: misaligned GM address", what);
  require_room(dst.emu_ref(), static_cast<uint64_t>(count) * sizeof(T), what);
  op_begin(PIPE_MTE2, what);
  op_gm(src.emu_ptr(), static_cast<uint64_t>(count) * sizeof(T), false);
  op_local(dst.emu_ref(), 0, count * sizeof(T), true);
  std::memcpy(dst.emu_data(what), src.emu_ptr(), static_cast<size_t>(count) * sizeof(T));
  op_end();
}

// UB -> GM, count elements (MTE3).
template <typename T>
void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const uint32_t count) {
  using namespace slmoe_emu;
  const char* what = "DataCopy(UB->GM)";
  require_ub(src, what);
  if ((static_cast<uint64_t>(count) * sizeof(T)) % 32 != 0) {
    fail("%s: %u elements of %zu bytes is not a multiple of 32 bytes", what, count, sizeof(T));
  }
  require_room(src.emu_ref(), static_cast<uint64_t>(count) * sizeof(T), what);
  op_begin(PIPE_MTE3, what);
  op_local(src.emu_ref(), 0, count * sizeof(T), false);
  op_gm(dst.emu_ptr(), static_cast<uint64_t>(count) * sizeof(T), true);
  std::memcpy(dst.emu_ptr(), src.emu_data(what), static_cast<size_t>(count) * sizeof(T));
  op_end();
}

// GM -> UB, blockCount rows of blockLen bytes (MTE2). Each row lands at a 32-byte boundary and is
// padded to 32 bytes: with isPad, by paddingValue; without, by copies of the row's first element.
// srcStride: bytes between rows in GM; dstStride: 32-byte blocks between padded rows in UB.
template <typename T>
void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyExtParams& p,
                 const DataCopyPadExtParams<T>& pad) {
  using namespace slmoe_emu;
  const char* what = "DataCopyPad(GM->UB)";
  const TensorRef& d = dst.emu_ref();
  if (d.pos != TPosition::VECIN && d.pos != TPosition::VECOUT) fail("%s: destination must be VECIN/VECOUT", what);
  require_align(d, 32, what);
  if (p.blockCount == 0 || p.blockLen == 0) return;
  if (p.blockLen % sizeof(T) != 0) fail("%s: blockLen %u is not a multiple of the element size", what, p.blockLen);
  if (pad.leftPadding != 0 || pad.rightPadding != 0) fail("%s: left/right padding is not emulated", what);
  const uint32_t padded = (p.blockLen + 31) / 32 * 32;
  const uint64_t dst_pitch = padded + static_cast<uint64_t>(p.dstStride) * 32;
  const uint64_t src_pitch = static_cast<uint64_t>(p.blockLen) + p.srcStride;
  require_room(d, (p.blockCount - 1) * dst_pitch + padded, what);
  op_begin(PIPE_MTE2, what);
  const uint8_t* s = reinterpret_cast<const uint8_t*>(src.emu_ptr());
  for (uint32_t i = 0; i < p.blockCount; ++i) {
    op_gm(s + i * src_pitch, p.blockLen, false);
    op_local(d, static_cast<uint32_t>(i * dst_pitch), padded, true);
  }
  uint8_t* o = reinterpret_cast<uint8_t*>(dst.emu_data(what));
  for (uint32_t i = 0; i < p.blockCount; ++i) {
    uint8_t* row = o + i * dst_pitch;
    std::memcpy(row, s + i * src_pitch, p.blockLen);
    const T fill = pad.isPad ? pad.paddingValue : *reinterpret_cast<const T*>(row);
    for (uint32_t b = p.blockLen; b + sizeof(T) <= padded; b += sizeof(T)) std::memcpy(row + b, &fill, sizeof(T));
  }
  op_end();
}

// UB -> GM, blockCount rows of blockLen bytes (MTE3); the 32-byte padding of each UB row is dropped.
// srcStride: 32-byte blocks between padded rows in UB; dstStride: bytes between rows in GM.
template <typename T>
void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyExtParams& p) {
  using namespace slmoe_emu;
  const char* what = "DataCopyPad(UB->GM)";
  const TensorRef& s = src.emu_ref();
  if (!is_ub(s.pos)) fail("%s: source must be in the unified buffer", what);
  require_align(s, 32, what);
  if (p.blockCount == 0 || p.blockLen == 0) return;
  if (p.blockLen % sizeof(T) != 0) fail("%s: blockLen %u is not a multiple of the element size", what, p.blockLen);
  const uint32_t padded = (p.blockLen + 31) / 32 * 32;
  const uint64_t src_pitch = padded + static_cast<uint64_t>(p.srcStride) * 32;
  const uint64_t dst_pitch = static_cast<uint64_t>(p.blockLen) + p.dstStride;
  require_room(s, (p.blockCount - 1) * src_pitch + p.blockLen, what);
  op_begin(PIPE_MTE3, what);
  uint8_t* g = reinterpret_cast<uint8_t*>(dst.emu_ptr());
  for (uint32_t i = 0; i < p.blockCount; ++i) {
    op_local(s, static_cast<uint32_t>(i * src_pitch), p.blockLen, false);
    op_gm(g + i * dst_pitch, p.blockLen, true);
  }
  const uint8_t* in = reinterpret_cast<const uint8_t*>(src.emu_data(what));
  for (uint32_t i = 0; i < p.blockCount; ++i) std::memcpy(g + i * dst_pitch, in + i * src_pitch, p.blockLen);
  op_end();
}

// L1 -> L0A/L0B in 512-byte fractals (MTE1); with ifTranspose each 16 x 16 b16 fractal is transposed.
template <typename T>
void LoadData(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LoadData2DParams& p) {
  using namespace slmoe_emu;
  const char* what = "LoadData(L1->L0, 2D)";
  const TensorRef& d = dst.emu_ref();
  const TensorRef& s = src.emu_ref();
  if (s.pos != TPosition::A1 && s.pos != TPosition::B1) fail("%s: source must be A1/B1 (L1)", what);
  if (d.pos != TPosition::A2 && d.pos != TPosition::B2) fail("%s: destination must be A2/B2 (L0A/L0B)", what);
  require_align(d, 512, what);
  require_align(s, 32, what);
  if (p.repeatTimes == 0) return;
  if (p.addrMode != 0) fail("%s: addrMode 1 is only for GM sources", what);
  if (p.ifTranspose && !kIsB16<T>) fail("%s: ifTranspose needs a b16 type", what);
  constexpr uint32_t frac = 512 / sizeof(T);
  constexpr uint32_t side = 16;
  static_assert(frac == side * side || !kIsB16<T>, "b16 fractal");
  const uint64_t src_last = static_cast<uint64_t>(p.startIndex) + static_cast<uint64_t>(p.repeatTimes - 1) * p.srcStride;
  require_room(s, (src_last + 1) * 512, what);
  require_room(d, static_cast<uint64_t>(p.repeatTimes - 1) * (p.dstGap + 1) * 512 + 512, what);
  op_begin(PIPE_MTE1, what);
  for (uint32_t i = 0; i < p.repeatTimes; ++i) {
    op_local(s, (p.startIndex + i * p.srcStride) * 512, 512, false);
    op_local(d, i * (p.dstGap + 1) * 512, 512, true);
  }
  const T* in = src.emu_data(what);
  T* out = dst.emu_data(what);
  for (uint32_t i = 0; i < p.repeatTimes; ++i) {
    const T* f = in + (p.startIndex + i * p.srcStride) * frac;
    T* g = out + i * (p.dstGap + 1) * frac;
    if (!p.ifTranspose) {
      std::memcpy(g, f, 512);
    } else {
      for (uint32_t r = 0; r < side; ++r)
        for (uint32_t c = 0; c < side; ++c) g[r * side + c] = f[c * side + r];
    }
  }
  op_end();
}

// ----- cube -------------------------------------------------------------------------------------

// C (L0C, fp32) = A (L0A) * B (L0B) [+ C]. M = 1 is GEMV: A is read as a plain vector of K.
template <typename Tc, typename Ta, typename Tb>
void Mmad(const LocalTensor<Tc>& dst, const LocalTensor<Ta>& fm, const LocalTensor<Tb>& filter, const MmadParams& p) {
  using namespace slmoe_emu;
  const char* what = "Mmad";
  static_assert(std::is_same<Ta, Tb>::value && kIsB16<Ta> && std::is_same<Tc, float>::value,
                "emulated Mmad: half x half or bfloat16_t x bfloat16_t into float");
  const TensorRef& c = dst.emu_ref();
  const TensorRef& a = fm.emu_ref();
  const TensorRef& b = filter.emu_ref();
  if (c.pos != TPosition::CO1 || a.pos != TPosition::A2 || b.pos != TPosition::B2) {
    fail("%s: operands must be CO1 (L0C), A2 (L0A), B2 (L0B)", what);
  }
  require_align(c, 1024, what);
  require_align(a, 512, what);
  require_align(b, 512, what);
  if (p.m > 4095 || p.n > 4095 || p.k > 4095) fail("%s: m, n, k must be <= 4095 (got %u, %u, %u)", what, p.m, p.n, p.k);
  if (p.isBias || p.cmatrixSource) fail("%s: bias initialisation is not emulated", what);
  if (p.m == 0 || p.n == 0 || p.k == 0) return;
  const bool gemv = p.m == 1;
  const uint32_t ma = gemv ? 16 : (p.m + 15) / 16 * 16;
  const uint32_t kb = (p.k + 15) / 16, nb = (p.n + 15) / 16;
  const uint64_t a_bytes = gemv ? p.k * sizeof(Ta) : static_cast<uint64_t>(ma / 16) * kb * 512;
  const uint64_t b_bytes = static_cast<uint64_t>(kb) * nb * 512;
  const uint64_t c_bytes = static_cast<uint64_t>(nb) * ma * 16 * sizeof(float);
  require_room(a, a_bytes, what);
  require_room(b, b_bytes, what);
  require_room(c, c_bytes, what);
  op_begin(PIPE_M, what);
  op_local(a, 0, static_cast<uint32_t>(a_bytes), false);
  op_local(b, 0, static_cast<uint32_t>(b_bytes), false);
  if (!p.cmatrixInitVal) {
    op_mmad_accumulate_check(c, static_cast<uint32_t>(c_bytes), p.m, p.n);
    op_local(c, 0, static_cast<uint32_t>(c_bytes), false);
  }
  op_local(c, 0, static_cast<uint32_t>(c_bytes), true);
  const Ta* A = fm.emu_data(what);
  const Tb* B = filter.emu_data(what);
  float* C = dst.emu_data(what);
  for (uint32_t i = 0; i < p.m; ++i) {
    for (uint32_t j = 0; j < p.n; ++j) {
      float* out = C + (j / 16) * ma * 16 + i * 16 + j % 16;
      float acc = p.cmatrixInitVal ? 0.0f : *out;
      for (uint32_t k = 0; k < p.k; ++k) {
        const Ta av = gemv ? A[k] : A[((i / 16) * kb + k / 16) * 256 + (i % 16) * 16 + k % 16];
        const Tb bv = B[((k / 16) * nb + j / 16) * 256 + (j % 16) * 16 + k % 16];
        acc += to_f32(av) * to_f32(bv);
      }
      *out = acc;
    }
  }
  op_end();
}

// L0C (NZ, fp32) -> GM, NZ -> ND (FIX); fp32 -> fp16/bf16 per quantPre, round to nearest even.
template <typename T, typename U, const FixpipeConfig& config = CFG_ROW_MAJOR>
void Fixpipe(const GlobalTensor<T>& dst, const LocalTensor<U>& src, const FixpipeParamsV220& p) {
  using namespace slmoe_emu;
  const char* what = "Fixpipe(L0C->GM)";
  static_assert(std::is_same<U, float>::value, "emulated Fixpipe: fp32 accumulators");
  if (config.format != CO2Layout::ROW_MAJOR) fail("%s: only NZ2ND (CFG_ROW_MAJOR) is emulated", what);
  const TensorRef& s = src.emu_ref();
  if (s.pos != TPosition::CO1) fail("%s: source must be CO1 (L0C)", what);
  require_align(s, 64, what);
  const QuantMode_t want = std::is_same<T, float>::value ? NoQuant
                           : std::is_same<T, half>::value ? F322F16
                           : std::is_same<T, bfloat16_t>::value ? F322BF16
                                                                  : VDEQF16;
  if (p.quantPre != want) fail("%s: quantPre %d does not convert float to %s", what, p.quantPre, type_name<T>());
  if (p.nSize > 4095 || p.mSize > 8192) fail("%s: nSize <= 4095 and mSize <= 8192 with NZ2ND", what);
  if (p.ndNum != 1) fail("%s: ndNum != 1 is not emulated", what);
  if (p.reluEn || p.unitFlag || p.isChannelSplit) fail("%s: relu / unitFlag / channel split are not emulated", what);
  if (p.nSize == 0 || p.mSize == 0) return;
  const uint32_t cblocks = (p.nSize + 15) / 16;
  require_room(s, (static_cast<uint64_t>(cblocks - 1) * p.srcStride * 16 + static_cast<uint64_t>(p.mSize) * 16) * 4,
               what);
  op_begin(PIPE_FIX, what);
  for (uint32_t cb = 0; cb < cblocks; ++cb) op_local(s, cb * p.srcStride * 64, p.mSize * 64, false);
  for (uint32_t i = 0; i < p.mSize; ++i) op_gm(dst.emu_ptr() + static_cast<uint64_t>(i) * p.dstStride, p.nSize * sizeof(T), true);
  const float* in = src.emu_data(what);
  for (uint32_t i = 0; i < p.mSize; ++i) {
    for (uint32_t j = 0; j < p.nSize; ++j) {
      dst.emu_ptr()[static_cast<uint64_t>(i) * p.dstStride + j] =
          from_f32<T>(in[(j / 16) * p.srcStride * 16 + i * 16 + j % 16]);
    }
  }
  op_end();
}

// ----- vector ----------------------------------------------------------------------------------

namespace emu_detail {
template <typename T>
void vec_check(const LocalTensor<T>& t, int64_t count, const char* what) {
  slmoe_emu::require_ub(t, what);
  if (count <= 0) slmoe_emu::fail("%s: count %lld", what, static_cast<long long>(count));
  slmoe_emu::require_room(t.emu_ref(), static_cast<uint64_t>(count) * sizeof(T), what);
}
template <typename T>
void vec_read(const LocalTensor<T>& t, int64_t count) {
  slmoe_emu::op_local(t.emu_ref(), 0, static_cast<uint32_t>(count * sizeof(T)), false);
}
template <typename T>
void vec_write(const LocalTensor<T>& t, int64_t count) {
  slmoe_emu::op_local(t.emu_ref(), 0, static_cast<uint32_t>(count * sizeof(T)), true);
}
template <typename T, typename F>
void binary(const LocalTensor<T>& dst, const LocalTensor<T>& a, const LocalTensor<T>& b, int32_t count,
            const char* what, F f) {
  static_assert(std::is_same<T, float>::value, "emulated vector arithmetic: float");
  vec_check(dst, count, what);
  vec_check(a, count, what);
  vec_check(b, count, what);
  slmoe_emu::op_begin(PIPE_V, what);
  vec_read(a, count);
  vec_read(b, count);
  vec_write(dst, count);
  const T* x = a.emu_data(what);
  const T* y = b.emu_data(what);
  T* z = dst.emu_data(what);
  for (int32_t i = 0; i < count; ++i) z[i] = f(x[i], y[i]);
  slmoe_emu::op_end();
}
}  // namespace emu_detail

template <typename T>
void Add(const LocalTensor<T>& dst, const LocalTensor<T>& src0, const LocalTensor<T>& src1, const int32_t& count) {
  emu_detail::binary(dst, src0, src1, count, "Add", [](T a, T b) { return a + b; });
}

template <typename T>
void Mul(const LocalTensor<T>& dst, const LocalTensor<T>& src0, const LocalTensor<T>& src1, const int32_t& count) {
  emu_detail::binary(dst, src0, src1, count, "Mul", [](T a, T b) { return a * b; });
}

template <typename T>
void Muls(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& scalar, const int32_t& count) {
  static_assert(std::is_same<T, float>::value, "emulated vector arithmetic: float");
  const char* what = "Muls";
  emu_detail::vec_check(dst, count, what);
  emu_detail::vec_check(src, count, what);
  slmoe_emu::op_begin(PIPE_V, what);
  emu_detail::vec_read(src, count);
  emu_detail::vec_write(dst, count);
  const T* x = src.emu_data(what);
  T* z = dst.emu_data(what);
  for (int32_t i = 0; i < count; ++i) z[i] = x[i] * scalar;
  slmoe_emu::op_end();
}

template <typename T>
void Duplicate(const LocalTensor<T>& dst, const T& scalar, const int32_t& count) {
  static_assert(std::is_same<T, float>::value || slmoe_emu::kIsB16<T> || slmoe_emu::kIsInt16or32<T>,
                "emulated Duplicate: float, half, bf16, (u)int16, (u)int32");
  const char* what = "Duplicate";
  emu_detail::vec_check(dst, count, what);
  slmoe_emu::op_begin(PIPE_V, what);
  emu_detail::vec_write(dst, count);
  T* z = dst.emu_data(what);
  for (int32_t i = 0; i < count; ++i) z[i] = scalar;
  slmoe_emu::op_end();
}

// Type conversion; the (type, round mode) pairs are those the Atlas A2 table allows, for the pairs
// the kernels use: float <-> half / bfloat16_t, uint8_t -> half (CAST_NONE, exact), half -> int32_t
// (CAST_RINT/FLOOR/CEIL/ROUND/TRUNC), int32_t -> float (CAST_NONE, round to nearest even).
template <typename T, typename U>
void Cast(const LocalTensor<T>& dst, const LocalTensor<U>& src, const RoundMode& mode, const uint32_t count) {
  using namespace slmoe_emu;
  const char* what = "Cast";
  constexpr bool widen = kIsB16<U> && std::is_same<T, float>::value;
  constexpr bool narrow = std::is_same<U, float>::value && kIsB16<T>;
  constexpr bool u8_half = std::is_same<U, uint8_t>::value && std::is_same<T, half>::value;
  constexpr bool half_s32 = std::is_same<U, half>::value && std::is_same<T, int32_t>::value;
  constexpr bool s32_float = std::is_same<U, int32_t>::value && std::is_same<T, float>::value;
  static_assert(widen || narrow || u8_half || half_s32 || s32_float,
                "emulated Cast: float <-> half / bfloat16_t, uint8_t -> half, half -> int32_t, int32_t -> float");
  if ((widen || u8_half || s32_float) && mode != RoundMode::CAST_NONE) {
    fail("%s: %s -> %s takes CAST_NONE here", what, type_name<U>(), type_name<T>());
  }
  if (narrow) {
    const bool rint = mode == RoundMode::CAST_RINT || (mode == RoundMode::CAST_NONE && std::is_same<T, half>::value);
    if (mode == RoundMode::CAST_NONE && std::is_same<T, bfloat16_t>::value) {
      fail("%s: float -> bfloat16_t does not support CAST_NONE on Atlas A2", what);
    }
    if (!rint) fail("%s: round modes other than CAST_RINT are not emulated", what);
  }
  if (half_s32 && (mode == RoundMode::CAST_NONE || mode == RoundMode::CAST_ODD)) {
    fail("%s: half -> int32_t takes CAST_RINT/FLOOR/CEIL/ROUND/TRUNC on Atlas A2", what);
  }
  emu_detail::vec_check(dst, count, what);
  emu_detail::vec_check(src, count, what);
  op_begin(PIPE_V, what);
  emu_detail::vec_read(src, count);
  emu_detail::vec_write(dst, count);
  const U* x = src.emu_data(what);
  T* z = dst.emu_data(what);
  for (uint32_t i = 0; i < count; ++i) {
    if constexpr (u8_half) {
      z[i] = half(static_cast<float>(x[i]));
    } else if constexpr (half_s32) {
      const float f = static_cast<float>(x[i]);
      const float r = mode == RoundMode::CAST_FLOOR ? std::floor(f)
                      : mode == RoundMode::CAST_CEIL ? std::ceil(f)
                      : mode == RoundMode::CAST_ROUND ? std::round(f)
                      : mode == RoundMode::CAST_TRUNC ? std::trunc(f)
                                                      : std::nearbyint(f);
      z[i] = static_cast<int32_t>(r);
    } else if constexpr (s32_float) {
      z[i] = static_cast<float>(x[i]);  // round to nearest even (exact below 2^24)
    } else {
      z[i] = from_f32<T>(to_f32(x[i]));
    }
  }
  op_end();
}

namespace emu_detail {
// dst = f(src, scalar) elementwise on PIPE_V.
template <typename T, typename F>
void unary_scalar(const LocalTensor<T>& dst, const LocalTensor<T>& src, int32_t count, const char* what, F f) {
  vec_check(dst, count, what);
  vec_check(src, count, what);
  slmoe_emu::op_begin(PIPE_V, what);
  vec_read(src, count);
  vec_write(dst, count);
  const T* x = src.emu_data(what);
  T* z = dst.emu_data(what);
  for (int32_t i = 0; i < count; ++i) z[i] = f(x[i]);
  slmoe_emu::op_end();
}
template <typename T>
void shift_check(const T& bits, const char* what) {
  static_assert(slmoe_emu::kIsInt16or32<T>, "emulated shifts: (u)int16_t, (u)int32_t (Atlas A2)");
  if (static_cast<int64_t>(bits) < 0 || static_cast<uint64_t>(bits) > 8 * sizeof(T)) {
    slmoe_emu::fail("%s: shift %lld outside [0, %zu]", what, static_cast<long long>(bits), 8 * sizeof(T));
  }
}
}  // namespace emu_detail

// dst = src >> scalarValue: logical for unsigned, arithmetic for signed types.
template <typename T>
void ShiftRight(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& scalarValue, const int32_t& count) {
  emu_detail::shift_check(scalarValue, "ShiftRight");
  const unsigned n = static_cast<unsigned>(scalarValue);
  emu_detail::unary_scalar(dst, src, count, "ShiftRight", [n](T v) {
    if (n < 8 * sizeof(T)) return static_cast<T>(v >> n);
    if constexpr (std::is_signed<T>::value) return static_cast<T>(v >> (8 * sizeof(T) - 1));
    return T(0);
  });
}

// dst = src << scalarValue.
template <typename T>
void ShiftLeft(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& scalarValue, const int32_t& count) {
  emu_detail::shift_check(scalarValue, "ShiftLeft");
  const unsigned n = static_cast<unsigned>(scalarValue);
  using U = typename std::make_unsigned<T>::type;
  emu_detail::unary_scalar(dst, src, count, "ShiftLeft", [n](T v) {
    return n >= 8 * sizeof(T) ? T(0) : static_cast<T>(static_cast<U>(static_cast<U>(v) << n));
  });
}

// dst = src0 & src1 (Atlas A2: (u)int16_t; 32-bit words go through ReinterpretCast and twice the count).
template <typename T>
void And(const LocalTensor<T>& dst, const LocalTensor<T>& src0, const LocalTensor<T>& src1, const int32_t& count) {
  static_assert(std::is_same<T, int16_t>::value || std::is_same<T, uint16_t>::value,
                "And: int16_t / uint16_t on Atlas A2 (ReinterpretCast 32-bit data)");
  const char* what = "And";
  emu_detail::vec_check(dst, count, what);
  emu_detail::vec_check(src0, count, what);
  emu_detail::vec_check(src1, count, what);
  slmoe_emu::op_begin(PIPE_V, what);
  emu_detail::vec_read(src0, count);
  emu_detail::vec_read(src1, count);
  emu_detail::vec_write(dst, count);
  const T* x = src0.emu_data(what);
  const T* y = src1.emu_data(what);
  T* z = dst.emu_data(what);
  for (int32_t i = 0; i < count; ++i) z[i] = static_cast<T>(x[i] & y[i]);
  slmoe_emu::op_end();
}

// dst = src + scalarValue (float, int16_t, int32_t).
template <typename T>
void Adds(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& scalarValue, const int32_t& count) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, int16_t>::value || std::is_same<T, int32_t>::value,
                "emulated Adds: float, int16_t, int32_t");
  emu_detail::unary_scalar(dst, src, count, "Adds", [&scalarValue](T v) { return static_cast<T>(v + scalarValue); });
}

// dst[i] = the element of src at byte srcBaseAddr + srcOffset[i] (an element-aligned offset inside
// src). The reads are data-dependent: each element's block is declared to the race detector.
template <typename T>
void Gather(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LocalTensor<uint32_t>& srcOffset,
            const uint32_t srcBaseAddr, const uint32_t count) {
  using namespace slmoe_emu;
  static_assert(kIsInt16or32<T> || kIsB16<T> || std::is_same<T, float>::value,
                "Gather: (u)int16_t, (u)int32_t, half, bfloat16_t, float on Atlas A2");
  const char* what = "Gather";
  emu_detail::vec_check(dst, count, what);
  emu_detail::vec_check(srcOffset, count, what);
  require_ub(src, what);
  op_begin(PIPE_V, what);
  emu_detail::vec_read(srcOffset, count);
  const uint32_t* off = srcOffset.emu_data(what);
  for (uint32_t i = 0; i < count; ++i) {
    const uint64_t at = static_cast<uint64_t>(srcBaseAddr) + off[i];
    if (at % sizeof(T) != 0 || at + sizeof(T) > src.emu_ref().bytes) {
      fail("%s: element %u reads byte %llu of a %u-byte source (or not %zu-byte aligned)", what, i,
           static_cast<unsigned long long>(at), src.emu_ref().bytes, sizeof(T));
    }
    op_local(src.emu_ref(), static_cast<uint32_t>(at), sizeof(T), false);
  }
  emu_detail::vec_write(dst, count);
  const uint8_t* in = reinterpret_cast<const uint8_t*>(src.emu_data(what));
  T* z = dst.emu_data(what);
  for (uint32_t i = 0; i < count; ++i) std::memcpy(&z[i], in + srcBaseAddr + off[i], sizeof(T));
  op_end();
}

}  // namespace AscendC
