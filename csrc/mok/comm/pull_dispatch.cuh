// Pull dispatch (comm SMs of rank q): for each minibatch in order, wait until its ring slot is free,
// copy (pull) the layout rows' x vectors from the source ranks' x buffers into the slot, then publish
// the slot's ready counter. When several rank partitions share a launch the source pointers come from the per-rank table; with
// real EP they would be NVLink peer pointers (symmetric memory), and the copy is a remote read.
// FP8 kernel (kFp8): each token is quantised once, at its source, in the kernel's first phase
// (quantize_sources), and the pull copies e4m3 rows: half the bytes of the bf16 rows, one quantisation per token
// instead of one per routed copy, and in real EP half the NVLink bytes of the dispatch (as DeepEP's FP8
// dispatch). The same 1 x 128 blocks of the same rows as quantising each copy: the same bits.
//
// Two placements of the pull (kernel.comm_sms):
//   comm_sms > 0  dedicated comm SMs pull every minibatch (dispatch_role) and then join the final sum;
//   comm_sms == 0 in-SM pull: no SM is set aside. Warps 1-3 of every compute CTA's producer warpgroup
//                 (only thread 0 of warp 0 issues the TMA loads, the other warps had nothing to do) pull
//                 minibatches 1.. beside the GEMM pipeline (insm_pull_role), so all SMs run GEMM tiles.
// Either way minibatch 0 is pulled by every thread of every CTA of the rank first.
#pragma once
#include "common.cuh"
#include "quant/fp8_quant.cuh"
#include "comm/ring_buffer.cuh"
#include "timeline.cuh"
#include "comm/timeout.cuh"

namespace mok {

// One warp copies nv 16-byte vectors with up to U per lane in flight (U = 16: 8 KB per warp, ~96 KB per comm
// SM): the copy is latency-bound, so bytes in flight set the per-SM bandwidth. The in-SM pull warps run
// with the producer warpgroup's 56 registers, hence their smaller U. load(p) reads one vector. kCheckBf16: the
// vectors are bf16; returns nonzero (this lane's) if one of them held a NaN / Inf (common.cuh: bf16x8_nonfinite).
template <int U, bool kCheckBf16 = false, class Load>
__device__ __forceinline__ uint32_t copy_vectors(uint4* __restrict__ d, const uint4* __restrict__ s, int nv, int lane,
                                                 Load load) {
  uint32_t bad = 0;
  for (int base = 0; base < nv; base += 32 * U) {
    uint4 buf[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = base + u * 32 + lane;
      if (v < nv) buf[u] = load(s + v);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = base + u * 32 + lane;
      if (v < nv) {
        d[v] = buf[u];
        if constexpr (kCheckBf16) bad |= bf16x8_nonfinite(buf[u]);
      }
    }
  }
  return bad;
}

// One bf16 row (the caller's input x: read through the read-only path); true (on every lane) if it holds a NaN or
// an Inf.
template <int U>
__device__ __forceinline__ bool copy_row_bf16(__nv_bfloat16* __restrict__ dst, const __nv_bfloat16* __restrict__ src,
                                              int H, int lane) {
  const uint32_t bad = copy_vectors<U, true>(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), H / 8,
                                             lane, [](const uint4* p) { return __ldg(p); });
  return __any_sync(0xffffffffu, bad != 0);
}

// Bytes in flight per lane of a pulling warp: comm SMs / minibatch 0 (whole register file) and the in-SM
// pull warps (56 registers: the fp8 quantiser needs more of them per 16-byte load than the copy).
constexpr int kPullUnroll = 16;
template <bool kFp8>
constexpr int kInSmPullUnroll = kFp8 ? 2 : 4;
constexpr int kInSmPullWarps = 3;      // warps 1-3 of the producer warpgroup
constexpr int kInSmPullBarrier = 4;    // their named barrier (1: consumers, 2-3: one consumer warpgroup)

