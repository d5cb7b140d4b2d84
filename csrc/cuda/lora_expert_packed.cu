// Launchers of the grouped LoRA expert op over a packed frozen W (API in lora_expert_cuda.h).
//
// Per chunk of experts: one decode kernel writes the chunk's W_e (experts that own rows only) into
// a scratch of x's dtype, then the dense launchers of lora_expert_kernels.cu run on the chunk with
// the scratch as W. Why a scratch and not a decode inside the GEMM's k-loop: the decode is ALU work
// per weight element, and done per row tile inside the pipeline it would sit between cp.async and
// mma.sync for every row tile of the expert; decoded once per call it is one bandwidth-bound pass
// (read the packed bytes, write the tile) and the GEMM keeps its cp.async + tensor-core pipeline
// unchanged. The backward decodes again, and only for dx (dA and dB never read W).
//
// The decode is megatron_slmoe/ops/quantized_weights.py's, value for value (csrc/lora_expert_packed.h
// states the layouts): MXFP4 as the fp32 product E2M1 * 2^(s-127); INT4 as q * scale rounded to the
// scale's dtype (compressed-tensors computes q.to(scale.dtype) * scale); block FP8 as the fp32
// product of the FP8 value and its block's factor; each then rounded to the tile's dtype.

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "lora_expert_cuda.h"
#include "ptx.cuh"

// csrc/cuda/emu compiles injected bugs in with SLMOE_MUTANT(n); real builds never define it.
#ifndef SLMOE_MUTANT
#define SLMOE_MUTANT(n) false
#endif

namespace slmoe {
namespace cuda {
namespace {

constexpr int kDecodeThreads = 256;
constexpr int kUnit = 8;  // elements a thread decodes at once: one INT4 word, four MXFP4 bytes

struct DecodeParams {
  PackedWeightArgs w;
  int64_t out, in;
  int64_t scale_rows, scale_cols;  // of one expert
  int64_t e0, experts;             // decode experts e0 .. e0 + experts - 1
  const int64_t* counts;           // [experts] device, from e0; nullptr: all
  void* scratch;                   // [experts, out, in]
};

__host__ __device__ __forceinline__ float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// E2M1 code (bit 3 the sign) -> value, built as fp32 bits: 0, 0.5, then (1 + m/2) * 2^(e-1).
__device__ __forceinline__ float e2m1(uint32_t code) {
  const uint32_t m = code & 7u;
  uint32_t bits = m == 0 ? 0u : m == 1 ? 0x3f000000u : ((((m >> 1) - 1u + 127u) << 23) | ((m & 1u) << 22));
  return bits_to_float(bits | ((code & 8u) << 28));
}

// E8M0 byte -> 2^(s-127); s = 0 is the subnormal 2^-127, 255 NaN (refused on the host already).
__device__ __forceinline__ float e8m0(uint32_t s) {
  if (SLMOE_MUTANT(3)) s -= 1;  // bias 128
  if (s == 255u) return std::numeric_limits<float>::quiet_NaN();
  return bits_to_float(s == 0u ? 0x00400000u : s << 23);
}

// float8_e4m3fn byte -> float (exact): bias 7, subnormals m * 2^-9, S.1111.111 NaN, no infinities.
__device__ __forceinline__ float e4m3(uint32_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u, sign = (b & 0x80u) << 24;
  if (e == 15u && m == 7u) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0u && !SLMOE_MUTANT(8)) {  // (mutant 8: subnormals read as normals)
    const float mag = static_cast<float>(m) * 0.001953125f;
    return sign ? -mag : mag;
  }
  return bits_to_float(sign | ((e - 7u + 127u) << 23) | (m << 20));
}

template <typename T>
__device__ __forceinline__ T to_elem(float v) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return __float2bfloat16_rn(v);
  } else if constexpr (std::is_same<T, __half>::value) {
    return __float2half_rn(v);
  } else {
    return static_cast<T>(v);
  }
}

