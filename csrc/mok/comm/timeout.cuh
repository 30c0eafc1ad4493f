// Timeouts and error reporting. Every spin-wait in the megakernel goes through these helpers:
// on timeout the first waiter records {code, rank, slot, phase, expected, seen} into P.err and all
// other waiters see err[0] != 0 and leave their loops, so the whole kernel exits (no hang, no trap).
#pragma once
#include "common.cuh"

namespace mok {

__device__ __forceinline__ bool aborted(const Params& P) { return ld_volatile_int(P.err) != 0; }

__device__ __forceinline__ void record_error(const Params& P, int code, int rank, int slot, int phase,
                                          long long expected, long long seen, int extra) {
  if (atomicCAS(P.err, 0, code) == 0) {
    P.err[1] = rank;
    P.err[2] = slot;
    P.err[3] = phase;
    P.err[4] = (int)expected;
    P.err[5] = (int)seen;
    P.err[6] = extra;
    P.err[7] = (int)blockIdx.x;
    __threadfence();
  }
}

// A token row (x, or grad_out: `phase`) read by a warp holds a NaN / Inf: recorded once (the first report wins),
// naming the token's home rank and row and the rank that read it; the launch then winds down like after a timeout
// and the host raises.
__device__ __forceinline__ void report_nonfinite_row(const Params& P, int phase, int home, int token, int reader,
                                                     int lane) {
  if (lane == 0) record_error(P, kErrNonFinite, home, token, phase, 0, 0, reader);
}

// Wait until *ctr >= target (acquire). Returns false on timeout or abort (error recorded/already set).
// `slack` multiplies the timeout for secondary waiters so that the primary waiter reports first.
__device__ __forceinline__ bool wait_counter_geq(const Params& P, const unsigned* ctr, unsigned target,
                                              int rank, int slot, int phase, int slack = 1) {
  unsigned v = ld_acquire_gpu(ctr);
  if (v >= target) return true;
  const unsigned long long t0 = globaltimer_ns();
  const unsigned long long limit = P.timeout_ns * (unsigned long long)slack;
  unsigned spins = 0;
  while (true) {
    v = ld_acquire_gpu(ctr);
    if (v >= target) return true;
    if (aborted(P)) return false;
    if (globaltimer_ns() - t0 > limit) {
      record_error(P, kErrTimeout, rank, slot, phase, target, v, 0);
      return false;
    }
    if (++spins > 16) __nanosleep(128);
  }
}

// mbarrier parity wait with timeout (smem pipeline inside one CTA).
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t phase) {
  uint32_t addr = (uint32_t)__cvta_generic_to_shared(bar);
  uint32_t ok;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.b32 %0, 1, 0, p;\n\t}"
      : "=r"(ok)
      : "r"(addr), "r"(phase)
      : "memory");
  return ok != 0;
}

// Out of line on purpose: a __trap() inlined into a warpgroup's code makes ptxas ignore that warpgroup's
// setmaxnreg budget (the forward consumers stayed at the launch bound's 168 registers and spilled in the
// K loop; with the trap behind a call they get up to 224). Only the fatal timeout path calls it.
static __device__ __noinline__ void fatal_trap() { __trap(); }

// The bug guard of the internal barrier waits: spins until try_wait() holds; past slack * timeout + 1 s it
// records kErrInternal (rank, barrier phase, `what`) and returns false. No call on any path: the caller
// decides where to trap.
template <class TryWait>
__device__ __forceinline__ bool spin_or_record(const Params& P, TryWait try_wait, unsigned long long slack,
                                               uint32_t phase, int rank, int what) {
  const unsigned long long t0 = globaltimer_ns();
  const unsigned long long limit = P.timeout_ns * slack + 1000000000ull;
  while (!try_wait()) {
    if (globaltimer_ns() - t0 > limit) {
      record_error(P, kErrInternal, rank, -1, kPhasePipeline, phase, what, 0);
      __threadfence_system();
      return false;
    }
  }
  return true;
}

// Internal pipeline waits (producer <-> consumers of one CTA) never depend on other SMs directly:
// on an abort the producer still publishes an "exit" tile, so these waits always complete unless
// there is a bug. After slack * timeout they record kErrInternal and trap (context is lost).
__device__ __forceinline__ void mbar_wait_slow(const Params& P, uint64_t* bar, uint32_t phase, int rank, int what) {
  if (!spin_or_record(P, [&] { return mbar_try_wait(bar, phase); }, 4, phase, rank, what)) fatal_trap();
}

__device__ __forceinline__ void mbar_wait(const Params& P, uint64_t* bar, uint32_t phase, int rank, int what) {
  if (mbar_try_wait(bar, phase)) return;
  mbar_wait_slow(P, bar, phase, rank, what);
}

// Grid-wide barrier (all CTAs co-resident: cooperative launch). Monotonic counter, n-th use.
__device__ __forceinline__ bool grid_barrier(const Params& P, int nth, int* s_flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(ctr_grid_barrier(P), 1u);
    bool ok = wait_counter_geq(P, ctr_grid_barrier(P), (unsigned)nth * gridDim.x, -1, -1, kPhaseGridBarrier);
    *s_flag = ok ? 1 : 0;
  }
  __syncthreads();
  return *s_flag != 0;
}

// One verdict per CTA (thread 0 reads the error record, everyone follows), so a CTA never half-exits.
__device__ __forceinline__ bool cta_aborted(const Params& P, int* s_flag) {
  __syncthreads();
  if (threadIdx.x == 0) *s_flag = aborted(P) ? 1 : 0;
  __syncthreads();
  return *s_flag != 0;
}

}  // namespace mok