// One source-quantised e4m3 row (H bytes) and its H / 128 scales, read through L2
// (ld.cg): quantize_sources wrote them in this call (this launch, or a peer rank's launch), so no L1 line of
// them may be trusted. Scale j goes to dst_scale[j * scale_step] (common.cuh: fp8_scale_step).
template <int U>
__device__ __forceinline__ void copy_row_e4m3(uint8_t* __restrict__ dst, float* __restrict__ dst_scale,
                                              const uint8_t* __restrict__ src, const float* __restrict__ src_scale,
                                              int H, int lane, long long scale_step) {
  copy_vectors<U>(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), H / 16, lane,
                  [](const uint4* p) { return __ldcg(p); });
  for (int j = lane; j < H / kScaleBlock; j += 32) dst_scale[j * scale_step] = __ldcg(src_scale + j);
}

// Every token of the ranks in this launch quantised once into its rank's copy P.xq[q] / P.xs[q] (all warps of
// all CTAs, first thing after the start meet; grid barrier 1 orders these writes before this launch's pulls,
// and a per-rank launch signals its peers after that barrier: peers_quantised).
template <int U>
__device__ __forceinline__ void quantize_sources(const Params& P) {
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  const int H = P.H;
  for (int q = P.rank0; q < P.rank0 + P.nparts; ++q) {
    const RankTable& rt = P.ranks[q];
    uint8_t* const xq = P.xq[q];
    float* const xs = P.xs[q];
    for (int t = gw; t < rt.T; t += nw)
      if (quantize_pull_row<U>(xq + (long long)t * H, xs + (long long)t * (H / kScaleBlock), rt.x + (long long)t * H, H,
                               lane))
        report_nonfinite_row(P, kPhaseInputCheck, q, t, q, lane);
  }
}

// Warps gw, gw + stride, ... of a CTA pull layout rows [a, b) of minibatch i into its ring slot.
template <bool kFp8, int U = kPullUnroll>
__device__ __forceinline__ void pull_rows(const Params& P, int q, int i, int gw, int stride) {
  const int* off = expert_offsets(P, q);
  const int H = P.H;
  const int lane = threadIdx.x & 31;
  const int2* layout = P.layout + (long long)part(P, q) * P.layout_cap;
  const int a = mb_begin(off, P.L, P.minibatch, i), b = mb_begin(off, P.L, P.minibatch, i + 1);
  for (int row = a + gw; row < b && !MOK_DBG(8); row += stride) {
    const int2 src = layout[row];
    const long long r = slot_row(P, q, i, a, row, row);
    if constexpr (kFp8) {
      const long long t = src.y / P.K;  // the token's row of its rank's source-quantised copy (quantize_sources)
      copy_row_e4m3<U>(reinterpret_cast<uint8_t*>(P.ring) + r * H, P.ring_scale + fp8_scale_at(P, r, 0, H / kScaleBlock),
                       P.xq[src.x] + t * H, P.xs[src.x] + t * (H / kScaleBlock), H, lane, fp8_scale_step(P));
    } else {
      const int t = src.y / P.K;
      if (copy_row_bf16<U>(P.ring + r * H, P.ranks[src.x].x + (long long)t * H, H, lane))
        report_nonfinite_row(P, kPhaseInputCheck, src.x, t, q, lane);
    }
  }
}

// Minibatch 0 is pulled by every CTA of the rank (comm and compute): until it sits in its slot no SM
// has work, so the compute SMs lend their bandwidth for it instead of idling (the comm SMs alone took
// ~150 us for the Kimi slice). Its ready counter therefore counts ctas_per_rank CTAs, not comm_sms; with
// the in-SM pull (comm_sms == 0) every minibatch is pulled by all ctas_per_rank CTAs.
__device__ __forceinline__ unsigned ready_target(const Params& P, int mb) {
  return (unsigned)(mb == 0 || P.comm_sms == 0 ? P.ctas_per_rank : P.comm_sms);
}

// Before pulling minibatch i into slot i % S: minibatch i - S (same slot) has been fully combined.
__device__ __forceinline__ bool wait_slot_free(const Params& P, int q, int i) {
  const int S = P.ring_slots;
  if (i < S) return true;
  return wait_mb_done(P, q, i - S, kPhaseSlotFree);
}