// q * scale as compressed-tensors computes it: the product (exact in fp32 for bf16/fp16 scales, a
// 4-bit integer times an 8- or 11-bit significand) rounded to the scale's dtype.
__device__ __forceinline__ float int4_value(int q, const void* scale, int64_t index, DType scale_dtype) {
  if (scale_dtype == DType::kBFloat16) {
    const float p = static_cast<float>(q) * __bfloat162float(static_cast<const __nv_bfloat16*>(scale)[index]);
    return SLMOE_MUTANT(7) ? p : __bfloat162float(__float2bfloat16_rn(p));
  }
  if (scale_dtype == DType::kFloat16) {
    const float p = static_cast<float>(q) * __half2float(static_cast<const __half*>(scale)[index]);
    return SLMOE_MUTANT(7) ? p : __half2float(__float2half_rn(p));
  }
  return static_cast<float>(q) * static_cast<const float*>(scale)[index];
}

// Decodes the kUnit elements at (row r, columns c .. c + kUnit - 1) of expert e into v; all lie in
// one row and one scale group (MXFP4, INT4: d_in is a multiple of the group, which kUnit divides).
__device__ __forceinline__ void decode_unit(const DecodeParams& p, int64_t e, int64_t r, int64_t c,
                                            float (&v)[kUnit]) {
  const PackedWeightArgs& w = p.w;
  const int64_t scale0 = e * p.scale_rows * p.scale_cols;
  if (w.format == PackedFormat::kMxfp4) {
    const int64_t groups = p.in / 32;
    const uint8_t* bytes = static_cast<const uint8_t*>(w.packed) + (e * p.out + r) * (p.in / 2) + c / 2;
    const int64_t g = SLMOE_MUTANT(2) ? (c / 16) % groups : c / 32;
    const float f = e8m0(static_cast<const uint8_t*>(w.scale)[scale0 + r * groups + g]);
#pragma unroll
    for (int i = 0; i < kUnit / 2; ++i) {
      const uint32_t b = bytes[i];
      const uint32_t lo = SLMOE_MUTANT(1) ? b >> 4 : b & 15u, hi = SLMOE_MUTANT(1) ? b & 15u : b >> 4;
      v[2 * i] = e2m1(lo) * f;
      v[2 * i + 1] = e2m1(hi) * f;
    }
  } else if (w.format == PackedFormat::kInt4) {
    const int64_t group = SLMOE_MUTANT(6) ? 32 : w.block_cols;
    const uint32_t word = static_cast<uint32_t>(static_cast<const int32_t*>(w.packed)[(e * p.out + r) * (p.in / 8) + c / 8]);
    const int64_t index = scale0 + r * p.scale_cols + c / group;
#pragma unroll
    for (int t = 0; t < kUnit; ++t) {
      const uint32_t nibble = (word >> (4 * (SLMOE_MUTANT(4) ? 7 - t : t))) & 15u;
      // Stored as q + 8 (mutant 5: read as a two's-complement nibble instead).
      const int q = SLMOE_MUTANT(5) ? static_cast<int>(nibble) - (nibble >= 8u ? 16 : 0) : static_cast<int>(nibble) - 8;
      v[t] = int4_value(q, w.scale, index, w.scale_dtype);
    }
  } else {
    const uint8_t* bytes = static_cast<const uint8_t*>(w.packed) + (e * p.out + r) * p.in;
    const float* scale = static_cast<const float*>(w.scale) + scale0;
    const int64_t br = SLMOE_MUTANT(9) ? w.block_cols : w.block_rows;
    const float* srow = scale + (r / br) * p.scale_cols;
#pragma unroll
    for (int i = 0; i < kUnit; ++i) {
      const int64_t col = c + i < p.in ? c + i : p.in - 1;  // a row's tail unit (d_in % 8 != 0)
      v[i] = e4m3(bytes[col]) * srow[col / w.block_cols];
    }
  }
}

