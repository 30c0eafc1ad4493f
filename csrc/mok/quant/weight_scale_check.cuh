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
// The lists are cut into 32-scale chunks spread over every warp of the grid (a Kimi-K2 slice's 8 experts make ~670
// chunks for ~1,600 warps), so a lane issues one load or a few independent ones instead of a walk of dependent
// load-compare-branch steps before the first grid barrier.
__device__ __forceinline__ void check_weight_scales(const Params& P, const float* const* scales, int n_experts,
                                                    int n0, int n1) {
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  const int chunks0 = (n0 + 31) / 32, per_expert = chunks0 + (n1 + 31) / 32;
  const int total = n_experts * per_expert;
  for (int c = gw; c < total; c += nw) {
    const int g = c / per_expert, r = c - g * per_expert;
    const int m = r >= chunks0 ? 1 : 0;
    const int i = (r - m * chunks0) * 32 + lane;
    if (i < (m ? n1 : n0)) {
      const float v = __ldg(scales[2 * g + m] + i);
      if (!(v > 0.0f && v <= 3.402823466e38f))  // false for NaN too
        record_error(P, kErrNonFinite, P.rank0 + g / P.L, g % P.L, kPhaseWeightScales, i, m, P.rank0 + g / P.L);
    }
  }
}

}  // namespace mok
