// Cross-rank signals of per-rank launches (real EP: one launch per GPU; or several launches sharing
// one GPU in tests). Emulated EP (all ranks in one launch) never calls these: its grid barrier and
// compute-done counter are enough.
//
// Two meeting points per call, both on the ranks' signal pads (torch symmetric memory), written with
// the call's epoch so the pads never need re-zeroing:
//   start: rank r has published x / topk_idx / topk_weight in its symmetric buffers (stream order:
//          the host copies precede the launch) and has finished the previous call -> peers may pull
//          its rows and push into its combine buffer.
//   done : every compute SM of rank r has pushed its expert outputs (to every home rank) -> the home
//          rank may run the top-k weighted sum. It also proves r pulled everything it needed, so a
//          rank whose kernel has ended may overwrite its x (and its source-quantised copy) for the next call.
// and, in the FP8 forward, a third:
//   source-quantised: rank r has written its tokens' e4m3 copy (xq / xs in its symmetric region) -> peers
//          may pull e4m3 rows from it. Signalled after the grid barrier that follows the quantisation pass,
//          waited for only after the schedule, so it normally costs no wait.
#pragma once
#include "common.cuh"
#include "comm/timeout.cuh"

namespace mok {

__device__ __forceinline__ unsigned* signal_slot(const Params& P, int owner, int kind, int src) {
  return P.ranks[owner].signal + kind * MOK_MAX_RANKS + src;
}

// One thread: write this rank's `kind` signal (and, for start, its token count) into every peer's pad.
__device__ __forceinline__ void signal_peers(const Params& P, int self, int kind) {
  __threadfence_system();  // this rank's earlier writes (pushes to peers) before the flag
  for (int r = 0; r < P.R; ++r) {
    if (kind == kSigStart) st_release_sys(signal_slot(P, r, kSigTokens, self), (unsigned)P.ranks[self].T);
    st_release_sys(signal_slot(P, r, kind, self), P.epoch);
  }
}

// One thread, the last compute CTA of a rank: tell every peer that this rank's pushes have landed -- unless this
// launch recorded an error, after which its consumers left their loops and some pushes never happened. The peers'
// compute-done wait then times out naming this rank, so every rank reports instead of summing partial rows.
__device__ __forceinline__ void signal_done(const Params& P, int self) {
  if (!aborted(P)) signal_peers(P, self, kSigDone);
}

// One thread: wait until every peer's `kind` signal reached this call's epoch. On timeout records
// {rank self, phase, expected epoch, seen, extra = the peer that did not arrive}. For start, also
// checks that every peer runs the same token count (the schedule indexes its buffers by it).
static __device__ bool wait_peers(const Params& P, int self, int kind, int phase) {
  const unsigned long long t0 = globaltimer_ns();
  const unsigned long long limit = P.timeout_ns;
  for (int r = 0; r < P.R; ++r) {
    const unsigned* f = signal_slot(P, self, kind, r);
    unsigned spins = 0;
    unsigned v;
    // signed distance: epochs are monotonic and may wrap
    while ((int)((v = ld_acquire_sys(f)) - P.epoch) < 0) {
      if (aborted(P)) return false;
      if (globaltimer_ns() - t0 > limit) {
        record_error(P, kErrTimeout, self, -1, phase, P.epoch, v, r);
        return false;
      }
      if (++spins > 16) __nanosleep(256);
    }
    if (kind == kSigStart) {
      const int t = (int)ld_acquire_sys(signal_slot(P, self, kSigTokens, r));
      if (t != P.ranks[r].T) {
        record_error(P, kErrBadShape, self, -1, kPhasePeerShape, P.ranks[r].T, t, r);
        return false;
      }
    }
  }
  return true;
}

// Per-rank FP8 launch, every CTA before its first pull: every peer's e4m3
// copy is written (its source-quantised signal). Thread 0 waits, the CTA follows; false on a timeout (recorded,
// naming the peer) or an abort.
__device__ __forceinline__ bool peers_quantised(const Params& P, int* s_flag) {
  __syncthreads();  // every thread has read the CTA's previous verdict
  if (threadIdx.x == 0) *s_flag = wait_peers(P, P.rank0, kSigSrcQuant, kPhasePeerSrcQuant) ? 1 : 0;
  __syncthreads();
  return *s_flag != 0;
}

}  // namespace mok