// One thread per unit of kUnit elements of a row (rows padded to whole units), grid-stride.
template <typename T>
__global__ void __launch_bounds__(kDecodeThreads) decode_kernel(const DecodeParams p) {
  const int64_t units_per_row = (p.in + kUnit - 1) / kUnit;
  const int64_t units_per_expert = p.out * units_per_row;
  const int64_t total = p.experts * units_per_expert;
  const bool vec = p.in % kUnit == 0;  // rows of whole units: 16-byte stores of bf16/fp16
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * kDecodeThreads + threadIdx.x; u < total;
       u += static_cast<int64_t>(gridDim.x) * kDecodeThreads) {
    const int64_t local = u / units_per_expert;
    const bool has_rows = p.counts == nullptr || p.counts[local] > 0;
    if (SLMOE_MUTANT(12) ? has_rows : !has_rows) continue;  // a dropped tile nobody reads
    if (SLMOE_MUTANT(11) && local == p.experts - 1) continue;
    const int64_t rest = u % units_per_expert;
    const int64_t r = rest / units_per_row, c = (rest % units_per_row) * kUnit;
    float v[kUnit];
    decode_unit(p, p.e0 + local, r, c, v);
    T* dst = static_cast<T*>(p.scratch) + (local * p.out + r) * p.in + c;
    if constexpr (sizeof(T) == 2) {
      if (vec) {
        T elems[kUnit];
#pragma unroll
        for (int i = 0; i < kUnit; ++i) elems[i] = to_elem<T>(v[i]);
        uint4 chunk;
        std::memcpy(&chunk, elems, sizeof chunk);
        *reinterpret_cast<uint4*>(dst) = chunk;
        continue;
      }
    }
    const int n = static_cast<int>(p.in - c < kUnit ? p.in - c : kUnit);
    for (int i = 0; i < n; ++i) dst[i] = to_elem<T>(v[i]);
  }
}

template <typename P>
cudaError_t launch(void (*kernel)(P), int grid, cudaStream_t stream, const P& params) {
#ifdef SLMOE_CUDA_EMU
  (void)stream;
  slmoe_emu::launch(dim3(grid), dim3(kDecodeThreads), 0, [&] { kernel(params); });
#else
  kernel<<<grid, kDecodeThreads, 0, stream>>>(params);
#endif
  return cudaGetLastError();
}

int64_t elem_bytes(DType t) {
  switch (t) {
    case DType::kFloat64: return 8;
    case DType::kFloat32: return 4;
    default: return 2;
  }
}

const void* advance(const void* p, int64_t elems, int64_t bytes) {
  return p == nullptr ? nullptr : static_cast<const unsigned char*>(p) + elems * bytes;
}
void* advance(void* p, int64_t elems, int64_t bytes) {
  return p == nullptr ? nullptr : static_cast<unsigned char*>(p) + elems * bytes;
}

bool layout_ok(const PackedWeightArgs& w, int64_t d_in) {
  switch (w.format) {
    case PackedFormat::kMxfp4: return w.block_rows == 1 && w.block_cols == 32 && d_in % 32 == 0;
    case PackedFormat::kInt4:
      return w.block_rows == 1 && (w.block_cols == 32 || w.block_cols == 64 || w.block_cols == 128) &&
             d_in % w.block_cols == 0 &&
             (w.scale_dtype == DType::kBFloat16 || w.scale_dtype == DType::kFloat16 ||
              w.scale_dtype == DType::kFloat32);
    case PackedFormat::kBlockFp8: return w.block_rows > 0 && w.block_cols > 0;
  }
  return false;
}

}  // namespace

cudaError_t decode_packed_experts(const PackedWeightArgs& w, DType dtype, int64_t d_out, int64_t d_in, int64_t e0,
                                  int64_t n, const int64_t* tokens_per_expert, void* scratch, cudaStream_t stream) {
  if (!layout_ok(w, d_in) || d_out < 0 || d_in < 0 || e0 < 0 || n < 0) return cudaErrorInvalidValue;
  if (n == 0 || d_out == 0 || d_in == 0) return cudaSuccess;
  DecodeParams p;
  p.w = w;
  p.out = d_out;
  p.in = d_in;
  p.scale_rows = (d_out + w.block_rows - 1) / w.block_rows;
  p.scale_cols = (d_in + w.block_cols - 1) / w.block_cols;
  p.e0 = e0;
  p.experts = n;
  p.counts = tokens_per_expert == nullptr ? nullptr : tokens_per_expert + e0;
  p.scratch = scratch;
  // Enough blocks to fill the device a few times over; each thread then walks the rest.
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const int64_t units = n * d_out * ((d_in + kUnit - 1) / kUnit);
  const int64_t want = (units + kDecodeThreads - 1) / kDecodeThreads, cap = 8 * static_cast<int64_t>(sms);
  const int grid = static_cast<int>(want < cap ? want : cap);
  switch (dtype) {
    case DType::kBFloat16: return launch(&decode_kernel<__nv_bfloat16>, grid, stream, p);
    case DType::kFloat16: return launch(&decode_kernel<__half>, grid, stream, p);
    case DType::kFloat32: return launch(&decode_kernel<float>, grid, stream, p);
    case DType::kFloat64: return launch(&decode_kernel<double>, grid, stream, p);
  }
  return cudaErrorInvalidValue;
}

