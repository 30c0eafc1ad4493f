// The FP8 weight block scales a launch reads, checked before its schedule: a NaN, an Inf or a non-positive scale
// (megatron_mok/fp8.py never makes one from finite weights) would turn every product with that block into NaN or
// garbage without an error. One pass over a few thousand floats per expert, by every warp of the grid.
#pragma once
#include "common.cuh"
#include "comm/timeout.cuh"

namespace mok {

// scales[2 g + m] (g < n_experts local experts of this launch, m < 2) points at n[m] contiguous fp32 scales. A bad one
// is recorded as {kErrNonFinite, rank, slot = local expert, kPhaseWeightScales, expected = its index, seen = m}; each
// CTA then leaves at the first of the schedule's grid barriers that still waits for others (comm/timeout.cuh), so
// its peers time out in whichever phase waits for this rank next.
__device__ __forceinline__ void check_weight_scales(const Params& P, const float* const* scales, int n_experts,
                                                    int n0, int n1) {
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  for (int j = gw; j < 2 * n_experts; j += nw) {
    const float* s = scales[j];
    const int n = (j & 1) ? n1 : n0;
    for (int i = lane; i < n; i += 32) {
      const float v = __ldg(s + i);
      if (!(v > 0.0f && v <= 3.402823466e38f))  // false for NaN too
        record_error(P, kErrNonFinite, P.rank0 + (j / 2) / P.L, (j / 2) % P.L, kPhaseWeightScales, i, j & 1,
                     P.rank0 + (j / 2) / P.L);
    }
  }
}

}  // namespace mok
