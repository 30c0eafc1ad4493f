// FP8 (e4m3) quantisation fused into the forward kernel (kernel.dtype fp8), DeepSeek-V3 recipe:
// one fp32 scale per 1 x 128 block of an activation row, scale = max(amax / 448, 1e-12),
// q = e4m3_rn_satfinite(x * (1 / scale)), as megatron_mok/fp8.py computes it in PyTorch (up to an ulp
// of the scale, see block_scale).
//
//   quantize_pull_row  first phase of the FP8 forward: a bf16 x row of this rank into its source-quantised
//                      copy, e4m3 + scales (pull_dispatch.cuh: quantize_sources; the pulls then move H + H/32
//                      bytes a row instead of 2H)
//   rescale_half       compute SMs: per-K-block scale promotion without a second accumulator. The
//                      accumulator is kept in units of the current block's scale s_kb = sa[row] * sb[col]:
//                      before block kb's WGMMAs acc *= s_{kb-1} / s_kb, after the last acc *= s_last.
//                      That is the same sum as sum_kb P_kb * s_kb (fp32 rounding aside) with 128
//                      accumulator registers instead of 256, so the bf16 kernel's 128 x 256 tiles stay.
//                      Each block is one WGMMA group per warpgroup, drained before its promotion
//                      (fp8_kloop.cuh says why, and how the two warpgroups' groups are ordered so that
//                      one's promotion overlaps the other's MMAs).
//   quantize_store_row128  one row's 1 x 128 block in WGMMA fragment order -> e4m3 + scale, 16-byte
//                      stores after a quad transpose (forward: store_act_row_e4m3, the SwiGLU output of
//                      an fc1 tile; backward: the dH blocks of a dgrad stage-1 tile)
#pragma once
#include "common.cuh"
#include "comm/push_combine.cuh"

#include <cuda_fp8.h>

namespace mok {

__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  return (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

// No IEEE division anywhere in the kernel: its slow path is a subroutine CALL, and a call makes ptxas
// give up the consumer warpgroups' setmaxnreg register budget (224) for the launch bound's 168.
// __fdividef / inv_scale agree with the oracle's fp32 division and reciprocal to an ulp, which at
// most moves one e4m3 rounding of a block (the tests compare at the recipe's tolerance).
__device__ __forceinline__ float block_scale(float amax) { return fmaxf(amax * kInvE4m3Max, kScaleTiny); }
// 1 / scale for a normal, finite scale (>= 1e-12): approximate reciprocal + one Newton step (the
// correctly rounded __frcp_rn has a subroutine slow path, see above).
__device__ __forceinline__ float inv_scale(float scale) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(scale));
  return fmaf(r, fmaf(-scale, r, 1.0f), r);
}

// The 8 bf16 values of a 16-byte vector as fp32.
__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float* f) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(p[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

// The row walk of a warp quantising one bf16 row of H values (vector v = 8 values, at lane v % 32): up
// to U 16-byte loads per lane in flight (the pull is latency-bound, as in copy_row_bf16), then
// op(v, vec) per vector on every lane while lane 0's v is in the row -- quantisers shuffle, so lanes past
// the row's end call too, with vec = 0, and op stores only for v < H / 8. Shared by the 1 x 128 recipe's
// pull (quantize_pull_row) and the MXFP8 one (mxfp8_quant.cuh: quantize_row_mx).
template <int U, class Op>
__device__ __forceinline__ void for_each_row_vector(const __nv_bfloat16* __restrict__ src, int H, int lane, Op&& op) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
  const int nv = H / 8;
  for (int base = 0; base < nv; base += 32 * U) {
    uint4 buf[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = base + u * 32 + lane;
      buf[u] = v < nv ? __ldg(s + v) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u * 32 >= nv) break;  // warp-uniform
      op(base + u * 32 + lane, buf[u]);
    }
  }
}

// 8 consecutive bf16 values v of a row whose 1 x 128 block spans 16 lanes (lanes 0-15 or 16-31 hold one
// block's 16 x 8 values): the block's amax by a 16-lane butterfly (every lane of the warp must call, pass
// zeros past the row's end), the block scale into *scale and the 8 e4m3 values as the result.
__device__ __forceinline__ uint2 quantize_bf16x8_block16(const uint4& v, float* scale) {
  float f[8];
  bf16x8_to_float(v, f);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  *scale = block_scale(amax);
  const float inv = inv_scale(*scale);
  uint2 q;
  q.x = e4m3x2(f[0] * inv, f[1] * inv) | (e4m3x2(f[2] * inv, f[3] * inv) << 16);
  q.y = e4m3x2(f[4] * inv, f[5] * inv) | (e4m3x2(f[6] * inv, f[7] * inv) << 16);
  return q;
}

