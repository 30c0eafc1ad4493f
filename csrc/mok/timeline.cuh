// Optional in-kernel timeline: per-CTA intervals (globaltimer ns) of what each SM was doing, so users
// can see the overlap of dispatch, expert GEMMs and combine (tools/timeline.py renders them).
// Off unless the launcher passes a buffer (P.timeline == nullptr: one predictable branch per event).
#pragma once
#include "common.cuh"

namespace mok {

enum TimelineKind : unsigned {
  kTlSchedule = 0,  // kernel entry -> schedule done (incl. the peer start wait of per-rank launches and, in the
                    // FP8 forward, the source quantisation pass)
  kTlDispatch = 1,  // pull dispatch of one minibatch into its ring slot (aux = minibatch)
  kTlFc1 = 2,       // one fc1 + SwiGLU tile (aux = minibatch)
  kTlFc2 = 3,       // one fc2 tile incl. its push-combine stores (aux = minibatch)
  kTlCombine = 4,   // final top-k weighted sum (after every rank's pushes landed)
  // backward kernel (host/backward.cu)
  kTlBwdPull = 5,      // pull reverse-combine of one minibatch: x and w * grad_out rows (aux = minibatch)
  kTlBwdStage1 = 6,    // stage-1 tile main loops (dA = gy W2 [+ fc1 recompute]) (aux = minibatch)
  kTlBwdStage1Epi = 7, // its SwiGLU-backward epilogue: act and dH stores
  kTlBwdStage2 = 8,    // stage-2 tile main loop (dX = dH W1) (aux = minibatch)
  kTlBwdPush = 9,      // its push reverse-dispatch stores into the home rank's grad_buf
  kTlBwdBackground = 10,  // comm SMs' share after a pull: router-weight grad (+ act rows when h was saved)
  kTlBwdGradX = 11,    // grad_x = sum_k grad_buf (after every rank's pushes landed)
};

// One event; the host reads them as int64[3]: {(kind | smid << 8 | aux << 16) | mma_ns << 32, t0, t1}.
// mma_ns: for a GEMM tile, ns from t0 to the end of its MMAs (the rest, to t1, is its epilogue); else 0.
struct TimelineEvent {
  unsigned tag;
  unsigned mma_ns;
  unsigned long long t0, t1;
};

__device__ __forceinline__ unsigned smid() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

__device__ __forceinline__ void timeline_record(const Params& P, unsigned kind, unsigned aux,
                                                unsigned long long t0, unsigned long long t1,
                                                unsigned long long t_mma = 0) {
  if (P.timeline == nullptr) return;
  const unsigned i = atomicAdd(P.timeline_count + blockIdx.x, 1u);
  if (i >= (unsigned)P.timeline_cap) return;  // full: later events of this CTA are dropped (count tells)
  TimelineEvent ev;
  ev.tag = kind | (smid() << 8) | (min(aux, 0xFFFFu) << 16);
  ev.mma_ns = t_mma > t0 ? (unsigned)min(t_mma - t0, 0xFFFFFFFFull) : 0u;
  ev.t0 = t0;
  ev.t1 = t1;
  P.timeline[(long long)blockIdx.x * P.timeline_cap + i] = ev;
}

}  // namespace mok
