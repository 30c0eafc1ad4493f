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

}  // namespace mok
