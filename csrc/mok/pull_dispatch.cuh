// Pull dispatch (comm SMs of rank q): for each minibatch in order, wait until its ring slot is free,
// copy (pull) the layout rows' x vectors from the source ranks' x buffers into the slot, then publish
// the slot's ready counter. In emulated EP the source pointers come from the per-rank table; with
// real EP they would be NVLink peer pointers (symmetric memory), and the copy is a remote read.
// FP8 kernel (kFp8): the pulled bf16 row is quantised on the way into the slot (fp8_quant.cuh), so
// no separate quantise kernel and no extra HBM round trip.
#pragma once
#include "common.cuh"
#include "fp8_quant.cuh"
#include "ring_buffer.cuh"
#include "timeline.cuh"
#include "timeout.cuh"

namespace mok {

// One warp copies one row with up to 16 x 16 B per lane in flight (8 KB per warp, ~96 KB per SM):
// the copy is latency-bound, so bytes in flight set the per-SM bandwidth.
__device__ __forceinline__ void copy_row_bf16(__nv_bfloat16* __restrict__ dst, const __nv_bfloat16* __restrict__ src,
                                              int H, int lane) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  const int nv = H / 8;
  constexpr int U = 16;
  for (int base = 0; base < nv; base += 32 * U) {
    uint4 buf[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = base + u * 32 + lane;
      if (v < nv) buf[u] = __ldg(s + v);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = base + u * 32 + lane;
      if (v < nv) d[v] = buf[u];
    }
  }
}

// Warps gw, gw + stride, ... of a CTA pull layout rows [a, b) of minibatch i into its ring slot.
template <bool kFp8>
__device__ __forceinline__ void pull_rows(const Params& P, int q, int i, int gw, int stride) {
  const int N = P.expert_off[part(P, q) * (P.L + 1) + P.L];
  const int M = P.minibatch, S = P.ring_slots, H = P.H;
  const int lane = threadIdx.x & 31;
  const int2* layout = P.layout + (long long)part(P, q) * P.layout_cap;
  const int a = i * M, b = min(a + M, N);
  const long long slot_row0 = slot_first_row(P, q, i % S);
  for (int row = a + gw; row < b && !MOK_DBG(8); row += stride) {
    const int2 src = layout[row];
    const __nv_bfloat16* sp = P.ranks[src.x].x + (long long)(src.y / P.K) * H;
    const long long r = slot_row0 + (row - a);
    if constexpr (kFp8)
      quantize_pull_row(reinterpret_cast<uint8_t*>(P.ring) + r * H, P.ring_scale + r * (H / kScaleBlock), sp, H, lane);
    else
      copy_row_bf16(P.ring + r * H, sp, H, lane);
  }
}

// Minibatch 0 is pulled by every CTA of the rank (comm and compute): until it sits in its slot no SM
// has work, so the compute SMs lend their bandwidth for it instead of idling (the comm SMs alone took
// ~150 us for the Kimi slice). Its ready counter therefore counts ctas_per_rank CTAs, not comm_sms.
__device__ __forceinline__ unsigned ready_target(const Params& P, int mb) {
  return (unsigned)(mb == 0 ? P.ctas_per_rank : P.comm_sms);
}

// A compute CTA's share of minibatch 0 (all 384 threads, before its pipeline starts).
template <bool kFp8>
__device__ __forceinline__ void compute_pulls_first_minibatch(const Params& P, int q, int local) {
  const int warp = threadIdx.x >> 5;
  pull_rows<kFp8>(P, q, 0, local * kWarps + warp, P.ctas_per_rank * kWarps);
  fence_proxy_async_global();  // the slot is read next by TMA (async proxy)
  __syncthreads();
  if (threadIdx.x == 0 && !(q == P.stall_rank && 0 == P.stall_slot)) {
    __threadfence();
    red_release_gpu_add(ctr_ready(P, q, 0), 1u);
  }
}

// Returns false if the kernel is aborting.
template <bool kFp8>
__device__ bool dispatch_role(const Params& P, int q, int c, int* s_flag) {
  const int N = P.expert_off[part(P, q) * (P.L + 1) + P.L];
  const int M = P.minibatch, S = P.ring_slots;
  const int nmb = num_minibatches(N, M);
  const int* off = P.expert_off + part(P, q) * (P.L + 1);
  const int warp = threadIdx.x >> 5;
  const int gw = c * kWarps + warp;
  for (int i = 0; i < nmb; ++i) {
    const int s = i % S;
    if (i >= S) {  // wait until minibatch i-S (same slot) has been fully combined
      if (threadIdx.x == 0) {
        const int pa = (i - S) * M;
        const unsigned need = (unsigned)(P.nt2 * count_mtiles(off, P.L, pa, min(pa + M, N)));
        *s_flag = wait_counter_geq(P, ctr_mb_done(P, q, i - S), need, q, s, kPhaseSlotFree) ? 1 : 0;
      }
      __syncthreads();
      if (!*s_flag) return false;
    }
    const unsigned long long t0 = globaltimer_ns();
    // minibatch 0: this CTA's share among all ctas_per_rank CTAs (compute_pulls_first_minibatch)
    pull_rows<kFp8>(P, q, i, gw, (i == 0 ? P.ctas_per_rank : P.comm_sms) * kWarps);
    fence_proxy_async_global();  // the slot is read next by TMA (async proxy)
    __syncthreads();
    if (threadIdx.x == 0) timeline_record(P, kTlDispatch, (unsigned)i, t0, globaltimer_ns());
    if (threadIdx.x == 0 && !(q == P.stall_rank && s == P.stall_slot)) {
      __threadfence();
      red_release_gpu_add(ctr_ready(P, q, i), 1u);
    }
  }
  return true;
}

}  // namespace mok
