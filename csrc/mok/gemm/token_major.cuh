// The token-major layout of the FP8 weight gradients' operands: for a GEMM that reduces over tokens, each feature
// (row) holds its tokens contiguously, each expert's tokens padded with zeros to a multiple of 128 (one scale block)
// and the experts back to back from column 0. Written by quant/fp8_token_quant.cuh, read by gemm/fp8_wgrad_gemm.cuh;
// both find an expert's blocks from the per-expert token counts on the device (no host sync).
#pragma once
#include "common.cuh"
#include "comm/timeout.cuh"
#include "mok_limits.h"

#include <climits>

namespace mok {

// Exclusive prefix sums over the L <= 2 * NT experts' counts (all NT threads of the CTA call it): pb[e] the first
// 128-token block of expert e, pr[e] its first layout-order row (pr may be null); pb[L] / pr[L] the totals. Sums run
// in 64 bits and the block offsets are clamped to INT_MAX, so corrupt counts cannot make them wrap and stop
// increasing (check_token_counts then rejects them). Negative counts count as 0.
template <int NT>
__device__ __forceinline__ void expert_prefixes(const int* __restrict__ counts, int L, long long* pr, int* pb) {
  static_assert(NT % 32 == 0 && 2 * NT >= MOK_MAX_LOCAL_EXPERTS, "two experts per thread, whole warps");
  __shared__ long long wr[NT / 32], wb[NT / 32];
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const long long c0 = 2 * t < L ? max(counts[2 * t], 0) : 0, c1 = 2 * t + 1 < L ? max(counts[2 * t + 1], 0) : 0;
  const long long b0 = (c0 + 127) / 128, b1 = (c1 + 127) / 128;
  long long r = c0 + c1, b = b0 + b1;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {  // inclusive scan within the warp
    const long long rr = __shfl_up_sync(0xffffffffu, r, o);
    const long long bb = __shfl_up_sync(0xffffffffu, b, o);
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
  auto clamp = [](long long v) { return (int)min(v, (long long)INT_MAX); };
  if (2 * t < L) {
    pb[2 * t] = clamp(b - b0 - b1);
    if (pr) pr[2 * t] = r - c0 - c1;
  }
  if (2 * t + 1 < L) {
    pb[2 * t + 1] = clamp(b - b1);
    if (pr) pr[2 * t + 1] = r - c1;
  }
  if (t == NT - 1) {
    pb[L] = clamp(b);
    if (pr) pr[L] = r;
  }
  __syncthreads();
}

// Token counts that do not fit what they index (all NT threads call it, after expert_prefixes): the experts' rows
// past `limit` rows (pr given: the quantiser's bf16 rows) or their 128-padded tokens past `limit` token columns (pr
// null: the wgrad unit's operands). Returns whether they fit (the same answer in every CTA: the totals). CTA 0
// records a negative count (extra 2) or the first expert past the limit (extra 0: rows, 1: columns); the message is
// megatron_mok/kernel/errors.py's (code kErrBadShape, phase kPhaseTokenCounts).
template <int NT>
__device__ __forceinline__ bool check_token_counts(const Params& P, const int* __restrict__ counts, int L,
                                                   const long long* pr, const int* pb, long long limit) {
  auto end = [&](int e) { return pr ? pr[e] : 128LL * pb[e]; };  // where expert e starts; e = L: the total
  if (blockIdx.x == 0 && blockIdx.y == 0) {
    for (int e = threadIdx.x; e < L; e += NT) {
      if (counts[e] < 0)
        record_error(P, kErrBadShape, 0, e, kPhaseTokenCounts, 0, counts[e], 2);
      else if (end(e + 1) > limit && end(e) <= limit)  // the record holds 32-bit fields
        record_error(P, kErrBadShape, 0, e, kPhaseTokenCounts, min(limit, (long long)INT_MAX),
                     min(end(e + 1), (long long)INT_MAX), pr ? 0 : 1);
    }
  }
  return end(L) <= limit;
}

}  // namespace mok
