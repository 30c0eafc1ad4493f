// MXFP8 quantisation (kernel.dtype mxfp8, Blackwell sm_100a): e4m3 elements, one UE8M0 scale (a power of
// two, stored as its biased exponent byte) per 1 x 32 block along K. Arch-neutral device code: the
// Blackwell megakernel fuses it where the Hopper one fuses fp8_quant.cuh (pull dispatch of x, the SwiGLU
// epilogue); here it also runs as a unit kernel on the H200 (mok_mxfp8_quantize_rows), tested bit for bit
// against megatron_mok/mxfp8.py.
//
//   exponent  b = ceil(log2(amax * fp32(1/448))) + 127 from the fp32 bits (no log, no division), clamped
//             to [0, 254]; so |x| / 2^(b-127) <= 448 and no element saturates
//   elements  e4m3_rn_satfinite(x * 2^(127 - b)) -- a power-of-two multiply, exact in fp32
//   scales    row-major [rows][K/32], or directly in the sm_100 MMA's scale-factor layout (128-row x
//             4-scale atoms, mx_sf_offset; checked against CUTLASS's Sm1xxBlockScaledConfig by
//             csrc/mok/sm100/sf_layout_probe.cu), so the GEMM reads them without a re-layout pass
#pragma once
#include "common.cuh"
#include "quant/fp8_quant.cuh"

namespace mok {

constexpr int kMxBlock = 32;

enum MxScaleLayout : int { kMxScalesRowMajor = 0, kMxScalesSm100 = 1 };

__device__ __forceinline__ uint32_t e8m0_exponent(float amax) {
  const uint32_t bits = __float_as_uint(amax * kInvE4m3Max);
  const uint32_t e = (bits >> 23) & 0xFFu, m = bits & 0x7FFFFFu;
  const uint32_t b = e == 0 ? (m > 0x400000u ? 1u : 0u)  // subnormal: 2^-127 (b = 0) covers v <= 2^-127
                            : e + (m != 0 ? 1u : 0u);    // normal: round the power of two up
  return min(b, 254u);
}

// 2^(127 - b) in fp32, exact for b in [0, 254] (b = 254 is the subnormal 2^-127)
__device__ __forceinline__ float e8m0_inverse(uint32_t b) {
  const int e = 254 - (int)b;
  return __uint_as_float(e > 0 ? (uint32_t)e << 23 : 0x400000u);
}

// Byte offset of the scale of (row, K block kb) among nkb scales per row (megatron_mok/mxfp8.py:
// sm100_sf_offset for kMxScalesSm100).
__host__ __device__ __forceinline__ long long mx_sf_offset(long long row, int kb, int nkb, int layout) {
  if (layout == kMxScalesRowMajor) return row * nkb + kb;
  const long long atom = (row / 128) * ((nkb + 3) / 4) + kb / 4;
  const int r = (int)(row % 128);
  return atom * 512 + (r % 32) * 16 + (r / 32) * 4 + kb % 4;
}

// One warp quantises one row of H (multiple of 32) bf16 values (fp8_quant.cuh: for_each_row_vector): lane
// l holds 8 consecutive values of vector v, a quad of lanes one 32-value block (amax by a 2-step
// butterfly). dst: the row's H e4m3 bytes; sf: the scale buffer, row `row` of it.
template <int U>
__device__ __forceinline__ void quantize_row_mx(uint8_t* __restrict__ dst, uint8_t* __restrict__ sf, long long row,
                                                int sf_layout, const __nv_bfloat16* __restrict__ src, int H,
                                                int lane) {
  uint2* d = reinterpret_cast<uint2*>(dst);
  const int nv = H / 8, nkb = H / kMxBlock;
  for_each_row_vector<U>(src, H, lane, [&](int v, const uint4& vec) {
    float f[8];
    bf16x8_to_float(vec, f);
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const uint32_t b = e8m0_exponent(amax);
    const float inv = e8m0_inverse(b);
    if (v < nv) {
      d[v] = make_uint2(e4m3x2(f[0] * inv, f[1] * inv) | (e4m3x2(f[2] * inv, f[3] * inv) << 16),
                        e4m3x2(f[4] * inv, f[5] * inv) | (e4m3x2(f[6] * inv, f[7] * inv) << 16));
      if ((lane & 3) == 0) sf[mx_sf_offset(row, v / 4, nkb, sf_layout)] = (uint8_t)b;
    }
  });
}

// Unit kernel: rows [M, H] (row stride ld elements) -> e4m3 [M, H] + scales; one warp per row.
__global__ void __launch_bounds__(256) mok_mxfp8_quantize_rows_kernel(const __nv_bfloat16* __restrict__ x, long long ld,
                                                                      int M, int H, uint8_t* __restrict__ q,
                                                                      uint8_t* __restrict__ sf, int sf_layout) {
  const int lane = threadIdx.x & 31;
  const long long warps = (long long)gridDim.x * (blockDim.x / 32);
  for (long long r = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < M; r += warps)
    quantize_row_mx<4>(q + r * H, sf, r, sf_layout, x + r * ld, H, lane);
}

}  // namespace mok
