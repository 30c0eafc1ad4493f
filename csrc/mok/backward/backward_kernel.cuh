// MoK backward megakernel (BF16 and FP8 dgrad): schedule -> pull reverse-combine (x and w*grad_out rows)
// -> dgrad (stage 1: fc1 recompute + fc2 dgrad + SwiGLU backward -> dH, act; stage 2: dX = dH @ W1)
// -> push reverse-dispatch into the home ranks' grad_buf -> grad_x = sum_k grad_buf, plus the fused
// router-weight gradient, all in ONE persistent cooperative launch
// (host/backward.cu launches it). The expert weight gradients follow
// on the same stream (mok_wgrad_launch: backward/wgrad.cuh, a persistent WGMMA kernel) from the
// layout-order buffers xl / gyl / dh / act and the per-expert row counts that this kernel writes.
//
// Grid: R virtual ranks x ctas_per_rank CTAs (1 CTA/SM, 384 threads), first comm_sms CTAs of each
// rank = comm role (pull, router grad), the rest = compute role (backward/bwd_gemm.cuh); at the end every
// CTA of rank q helps with grad_x of rank q's tokens.
#pragma once
#include "backward/bwd_comm.cuh"
#include "backward/bwd_common.cuh"
#include "backward/bwd_gemm.cuh"
#include "backward/wgrad.cuh"
#include "comm/peer_sync.cuh"
#include "comm/schedule.cuh"
#include "quant/weight_scale_check.cuh"

namespace mok {
namespace bwd {

// Before grad_x of rank q: every rank's dX rows have been pushed (several partitions in one launch: one counter over all
// partitions; per-rank launches: every peer's compute-done signal).
__device__ __forceinline__ bool bwd_wait_all_computed(const BwdParams& P, int q, unsigned all_compute) {
  if (P.base.peer_sync) return wait_peers(P.base, q, kSigDone, kPhasePeerDone);
  return wait_counter_geq(P.base, c_compute_done(P), all_compute, q, -1, kPhaseComputeDone, 2);
}

// kFp8: FP8 dgrad (bwd_gemm.cuh; launched only with saved h).
// kGlu: the SwiGLU variant (clamp / offset, swiglu.cuh) compiled in; the plain instances carry none of it.
template <bool kFp8, bool kGlu>
__global__ void __launch_bounds__(kThreads, 1) mok_backward_kernel(const __grid_constant__ BwdParams P) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ int s_flag;
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const Params& B = P.base;

  const unsigned long long t_entry = B.timeline != nullptr ? globaltimer_ns() : 0ull;
  // ---- per-rank launch: meet every peer (x / idx / w / grad_out published, previous call finished) ----
  if (B.peer_sync) {
    if (blockIdx.x == 0 && threadIdx.x == 0) signal_peers(B, B.rank0, kSigStart);
    if (threadIdx.x == 0) s_flag = wait_peers(B, B.rank0, kSigStart, kPhasePeerStart) ? 1 : 0;
    __syncthreads();
    if (!s_flag) return;
  }
  // ---- FP8 dgrad: W2^T [F/128, H/128] and W1^T [H/128, 2F/128] block scales (after an error each CTA leaves at
  // the first of the schedule's grid barriers that still waits for others: comm/timeout.cuh) ----
  if constexpr (kFp8)
    check_weight_scales(B, B.wscale, B.nparts * B.L, (B.F / kScaleBlock) * (B.H / kScaleBlock),
                        (B.H / kScaleBlock) * (2 * B.F / kScaleBlock));
  // ---- schedule (all CTAs): the forward's layout, recomputed from the routing ----
  static_assert(bwd::bwd_compute_smem_bytes() / 4 >= MOK_MAX_EXPERTS, "schedule_count's per-warp counts need E ints of smem");
  schedule_count(B, reinterpret_cast<int*>(smem), bwd::bwd_compute_smem_bytes() / 4);  // also zeroes grad_buf rows of idx == -1 slots (RankTable.combine = grad_buf)
  if (!grid_barrier(B, 1, &s_flag)) return;
  schedule_scan(B);
  if (!grid_barrier(B, 2, &s_flag)) return;
  schedule_place(B, reinterpret_cast<int*>(smem));
  fence_proxy_async_shared();  // the schedule's smem scratch is the stage ring's TMA destination next
  if (!grid_barrier(B, 3, &s_flag) || cta_aborted(B, &s_flag)) return;  // incl. an owner over capacity
  if (threadIdx.x == 0) timeline_record(B, kTlSchedule, 0, t_entry, globaltimer_ns());

  const int q = B.rank0 + blockIdx.x / B.ctas_per_rank;
  const int local = blockIdx.x % B.ctas_per_rank;
  const int n_comp = B.ctas_per_rank - B.comm_sms;
  const unsigned all_compute = (unsigned)(B.nparts * n_comp);
  if (local < B.comm_sms) {
    if (!bwd_comm_role<kFp8, kGlu>(P, q, local, &s_flag)) return;
    if (threadIdx.x == 0) s_flag = bwd_wait_all_computed(P, q, all_compute) ? 1 : 0;
    __syncthreads();
    if (!s_flag || P.defer_home) return;  // deferred: the wgrad kernel sums grad_x (home_reduce.cuh)
    const unsigned long long t0 = B.timeline != nullptr ? globaltimer_ns() : 0ull;
    bwd_grad_x_reduce(P, q);
    if (B.timeline != nullptr) {
      __syncthreads();
      if (threadIdx.x == 0) timeline_record(B, kTlBwdGradX, 0, t0, globaltimer_ns());
    }
  } else {
    bwd_compute_pulls_first_minibatch<kFp8>(P, q, local);
    if (!bwd_compute_role<kFp8, kGlu>(P, q, smem)) return;  // producer warpgroup leaves here
    int* flag = reinterpret_cast<int*>(smem);
    if (threadIdx.x == 128) *flag = bwd_wait_all_computed(P, q, all_compute) ? 1 : 0;
    named_bar_sync(1, 256);
    if (!*flag || P.defer_home) return;
    const unsigned long long t0 = B.timeline != nullptr ? globaltimer_ns() : 0ull;
    bwd_grad_x_reduce(P, q);
    if (B.timeline != nullptr) {
      named_bar_sync(1, 256);
      if (threadIdx.x == 128) timeline_record(B, kTlBwdGradX, 0, t0, globaltimer_ns());
    }
  }
}

}  // namespace bwd
}  // namespace mok
