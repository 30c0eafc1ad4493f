// Home-side reductions of the MoK backward, one warp per item, used by two kernels:
//   router-weight gradient  grad_w[t, k] = <grad_out[t], combine[t, k]> (fp32; 0 for idx == -1 slots)
//   top-k input-gradient sum grad_x[t] = bf16(sum_k grad_buf[t, k]) in fp32, k ascending, idx == -1
//                            slots skipped (the same bits whichever kernel or unroll computes it)
// The dgrad kernel runs them on its comm SMs (router grad between pulls) and, at its end, on every SM
// (grad_x). When the wgrad kernel follows on the same stream, it runs both instead on its producer
// warpgroup's three idle warps, beside its own WGMMAs: the reductions are memory-bound and the wgrad
// tiles compute-bound, so they come almost for free there, and the dgrad kernel loses its grad_x tail.
#pragma once
#include "backward/bwd_common.cuh"

namespace mok {
namespace bwd {

// One home rank's inputs and outputs of the two reductions (device pointers).
struct HomeRank {
  const __nv_bfloat16* grad_out;  // [T, H]
  const __nv_bfloat16* combine;   // [T, K, H] forward expert outputs
  const __nv_bfloat16* grad_buf;  // [T, K, H] pushed dX rows (complete: after the dgrad's pushes landed)
  const int* idx;                 // [T, K]
  float* grad_w;                  // [T, K]
  __nv_bfloat16* grad_x;          // [T, H]
  int T;
};

// grad_w[e] of entry e = (t, k) of home rank h (one warp; every lane gets the sum).
__device__ __forceinline__ void router_grad_entry(const HomeRank& h, long long e, int K, int H, int lane) {
  const long long t = e / K;
  const uint4* go = reinterpret_cast<const uint4*>(h.grad_out + t * H);
  const uint4* cb = reinterpret_cast<const uint4*>(h.combine + e * H);
  float acc = 0.f;
  if (h.idx[e] >= 0) {
    for (int v = lane; v < H / 8; v += 32) {
      const uint4 a = __ldg(go + v), b = __ldg(cb + v);
      const __nv_bfloat162* pa = reinterpret_cast<const __nv_bfloat162*>(&a);
      const __nv_bfloat162* pb = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 fa = __bfloat1622float2(pa[i]), fb = __bfloat1622float2(pb[i]);
        acc = fmaf(fa.x, fb.x, acc);
        acc = fmaf(fa.y, fb.y, acc);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  }
  if (lane == 0) h.grad_w[e] = acc;
}

// grad_x[t] of home rank h (one warp). U: grad_buf rows in flight per lane (register budget: the
// wgrad kernel's producer warps have 56 registers).
template <int U>
__device__ __forceinline__ void grad_x_token(const HomeRank& h, int t, int K, int H, int lane) {
  const int* idx = h.idx + (long long)t * K;
  const uint4* gb = reinterpret_cast<const uint4*>(h.grad_buf + (long long)t * K * H);
  uint4* out = reinterpret_cast<uint4*>(h.grad_x + (long long)t * H);
  for (int v = lane; v < H / 8; v += 32) {
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;
    for (int k0 = 0; k0 < K; k0 += U) {
      uint4 d[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = k0 + u;
        d[u] = (k < K && idx[k] >= 0) ? gb[(long long)k * (H / 8) + v] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {  // k ascending; skipped slots add +0 (exact)
        const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&d[u]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __bfloat1622float2(p[i]);
          acc[2 * i] += f.x;
          acc[2 * i + 1] += f.y;
        }
      }
    }
    uint4 o;
    uint32_t* po = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i) po[i] = pack2(acc[2 * i], acc[2 * i + 1]);
    out[v] = o;
  }
}

// Next item of a job from its cursor (one atomic per warp), or >= n when the job is done.
__device__ __forceinline__ long long next_item(unsigned* cursor, int lane) {
  unsigned i = 0;
  if (lane == 0) i = atomicAdd(cursor, 1u);
  return (long long)__shfl_sync(0xffffffffu, i, 0);
}

}  // namespace bwd
}  // namespace mok