// Publish minibatch i's share of this CTA (the caller fenced its writes and synchronised its warps).
__device__ __forceinline__ void publish_pulled(const Params& P, int q, int i) {
  if (q == P.stall_rank && i % P.ring_slots == P.stall_slot) return;  // test hook: a stalled slot
  __threadfence();
  red_release_gpu_add(ctr_ready(P, q, i), 1u);
}

// A compute CTA's share of minibatch 0 (all 384 threads, before its pipeline starts).
template <bool kFp8>
__device__ __forceinline__ void compute_pulls_first_minibatch(const Params& P, int q, int local) {
  const int warp = threadIdx.x >> 5;
  pull_rows<kFp8>(P, q, 0, local * kWarps + warp, P.ctas_per_rank * kWarps);
  fence_proxy_async_global();  // the slot is read next by TMA (async proxy)
  __syncthreads();
  if (threadIdx.x == 0) publish_pulled(P, q, 0);
}

// Returns false if the kernel is aborting.
template <bool kFp8>
__device__ bool dispatch_role(const Params& P, int q, int c, int* s_flag) {
  const int N = P.expert_off[part(P, q) * (P.L + 1) + P.L];  // rows of the owner
  const int nmb = num_minibatches(N, P.minibatch);
  const int warp = threadIdx.x >> 5;
  const int gw = c * kWarps + warp;
  for (int i = 0; i < nmb; ++i) {
    if (i >= P.ring_slots) {
      if (threadIdx.x == 0) *s_flag = wait_slot_free(P, q, i) ? 1 : 0;
      __syncthreads();
      if (!*s_flag) return false;
    }
    const unsigned long long t0 = globaltimer_ns();
    // minibatch 0: this CTA's share among all ctas_per_rank CTAs (compute_pulls_first_minibatch)
    pull_rows<kFp8>(P, q, i, gw, (i == 0 ? P.ctas_per_rank : P.comm_sms) * kWarps);
    fence_proxy_async_global();  // the slot is read next by TMA (async proxy)
    __syncthreads();
    if (threadIdx.x == 0) {
      timeline_record(P, kTlDispatch, (unsigned)i, t0, globaltimer_ns());
      publish_pulled(P, q, i);
    }
  }
  return true;
}

// In-SM pull (comm_sms == 0): warps 1-3 of a compute CTA's producer warpgroup pull the CTA's share of
// minibatches 1.. (minibatch 0 was pulled by the whole CTA before the pipeline started). They wait for
// a slot to be combined like the comm SMs do; the GEMM pipeline of the same CTA never waits for them
// except through the ready counters, which earlier tickets' tiles fill, so there is no cycle.
// s_flag: one int of smem the three warps share. The CTA's index is recomputed here, not passed down:
// a value kept live across the consumers' code costs them a spilled register.
template <bool kFp8>
__device__ void insm_pull_role(const Params& P, int q, int* s_flag) {
  const int local = (int)(blockIdx.x % (unsigned)P.ctas_per_rank);
  const int N = P.expert_off[part(P, q) * (P.L + 1) + P.L];
  const int nmb = num_minibatches(N, P.minibatch);
  const int w = (threadIdx.x >> 5) - 1;  // 0 .. kInSmPullWarps - 1
  const bool leader = threadIdx.x == 32;
  constexpr int kThreadsPulling = kInSmPullWarps * 32;
  for (int i = 1; i < nmb; ++i) {
    if (i >= P.ring_slots) {
      if (leader) *s_flag = wait_slot_free(P, q, i) ? 1 : 0;
      named_bar_sync(kInSmPullBarrier, kThreadsPulling);
      if (!*s_flag) return;
    }
    const unsigned long long t0 = globaltimer_ns();
    pull_rows<kFp8, kInSmPullUnroll<kFp8>>(P, q, i, local * kInSmPullWarps + w, P.ctas_per_rank * kInSmPullWarps);
    fence_proxy_async_global();  // the slot is read next by TMA (async proxy)
    named_bar_sync(kInSmPullBarrier, kThreadsPulling);
    if (leader) {
      timeline_record(P, kTlDispatch, (unsigned)i, t0, globaltimer_ns());
      publish_pulled(P, q, i);
    }
  }
}

}  // namespace mok
