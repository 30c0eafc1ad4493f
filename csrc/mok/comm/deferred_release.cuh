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
#include "gemm/gemm_sm90.cuh"
#include "comm/ring_buffer.cuh"

namespace mok {

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
  __device__ __forceinline__ void before_wait(uint64_t* info_full, uint32_t phase) {
    if (ctr != nullptr && !Barrier::test_wait(info_full, phase, 1u)) flush();
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
  __device__ __forceinline__ void before_wait(uint64_t* info_full, uint32_t phase, int bar_id, int lt) {
    if (ctr != nullptr && named_bar_any(bar_id, 128, !Barrier::test_wait(info_full, phase, 1u))) flush(bar_id, lt);
  }
};

}  // namespace mok
