// FP8 (e4m3) quantisation of an expert weight with one fp32 scale per 128 x 128 block, once per
// optimizer step (kernel.dtype fp8): a CTA per block, 256 threads, each thread two half rows (64 values).
// Bit-identical to megatron_mok.fp8.quantize_weight_128x128 for finite weights (amax * fp32(1/448), IEEE
// reciprocal, RNE conversion; a standalone kernel, so the forward kernel's no-division rule does not
// apply). fmaxf drops NaN: a NaN weight poisons only its own value here, its whole block in torch.
// The torch-ops oracle makes 5 passes over the weight; this one reads it once (Kimi-K2's 8 local
// experts: 4.4 ms with torch ops).
#pragma once
#include "common.cuh"

#include <cuda_fp8.h>

namespace mok {

// w [N, K] bf16 (row stride ld elements, multiple of 8, 16-byte aligned); q [N, K] e4m3 (contiguous),
// s [N / 128, K / 128] fp32. Grid (K / 128, N / 128).
__global__ void __launch_bounds__(256) mok_fp8_quantize_weight_kernel(const __nv_bfloat16* __restrict__ w,
                                                                       long long ld, int K, uint8_t* __restrict__ q,
                                                                       float* __restrict__ s) {
  __shared__ float s_amax[8];
  const int bk = blockIdx.x, bn = blockIdx.y;
  const int r = threadIdx.x >> 1, c0 = (threadIdx.x & 1) * 64;
  const long long row = (long long)bn * kScaleBlock + r;
  const uint4* src = reinterpret_cast<const uint4*>(w + row * ld + (long long)bk * kScaleBlock + c0);
  uint4 v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = __ldg(src + i);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v[i]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(p[j]);
      amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if ((threadIdx.x & 31) == 0) s_amax[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = s_amax[0];
#pragma unroll
  for (int i = 1; i < 8; ++i) amax = fmaxf(amax, s_amax[i]);
  const float scale = fmaxf(amax * kInvE4m3Max, kScaleTiny);
  const float inv = 1.0f / scale;
  uint4* dst = reinterpret_cast<uint4*>(q + row * K + (long long)bk * kScaleBlock + c0);
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // 16 values (two loaded vectors) -> 16 bytes
    uint32_t o[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v[2 * i + h]);
      uint32_t pr[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(p[j]);
        pr[j] = (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(f.x * inv, f.y * inv), __NV_SATFINITE, __NV_E4M3);
      }
      o[2 * h] = pr[0] | (pr[1] << 16);
      o[2 * h + 1] = pr[2] | (pr[3] << 16);
    }
    dst[i] = make_uint4(o[0], o[1], o[2], o[3]);
  }
  if (threadIdx.x == 0) s[(long long)bn * (K / kScaleBlock) + bk] = scale;
}

}  // namespace mok
