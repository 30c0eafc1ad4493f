// Upload of a launch's host table (tensor maps, rank table) through kernel parameters, for launches
// captured in a CUDA graph. A graph keeps a copy of every kernel node's parameters, so the table lives
// exactly as long as the graph and no host buffer has to outlive the capture (a memcpy node would read
// its host source again on every replay). Eager launches use the pinned staging pool (host_launch.h).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace mok {

// bytes per copy kernel: kernel parameters may hold up to 32764 bytes (CUDA >= 12.1, sm_70+)
constexpr int kParamChunkBytes = 32 * 1024 - 256;

struct alignas(16) ParamChunk {
  uint8_t bytes[kParamChunkBytes];
};

static __global__ void param_copy_kernel(const __grid_constant__ ParamChunk chunk, uint8_t* dst, int n) {
  const int stride = gridDim.x * blockDim.x;
  const int nv = n / 16;  // dst is 16-byte aligned (the workspace), the chunk too
  const uint4* src = reinterpret_cast<const uint4*>(chunk.bytes);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < nv; i += stride) reinterpret_cast<uint4*>(dst)[i] = src[i];
  for (int i = nv * 16 + blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = chunk.bytes[i];
}

}  // namespace mok

namespace mok_host {

// dst[0, bytes) = src[0, bytes) on `stream`, by copy kernels whose parameters carry the bytes.
inline cudaError_t upload_by_kernel_params(void* dst, const uint8_t* src, size_t bytes, cudaStream_t stream) {
  mok::ParamChunk chunk;
  for (size_t off = 0; off < bytes; off += mok::kParamChunkBytes) {
    const int n = (int)(bytes - off < (size_t)mok::kParamChunkBytes ? bytes - off : (size_t)mok::kParamChunkBytes);
    memcpy(chunk.bytes, src + off, (size_t)n);
    mok::param_copy_kernel<<<8, 256, 0, stream>>>(chunk, static_cast<uint8_t*>(dst) + off, n);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace mok_host
