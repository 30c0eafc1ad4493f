// Push combine and the final top-k weighted sum.
//
// push: the fc2 epilogue writes each finished y row (bf16) straight into the home rank's
//       combine buffer combine_buf[r][t, k, :] (r, t, k from the layout entry). In real EP this is a
//       store through the home rank's peer pointer; in emulated EP it is the per-rank table pointer.
// reduce: once every rank's compute SMs are done (counter), each rank's comm warps and compute
//       consumer warps compute out[r][t] = bf16( sum_k w[t,k] * float(combine_buf[r][t,k]) ),
//       fp32, k ascending, unused slots (idx == -1) skipped, rows with no valid k -> 0.
#pragma once
#include "common.cuh"

namespace mok {

// One thread's share of one output row of a 64x256 WGMMA accumulator fragment:
// columns col0 + 8*j + {0,1}, j = 0..31, values acc[4j + 2h], acc[4j + 2h + 1].
__device__ __forceinline__ void push_combine_row_frag(const Params& P, int2 src, int col0, const float* acc, int h) {
  __nv_bfloat16* dst = P.ranks[src.x].combine + (long long)src.y * P.H;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int c = col0 + 8 * j;
    if (c < P.H)
      *reinterpret_cast<__nv_bfloat162*>(dst + c) = __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
  }
}

// worker: warp index among this rank's participating warps; nworkers: their number.
__device__ __forceinline__ void combine_reduce(const Params& P, int q, int worker, int nworkers) {
  const int lane = threadIdx.x & 31;
  const RankTable rt = P.ranks[q];
  const int H = P.H, K = P.K;
  for (int t = worker; t < rt.T; t += nworkers) {
    const int* idx = rt.idx + (long long)t * K;
    const float* w = rt.w + (long long)t * K;
    const uint4* cb = reinterpret_cast<const uint4*>(rt.combine + (long long)t * K * H);
    uint4* out = reinterpret_cast<uint4*>(rt.out + (long long)t * H);
    for (int v = lane; v < H / 8; v += 32) {
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.f;
      for (int k = 0; k < K; ++k) {
        if (idx[k] < 0) continue;
        const float wk = w[k];
        const uint4 d = cb[(long long)k * (H / 8) + v];
        const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&d);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __bfloat1622float2(p[i]);
          acc[2 * i] = fmaf(wk, f.x, acc[2 * i]);
          acc[2 * i + 1] = fmaf(wk, f.y, acc[2 * i + 1]);
        }
      }
      uint4 o;
      __nv_bfloat162* po = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int i = 0; i < 4; ++i) po[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
      out[v] = o;
    }
  }
}

}  // namespace mok
