// The token-major layout of the FP8 weight gradients' operands: for a GEMM that reduces over tokens, each feature
// (row) holds its tokens contiguously, each expert's tokens padded with zeros to a multiple of 128 (one scale block)
// and the experts back to back from column 0. Written by quant/fp8_token_quant.cuh, read by gemm/fp8_wgrad_gemm.cuh;
// both find an expert's blocks from the per-expert token counts on the device (no host sync).
#pragma once
#include "common.cuh"

namespace mok {

// Exclusive prefix sums over the L <= 2 * NT experts' counts (all NT threads of the CTA call it): pb[e] the first
// 128-token block of expert e, pr[e] its first layout-order row (pr may be null); pb[L] / pr[L] the totals.
template <int NT>
__device__ __forceinline__ void expert_prefixes(const int* __restrict__ counts, int L, long long* pr, int* pb) {
  __shared__ long long wr[NT / 32];
  __shared__ int wb[NT / 32];
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int c0 = 2 * t < L ? max(counts[2 * t], 0) : 0, c1 = 2 * t + 1 < L ? max(counts[2 * t + 1], 0) : 0;
  const int b0 = (c0 + 127) / 128, b1 = (c1 + 127) / 128;
  long long r = (long long)c0 + c1;
  int b = b0 + b1;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {  // inclusive scan within the warp
    const long long rr = __shfl_up_sync(0xffffffffu, r, o);
    const int bb = __shfl_up_sync(0xffffffffu, b, o);
    if (lane >= o) {
      r += rr;
      b += bb;
    }
  }
  if (lane == 31) {
    wr[warp] = r;
    wb[warp] = b;
  }
  __syncthreads();
  for (int w = 0; w < warp; ++w) {
    r += wr[w];
    b += wb[w];
  }  // inclusive over this thread's two entries
  if (2 * t < L) {
    pb[2 * t] = b - b0 - b1;
    if (pr) pr[2 * t] = r - c0 - c1;
  }
  if (2 * t + 1 < L) {
    pb[2 * t + 1] = b - b1;
    if (pr) pr[2 * t + 1] = r - c1;
  }
  if (t == NT - 1) {
    pb[L] = b;
    if (pr) pr[L] = r;
  }
  __syncthreads();
}

}  // namespace mok