cudaError_t lora_grouped_linear_packed_fwd(const LoraPackedFwdArgs& a, cudaStream_t stream) {
  const LoraFwdArgs& d = a.dense;
  if (a.scratch_experts < 1 || a.host_tokens_per_expert == nullptr) return cudaErrorInvalidValue;
  const int64_t es = elem_bytes(d.dtype);
  int64_t row0 = 0;
  for (int64_t e0 = 0; e0 < d.E; e0 += a.scratch_experts) {
    const int64_t n = d.E - e0 < a.scratch_experts ? d.E - e0 : a.scratch_experts;
    int64_t rows = 0;
    for (int64_t e = e0; e < e0 + n; ++e) rows += a.host_tokens_per_expert[e];
    if (rows == 0) continue;  // nothing to compute, nothing to decode
    cudaError_t err = decode_packed_experts(a.w, d.dtype, d.d_out, d.d_in, e0, n, d.tokens_per_expert, a.scratch, stream);
    if (err != cudaSuccess) return err;
    const int64_t first = SLMOE_MUTANT(10) ? 0 : row0;
    LoraFwdArgs c = d;
    c.T = rows;
    c.E = n;
    c.x = advance(d.x, first * d.d_in, es);
    c.lora_x = advance(d.lora_x, first * d.d_in, es);
    c.weight = a.scratch;
    c.lora_a = advance(d.lora_a, e0 * d.r * d.d_in, es);
    c.lora_b = advance(d.lora_b, e0 * d.d_out * d.r, es);
    c.tokens_per_expert = d.tokens_per_expert + e0;
    c.y = advance(d.y, first * d.d_out, es);
    c.h = advance(d.h, first * d.r, es);
    err = lora_grouped_linear_fwd(c, stream);
    if (err != cudaSuccess) return err;
    row0 += rows;
  }
  return cudaSuccess;
}

cudaError_t lora_grouped_linear_packed_bwd(const LoraPackedBwdArgs& a, cudaStream_t stream) {
  const LoraBwdArgs& d = a.dense;
  if (a.scratch_experts < 1 || a.host_tokens_per_expert == nullptr) return cudaErrorInvalidValue;
  if (d.dx != nullptr && d.T > 0 && a.scratch == nullptr) return cudaErrorInvalidValue;
  const int64_t es = elem_bytes(d.dtype);
  int64_t row0 = 0;
  for (int64_t e0 = 0; e0 < d.E; e0 += a.scratch_experts) {
    const int64_t n = d.E - e0 < a.scratch_experts ? d.E - e0 : a.scratch_experts;
    int64_t rows = 0;
    for (int64_t e = e0; e < e0 + n; ++e) rows += a.host_tokens_per_expert[e];
    // A chunk without rows still runs: its experts' dA and dB are written as zeros.
    cudaError_t err = cudaSuccess;
    if (d.dx != nullptr && rows > 0) {
      err = decode_packed_experts(a.w, d.dtype, d.d_out, d.d_in, e0, n, d.tokens_per_expert, a.scratch, stream);
      if (err != cudaSuccess) return err;
    }
    const int64_t first = SLMOE_MUTANT(10) ? 0 : row0;
    LoraBwdArgs c = d;
    c.T = rows;
    c.E = n;
    c.grad_y = advance(d.grad_y, first * d.d_out, es);
    c.lora_x = advance(d.lora_x, first * d.d_in, es);
    c.weight = a.scratch;
    c.lora_a = advance(d.lora_a, e0 * d.r * d.d_in, es);
    c.lora_b = advance(d.lora_b, e0 * d.d_out * d.r, es);
    c.h = advance(d.h, first * d.r, es);
    c.lora_mask = advance(d.lora_mask, first * d.d_in, es);
    c.tokens_per_expert = d.tokens_per_expert + e0;
    c.dx = advance(d.dx, first * d.d_in, es);
    c.da = advance(d.da, e0 * d.r * d.d_in, es);
    c.db = advance(d.db, e0 * d.d_out * d.r, es);
    c.dh = advance(d.dh, first * d.r, es);
    err = lora_grouped_linear_bwd(c, stream);
    if (err != cudaSuccess) return err;
    row0 += rows;
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace slmoe
