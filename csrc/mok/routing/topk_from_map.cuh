// Megatron's dense routing (a bool routing_map [T, E] and probs [T, E]) -> the top-k form the kernels read
// (expert ids [T, K] int32, their probabilities [T, K]): one warp per token, one launch for what takes a dozen
// tensor operations on the host's side. Ids in ascending expert order; the slots past a token's routed experts
// hold -1 and probability 0 (capacity drops, padding). A token routed to more than K experts gets the id
// kOverRouted in its last slot: the kernels' schedule and the host checks report it by name (no device assert,
// which would leave the CUDA context unusable).
#pragma once
#include <cuda_bf16.h>
#include <cstdint>

namespace mok {

constexpr int kOverRouted = -2147483647 - 1;  // INT32_MIN: the routing map routes this token to more than K experts (no
                                               // plausible id of a router, so a bad id is never reported as this)

template <class Prob>
__global__ void __launch_bounds__(256) mok_topk_from_map_kernel(const bool* __restrict__ map,
                                                                const Prob* __restrict__ probs, long long T, int E,
                                                                int K, int* __restrict__ idx, Prob* __restrict__ w) {
  const int lane = threadIdx.x & 31;
  const long long t = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= T) return;  // warp-uniform
  const bool* row = map + t * E;
  const Prob* prow = probs + t * E;
  int* irow = idx + t * K;
  Prob* wrow = w + t * K;
  int n = 0;  // routed experts seen so far
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane;
    const bool on = e < E && row[e];
    const unsigned m = __ballot_sync(0xffffffffu, on);
    if (on) {
      const int pos = n + __popc(m & ((1u << lane) - 1u));
      if (pos < K) {
        irow[pos] = e;
        wrow[pos] = prow[e];
      }
    }
    n += __popc(m);
  }
  for (int pos = n + lane; pos < K; pos += 32) {
    irow[pos] = -1;
    wrow[pos] = Prob(0.0f);
  }
  __syncwarp();  // the lane that wrote the last slot's id is ordered before lane 0's mark
  if (n > K && lane == 0) irow[K - 1] = kOverRouted;
}

}  // namespace mok
