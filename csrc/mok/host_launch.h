// Host-side helpers shared by the forward and backward launchers (mok_forward.cu, mok_backward.cu):
// error text, TMA descriptor encoding, pinned staging of the per-launch tables, CUDA error checks.
// Host code only; each launcher library includes it once.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace mok_host {

inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// printf into the caller's error buffer; returns 1 (the launchers' error code).
inline int write_err(char* buf, int len, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
inline int write_err(char* buf, int len, const char* fmt, ...) {
  if (buf && len > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, (size_t)len, fmt, ap);
    va_end(ap);
  }
  return 1;
}

typedef CUresult (*EncodeTiledFn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                  const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                  CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled through the runtime's driver entry point (no -lcuda at link time).
inline EncodeTiledFn get_encode_fn() {
  static EncodeTiledFn fn = nullptr;
  if (!fn) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<EncodeTiledFn>(p);
  }
  return fn;
}

// 2-D row-major [outer, inner] of `elem`-byte elements with row stride ld (elements), box
// {box_inner, box_outer}, 128B swizzle.
inline bool encode_2d_typed(CUtensorMap* m, CUtensorMapDataType dtype, unsigned elem, const void* ptr,
                            unsigned long long inner, unsigned long long outer, unsigned long long ld,
                            unsigned box_inner, unsigned box_outer, char* eb, int el, const char* what) {
  EncodeTiledFn fn = get_encode_fn();
  if (!fn) return !write_err(eb, el, "cuTensorMapEncodeTiled entry point not available");
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
    return !write_err(eb, el, "%s: base pointer not 16-byte aligned", what);
  if ((ld * elem) % 16 != 0)
    return !write_err(eb, el, "%s: row stride %llu elements is not a multiple of 16 bytes", what, ld);
  cuuint64_t dims[2] = {inner, outer > 0 ? outer : 1};
  cuuint64_t strides[1] = {ld * elem};
  cuuint32_t box[2] = {box_inner, box_outer};
  cuuint32_t estr[2] = {1, 1};
  CUresult r = fn(m, dtype, 2, const_cast<void*>(ptr), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return !write_err(eb, el, "%s: cuTensorMapEncodeTiled failed (%d)", what, (int)r);
  return true;
}

// bf16 [outer, inner], row stride ld elements
inline bool encode_2d(CUtensorMap* m, const void* ptr, unsigned long long inner, unsigned long long outer,
                      unsigned long long ld, unsigned box_inner, unsigned box_outer, char* eb, int el,
                      const char* what) {
  return encode_2d_typed(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, ptr, inner, outer, ld, box_inner, box_outer, eb, el,
                         what);
}

// 1-byte elements (e4m3) [outer, inner], row stride ld bytes
inline bool encode_2d_u8(CUtensorMap* m, const void* ptr, unsigned long long inner, unsigned long long outer,
                         unsigned long long ld, unsigned box_inner, unsigned box_outer, char* eb, int el,
                         const char* what) {
  return encode_2d_typed(m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, ptr, inner, outer, ld, box_inner, box_outer, eb, el,
                         what);
}

struct StagingBuf {
  uint8_t* host = nullptr;
  size_t cap = 0;
  cudaEvent_t done = nullptr;
  bool used = false;
};

// Pinned host staging of a launch's tensor maps + rank tables (one truly asynchronous H2D copy; a
// pageable source may make the driver wait for the stream). Round-robin over 4 buffers, so launches
// on several streams (per-rank launches sharing a GPU) do not wait for each other; before reuse, wait
// for that buffer's previous copy. Record `done` on the stream right after the copy.
inline const char* acquire_staging(size_t bytes, StagingBuf** out) {
  static StagingBuf bufs[4];
  static int next = 0;
  StagingBuf& b = bufs[next];
  next = (next + 1) % 4;
  if (b.used && cudaEventSynchronize(b.done) != cudaSuccess) return "cudaEventSynchronize(staging) failed";
  if (b.cap < bytes) {
    if (b.host) cudaFreeHost(b.host);
    b.host = nullptr;
    b.cap = 0;
    if (cudaMallocHost(reinterpret_cast<void**>(&b.host), bytes) != cudaSuccess) return "cudaMallocHost failed";
    b.cap = bytes;
  }
  if (!b.done && cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming) != cudaSuccess)
    return "cudaEventCreate failed";
  b.used = true;
  *out = &b;
  return nullptr;
}

}  // namespace mok_host

// In functions taking (char* errbuf, int errlen) and returning int: a failing CUDA call -> error text, 1.
#define MOK_CUDA_CHECK(call)                                                                       \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess)                                                                         \
      return mok_host::write_err(errbuf, errlen, "%s failed: %s (%s:%d)", #call, cudaGetErrorString(e_), \
                                 __FILE__, __LINE__);                                              \
  } while (0)
