// A counter release held back by one consumer thread until its warpgroup's next tile has MMAs in
// flight (forward fc2 push: mb_done; backward stage-2 push: mb_done).
//
// The release's fence waits until the tile's pushed rows (64 KB per 128 x 256 tile) have landed.
// Released right after the stores, the whole tile's epilogue waits for that; held until the next
// tile's first WGMMA group is issued, the stores drain while the tensor cores already work.
// Deadlock rule: a held release is flushed before the consumer blocks on the next tile's info (that
// tile may wait, through a ring slot, on this very counter) and when the consumer leaves.
#pragma once
#include "common.cuh"
#include "gemm_sm90.cuh"
#include "ring_buffer.cuh"

namespace mok {

// Whether the next tile's info is there, or arrives within spin_ns (forward: P.flush_spin_ns). The release's
// fence waits for the pushed rows to land (~1-2 us); taken as soon as the info is late, it held the consumer
// on after the info had come. A short spin first keeps it off that path when the info is only a little late
// (the deadlock rule holds: past the spin the release is flushed before the consumer blocks).
__device__ __forceinline__ bool info_within(uint64_t* info_full, uint32_t phase, unsigned spin_ns) {
  if (Barrier::test_wait(info_full, phase, 1u)) return true;
  if (spin_ns == 0) return false;
  const unsigned long long t0 = globaltimer_ns();
  while (globaltimer_ns() - t0 < spin_ns)
    if (Barrier::test_wait(info_full, phase, 1u)) return true;
  return false;
}

struct DeferredRelease {
  unsigned* ctr = nullptr;
  __device__ __forceinline__ void flush() {
    if (ctr != nullptr) {
      __threadfence();
      red_release_gpu_add(ctr, 1u);
      ctr = nullptr;
    }
  }
  __device__ __forceinline__ void hold(unsigned* c) {
    flush();
    ctr = c;
  }
  // before waiting for the next tile's info: flush unless that info is already there
  __device__ __forceinline__ void before_wait(uint64_t* info_full, uint32_t phase, unsigned spin_ns = 0) {
    if (ctr != nullptr && !info_within(info_full, phase, spin_ns)) flush();
  }
};

// The same for an fc1 tile's fc1_done, held by a whole consumer warpgroup (all 128 threads call every
// member): its activation rows are read next by TMA, so each writing thread must order its own stores
// before the async proxy (fence.proxy.async) before one thread releases. Those fences wait for the
// stores to land (~the tile's whole fc1 epilogue again); held, they run while the next tile's first
// WGMMA group is in flight. The same deadlock rule as above, decided for the warpgroup at once.
struct DeferredActRelease {
  unsigned* ctr = nullptr;  // uniform over the warpgroup
  __device__ __forceinline__ void flush(int bar_id, int lt) {
    if (ctr != nullptr) {
      fence_proxy_async_global();
      named_bar_sync(bar_id, 128);
      if (lt == 0) {
        __threadfence();
        red_release_gpu_add(ctr, 1u);
      }
      ctr = nullptr;
    }
  }
  __device__ __forceinline__ void hold(unsigned* c, int bar_id, int lt) {
    flush(bar_id, lt);
    ctr = c;
  }
  __device__ __forceinline__ void before_wait(uint64_t* info_full, uint32_t phase, int bar_id, int lt,
                                              unsigned spin_ns = 0) {
    if (ctr != nullptr && named_bar_any(bar_id, 128, !info_within(info_full, phase, spin_ns))) flush(bar_id, lt);
  }
};

}  // namespace mok
