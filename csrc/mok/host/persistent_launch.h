// The launch of a persistent megakernel, shared by the forward and the backward launcher (host/forward.cu,
// host/backward.cu): the grid of np rank partitions x cpr CTAs per rank, one CTA per SM, every CTA co-resident
// (the kernels wait on each other through grid barriers and flags), launched cooperatively after the per-launch
// state is reset on the same stream. Host code only.
#pragma once
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

#include "common.cuh"
#include "host/host_launch.h"

namespace mok_host {

// Loads `n` kernels on `device` now (cudaFuncGetAttributes loads a function). With CUDA's lazy loading a kernel
// would be loaded at its first launch, and loading waits for the kernels running on the device: a deadlock when those
// wait for a launch that comes after it (EP ranks sharing a GPU: rank 0's wgrad launch, queued behind its backward
// launch, was loaded while that backward waited for rank 1's, which was launched next).
inline int load_kernels(int device, const void* const* kernels, size_t n, char* errbuf, int errlen) {
  MOK_CUDA_CHECK(cudaSetDevice(device));
  for (size_t i = 0; i < n; ++i) {
    cudaFuncAttributes attr;
    MOK_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernels[i]));
  }
  return 0;
}

// The grid of one launch: the device's SMs, and CTAs per rank partition (ctas_per_rank, or an even split of the
// SMs when 0). Refuses a split that leaves no compute SM.
struct PersistentGrid {
  int num_sms = 0;
  int cpr = 0;
};

inline int persistent_grid(int device, int np, int ctas_per_rank, int comm_sms, PersistentGrid* g, char* errbuf,
                           int errlen) {
  MOK_CUDA_CHECK(cudaSetDevice(device));
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&g->num_sms, cudaDevAttrMultiProcessorCount, device));
  g->cpr = ctas_per_rank > 0 ? ctas_per_rank : g->num_sms / np;
  if (g->cpr < 2 || g->cpr - comm_sms < 1)
    return write_err(errbuf, errlen,
                     "%d rank(s) in this launch on %d SMs give %d CTAs per rank; comm_sms=%d leaves no compute SM",
                     np, g->num_sms, g->cpr, comm_sms);
  return 0;
}

// Blocks of `kernel` one SM holds at `smem` bytes of dynamic shared memory on `device`, the kernel's shared-memory
// limit raised first; both asked once per (kernel, device, size), not on every launch.
inline int kernel_occupancy(const void* kernel, int device, int smem, int* blocks, char* errbuf, int errlen) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, std::pair<int, int>> known;  // (kernel, device) -> (smem, blocks)
  std::lock_guard<std::mutex> lock(mu);
  auto& entry = known[{kernel, device}];
  if (entry.first != smem) {
    MOK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    MOK_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&entry.second, kernel, mok::kThreads, smem));
    entry.first = smem;
  }
  *blocks = entry.second;
  return 0;
}

// Refuses a grid of np x cpr CTAs that the device cannot hold at once (a persistent kernel would wait for CTAs
// that never start).
inline int check_coresident(const void* kernel, int device, int smem, int np, const PersistentGrid& g, char* errbuf,
                            int errlen) {
  int blocks = 0;
  if (kernel_occupancy(kernel, device, smem, &blocks, errbuf, errlen)) return 1;
  if ((long long)np * g.cpr > (long long)blocks * g.num_sms)
    return write_err(errbuf, errlen, "grid %d x %d CTAs cannot be co-resident (%d SMs x %d)", np, g.cpr, g.num_sms,
                     blocks);
  return 0;
}

// The per-launch state, in stream order before the kernel: the staged tables (tensor maps, rank tables), the
// workspace's counters [zero_begin, zero_end), the error record, and the timeline's per-CTA counts (if any).
struct LaunchState {
  StagingLease* staged;
  uint8_t* workspace;
  size_t staged_bytes, zero_begin, zero_end;
  int* err;                  // int32[8]
  unsigned* timeline_count;  // [grid] or nullptr
};

// Resets `s` and launches kernel<<<grid, kThreads, smem, stream>>>(P) cooperatively (co-residency was checked).
template <class Params>
inline int launch_persistent(void (*kernel)(Params), const Params& P, unsigned grid, int smem, cudaStream_t stream,
                             const LaunchState& s, char* errbuf, int errlen) {
  MOK_CUDA_CHECK((*s.staged).upload(s.workspace, s.staged_bytes, stream));
  MOK_CUDA_CHECK(cudaMemsetAsync(s.workspace + s.zero_begin, 0, s.zero_end - s.zero_begin, stream));
  MOK_CUDA_CHECK(cudaMemsetAsync(s.err, 0, 8 * sizeof(int), stream));
  if (s.timeline_count) MOK_CUDA_CHECK(cudaMemsetAsync(s.timeline_count, 0, (size_t)grid * sizeof(unsigned), stream));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(mok::kThreads);
  cfg.dynamicSmemBytes = (size_t)smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;  // co-residency of the grid, guaranteed (checked above)
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  MOK_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, P));
  MOK_CUDA_CHECK(cudaGetLastError());
  return 0;
}

}  // namespace mok_host
