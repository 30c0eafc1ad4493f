// MoK forward megakernel (BF16, or FP8 e4m3 with block scales): schedule -> pull dispatch -> expert FFN (fc1, SwiGLU,
// fc2) -> push combine -> top-k weighted sum, all in ONE persistent cooperative kernel launch (host/forward.cu
// launches it).
//
// Grid: P partitions x ctas_per_rank CTAs (1 CTA per SM, 384 threads), one partition per rank run
// by this launch. In each partition the first comm_sms CTAs do pull dispatch (and the final weighted
// sum), the rest run the warp-specialized WGMMA expert FFN; comm_sms = 0 runs the FFN on every CTA and the
// pull on spare warps of their producer warpgroups (comm/pull_dispatch.cuh). Ranks only see each other through
// the per-rank table, so the same device code serves
//   * all R ranks in one launch on one GPU (P = R; the device code allows it, nothing launches it), and
//   * per-rank launches: real EP, one launch per GPU with symmetric-memory peer pointers (P = 1);
//     ranks meet at start / compute-done (FP8: also source-quantised) on their signal pads (comm/peer_sync.cuh).
#pragma once
#include "comm/peer_sync.cuh"
#include "comm/pull_dispatch.cuh"
#include "comm/push_combine.cuh"
#include "comm/ring_buffer.cuh"
#include "comm/schedule.cuh"
#include "comm/timeout.cuh"
#include "common.cuh"
#include "quant/weight_scale_check.cuh"
#include "forward/expert_ffn.cuh"
#include "timeline.cuh"

namespace mok {

// Before the final weighted sum of rank q: every rank's expert outputs have been pushed.
__device__ __forceinline__ bool wait_all_computed(const Params& P, int q, int n_comp) {
  if (P.peer_sync) return wait_peers(P, q, kSigDone, kPhasePeerDone);
  return wait_counter_geq(P, ctr_compute_done(P), (unsigned)(P.R * n_comp), q, -1, kPhaseComputeDone, 2);
}

// kFp8: e4m3 operands with 1 x 128 / 128 x 128 block scales (kernel.dtype fp8): the pull quantises x
// into the ring slot, the fc1 epilogue quantises the SwiGLU output; everything else is shared.
template <bool kFp8, int kFeat>
__global__ void __launch_bounds__(kThreads, 1) mok_forward_kernel(const __grid_constant__ Params P) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ int s_flag;
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const unsigned long long t_entry = globaltimer_ns();

  // ---- per-rank launch: meet every peer (their inputs are published, previous call finished) ----
  if (P.peer_sync) {
    if (blockIdx.x == 0 && threadIdx.x == 0) signal_peers(P, P.rank0, kSigStart);
    if (threadIdx.x == 0) s_flag = wait_peers(P, P.rank0, kSigStart, kPhasePeerStart) ? 1 : 0;
    __syncthreads();
    if (!s_flag) return;
  }

  // ---- FP8: this launch's tokens quantised once, at their source (pull_dispatch.cuh) ----
  constexpr bool kSrcQuant = kFp8;
  if constexpr (kSrcQuant) quantize_sources<8>(P);  // ordered before every pull by grid barrier 1 (and the signal)
  // w1 [2F/128, H/128] and w2 [H/128, F/128] block scales of this launch's experts (after an error each CTA leaves
  // at the first of the schedule's grid barriers that still waits for others: comm/timeout.cuh)
  if constexpr (kFp8)
    check_weight_scales(P, P.wscale, P.nparts * P.L, (2 * P.F / kScaleBlock) * (P.H / kScaleBlock),
                        (P.H / kScaleBlock) * (P.F / kScaleBlock));

  // ---- schedule (all CTAs) ----
  static_assert(compute_smem_bytes() / 4 >= MOK_MAX_EXPERTS, "schedule_count's per-warp counts need E ints of smem");
  schedule_count(P, reinterpret_cast<int*>(smem), compute_smem_bytes() / 4);
  if (!grid_barrier(P, 1, &s_flag)) return;
  // per-rank launch: every CTA's copy is written; peers wait for this only before their first pull
  if (kSrcQuant && P.peer_sync && blockIdx.x == 0 && threadIdx.x == 0) signal_peers(P, P.rank0, kSigSrcQuant);
  schedule_scan(P);
  if (!grid_barrier(P, 2, &s_flag)) return;
  schedule_place(P, reinterpret_cast<int*>(smem));
  fence_proxy_async_shared();  // the schedule's smem scratch is the stage ring's TMA destination next
  bool go = grid_barrier(P, 3, &s_flag) && !cta_aborted(P, &s_flag);  // incl. an owner over capacity
  if (kSrcQuant && P.peer_sync && go) go = peers_quantised(P, &s_flag);  // every peer's e4m3 copy is written
  if (!go) return;
  if (threadIdx.x == 0) timeline_record(P, kTlSchedule, 0, t_entry, globaltimer_ns());

  // ---- SM roles ----
  const int q = P.rank0 + blockIdx.x / P.ctas_per_rank;
  const int local = blockIdx.x % P.ctas_per_rank;
  const int n_comp = P.ctas_per_rank - P.comm_sms;
  const int warp = threadIdx.x >> 5;
  const int nworkers = P.comm_sms * kWarps + n_comp * 8;
  if (local < P.comm_sms) {
    if (!dispatch_role<kFp8>(P, q, local, &s_flag)) return;
    if (threadIdx.x == 0) s_flag = wait_all_computed(P, q, n_comp) ? 1 : 0;
    __syncthreads();
    if (!s_flag) return;
    const unsigned long long t0 = globaltimer_ns();
    if (!MOK_DBG(1)) combine_reduce<2>(P, q, local * kWarps + warp, nworkers);
    if (P.timeline) {
      __syncthreads();
      if (threadIdx.x == 0) timeline_record(P, kTlCombine, 0, t0, globaltimer_ns());
    }
  } else {
    compute_pulls_first_minibatch<kFp8>(P, q, local);  // every SM helps with the first slot
    if (!compute_role<kFp8, kFeat>(P, q, smem)) return;  // producer warpgroup leaves here
    // consumer warpgroups (256 threads) join the final weighted sum
    int* flag = reinterpret_cast<int*>(smem);  // pipeline smem is no longer used
    if (threadIdx.x == 128) *flag = wait_all_computed(P, q, n_comp) ? 1 : 0;
    named_bar_sync(1, 256);
    if (!*flag) return;
    const unsigned long long t0 = globaltimer_ns();
    if (!MOK_DBG(1)) combine_reduce<4>(P, q, P.comm_sms * kWarps + (local - P.comm_sms) * 8 + (warp - 4), nworkers);
    if (P.timeline) {
      named_bar_sync(1, 256);
      if (threadIdx.x == 128) timeline_record(P, kTlCombine, 0, t0, globaltimer_ns());
    }
  }
}

}  // namespace mok