// One warp pulls and quantises one row of H (multiple of 128) bf16 values. A round of the row walk covers
// 32 lanes x 8 values = two scale blocks (lanes 0-15, 16-31), so a block's amax is a 16-lane butterfly.
// Block b's scale goes to dst_scale[b * scale_step] (1: a row-major scale row; common.cuh: fp8_scale_step).
// Returns true (on every lane) if the row holds a NaN or an Inf: the block amax cannot tell (fmaxf drops a NaN).
template <int U>
__device__ __forceinline__ bool quantize_pull_row(uint8_t* __restrict__ dst, float* __restrict__ dst_scale,
                                                  const __nv_bfloat16* __restrict__ src, int H, int lane,
                                                  long long scale_step = 1) {
  uint2* d = reinterpret_cast<uint2*>(dst);
  const int nv = H / 8;
  uint32_t bad = 0;
  for_each_row_vector<U>(src, H, lane, [&](int v, const uint4& vec) {
    float scale;
    const uint2 q = quantize_bf16x8_block16(vec, &scale);
    bad |= bf16x8_nonfinite(vec);  // past the row's end vec is zeros
    if (v < nv) {
      d[v] = q;
      if ((lane & 15) == 0) dst_scale[(v / 16) * scale_step] = scale;
    }
  });
  return __any_sync(0xffffffffu, bad != 0);
}

// One 128-column half of a 64 x 256 WGMMA fragment (acc or acc + 64): a[4j + 2h + {0,1}] (j < 16) is
// row h (0/1) of this thread; row h is multiplied by f_h.
__device__ __forceinline__ void rescale_half(float* a, float f0, float f1) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    a[4 * j + 0] *= f0;
    a[4 * j + 1] *= f0;
    a[4 * j + 2] *= f1;
    a[4 * j + 3] *= f1;
  }
}

// One row's 128 values of a 1 x 128 block in WGMMA fragment order, v[2j + p] (j < 16, p < 2) = column
// 8j + 2(lane%4) + p, as e4m3 + its scale: the quad computes the block's amax, quantises, and each lane
// stores 2 x 16 bytes (dst = the block's first byte, nullptr: row not valid; all lanes must call, the
// transpose uses shuffles). Used by the forward's fc1 epilogue and the backward's dH epilogue.
__device__ __forceinline__ void quantize_store_row128(uint8_t* dst, float* dst_scale, const float* v, int lane) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(v[i]));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  const float scale = block_scale(amax);
  const float inv = inv_scale(scale);
  const int l = lane & 3;
#pragma unroll
  for (int j0 = 0; j0 < 16; j0 += 8) {
    uint32_t w[4];  // word m = e4m3 pairs of chunks j0+2m (low half) and j0+2m+1 (high half)
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int j = j0 + 2 * m;
      w[m] = e4m3x2(v[2 * j] * inv, v[2 * j + 1] * inv) | (e4m3x2(v[2 * j + 2] * inv, v[2 * j + 3] * inv) << 16);
    }
    // after the transpose lane l holds every lane's word l: the 8 + 8 bytes of chunks j0+2l, j0+2l+1
    const uint4 o = quad_transpose(w[0], w[1], w[2], w[3], lane);
    const uint4 q = make_uint4(__byte_perm(o.x, o.y, 0x5410), __byte_perm(o.z, o.w, 0x5410),
                               __byte_perm(o.x, o.y, 0x7632), __byte_perm(o.z, o.w, 0x7632));
    if (dst != nullptr) *reinterpret_cast<uint4*>(dst + 8 * j0 + 16 * l) = q;
  }
  if (dst != nullptr && l == 0) *dst_scale = scale;
}

// acc of a 64 x 256 fc1 fragment after the SwiGLU was written in place: acc[4j + 2h], acc[4j + 2h + 1]
// (j < 16) are row h's outputs at columns 8j + 2(lane%4) + {0,1} of a 128-column tile = one 1 x 128 block.
__device__ __forceinline__ void store_act_row_e4m3(uint8_t* dst, float* dst_scale, const float* acc, int h, int lane) {
  float v[32];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    v[2 * j] = acc[4 * j + 2 * h];
    v[2 * j + 1] = acc[4 * j + 2 * h + 1];
  }
  quantize_store_row128(dst, dst_scale, v, lane);
}

}  // namespace mok
