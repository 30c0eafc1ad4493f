// Host-side helpers shared by the forward and backward launchers (host/forward.cu, host/backward.cu):
// error text, TMA descriptor encoding, pinned staging of the per-launch tables, CUDA error checks
// (the sm_100 unit, sm100/mxfp8_grouped_gemm.cu, uses its error text).
// Host code only; each launcher library includes it once.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "host/launch_args.h"
#include "host/param_upload.cuh"
#include "mok_limits.h"

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

// The SwiGLU variant of a launch (swiglu.cuh): glu 0 (plain) or 1 with a clamp > 0 (+inf: none) and a finite
// offset. Copied into Params by the forward and backward launchers alike.
inline bool glu_args_ok(int glu, float clamp, float offset, char* eb, int el) {
  if (glu != 0 && glu != 1) return !write_err(eb, el, "glu must be 0 (plain SwiGLU) or 1 (clamp / offset), got %d", glu);
  if (glu && !(clamp > 0.0f)) return !write_err(eb, el, "glu_clamp must be > 0 (+inf: no clamp), got %g", clamp);
  if (glu && !(offset - offset == 0.0f)) return !write_err(eb, el, "glu_offset must be finite, got %g", offset);
  return true;
}

// The checks every rank's launch of a megakernel shares (launch_args.h: MokRankLaunch): sizes within the kernel's
// limits, the rank, the ring, the minibatch, the token counts and the SwiGLU variant. Each launcher adds its own.
inline bool rank_launch_ok(const MokRankLaunch* a, char* eb, int el) {
  if (a->R < 1 || a->R > MOK_MAX_RANKS) return !write_err(eb, el, "R=%d out of [1, %d]", a->R, MOK_MAX_RANKS);
  if (a->L < 1 || a->L > MOK_MAX_LOCAL_EXPERTS)
    return !write_err(eb, el, "local experts L=%d out of [1, %d]", a->L, MOK_MAX_LOCAL_EXPERTS);
  if ((long long)a->R * a->L > MOK_MAX_EXPERTS) return !write_err(eb, el, "E=R*L exceeds %d", MOK_MAX_EXPERTS);
  if (a->H < 64 || a->H % 64) return !write_err(eb, el, "hidden H=%d must be a positive multiple of 64", a->H);
  if (a->F < 64 || a->F % 64) return !write_err(eb, el, "ffn F=%d must be a positive multiple of 64", a->F);
  if (a->K < 1 || a->K > 64) return !write_err(eb, el, "top-k K=%d out of [1, 64]", a->K);
  if (a->rank < 0 || a->rank >= a->R) return !write_err(eb, el, "rank %d out of [0, %d)", a->rank, a->R);
  if (a->ring_slots < 1 || a->ring_slots > MOK_MAX_SLOTS)
    return !write_err(eb, el, "ring_slots=%d out of [1, %d]", a->ring_slots, MOK_MAX_SLOTS);
  if (a->minibatch < 1 || a->minibatch > (1 << 20))
    return !write_err(eb, el, "minibatch_tokens=%d out of [1, 2^20]", a->minibatch);
  if (!glu_args_ok(a->glu, a->glu_clamp, a->glu_offset, eb, el)) return false;
  long long entries = 0;
  for (int r = 0; r < a->R; ++r) {
    if (a->T[r] < 0) return !write_err(eb, el, "T[%d] < 0", r);
    entries += a->T[r] * a->K;
  }
  if (entries >= (1LL << 30)) return !write_err(eb, el, "too many (token, k) entries: %lld", entries);
  return true;
}

// A launch that meets peer ranks (R > 1) needs the call number and every rank's signal pad.
inline bool rank_peers_ok(const MokRankLaunch* a, char* eb, int el) {
  if (a->R == 1) return true;
  if (a->epoch == 0) return !write_err(eb, el, "epoch must be >= 1 (call number)");
  if (!a->signal) return !write_err(eb, el, "per-rank launch needs every rank's signal pad");
  for (int r = 0; r < a->R; ++r)
    if (!a->signal[r]) return !write_err(eb, el, "signal pad of rank %d is null", r);
  return true;
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

// cuTensorMapEncodeTiled is a pure function of its arguments (a host-side encoding, no context), and a
// launch encodes three maps per local expert (96 with 32) for weights that stay where they are from call
// to call: a direct-mapped memo keyed by every argument that varies here turns those encodes into table
// look-ups (the launcher's host time is what a per-call timing adds while the GPU waits).
struct TmapKey {
  const void* ptr;
  unsigned long long inner, outer, ld;
  unsigned box_inner, box_outer;
  int dtype;
  bool operator==(const TmapKey& o) const {
    return ptr == o.ptr && inner == o.inner && outer == o.outer && ld == o.ld && box_inner == o.box_inner &&
           box_outer == o.box_outer && dtype == o.dtype;
  }
};

class TmapMemo {
 public:
  bool get(const TmapKey& k, CUtensorMap* m) {
    std::lock_guard<std::mutex> lock(mu_);
    const Slot& s = slot(k);
    if (!s.used || !(s.key == k)) return false;
    *m = s.map;
    return true;
  }
  void put(const TmapKey& k, const CUtensorMap& m) {
    std::lock_guard<std::mutex> lock(mu_);
    Slot& s = slot(k);
    s.used = true;
    s.key = k;
    s.map = m;
  }

 private:
  static constexpr size_t kSlots = 16384;  // ~3 MB: the weight maps of a large model's every MoE layer
  struct Slot {
    bool used = false;
    TmapKey key{};
    CUtensorMap map{};
  };
  Slot& slot(const TmapKey& k) {
    if (slots_.empty()) slots_.resize(kSlots);
    uint64_t h = reinterpret_cast<uintptr_t>(k.ptr) * 0x9E3779B97F4A7C15ull;
    const uint64_t vs[5] = {k.inner, k.outer, k.ld, (uint64_t)k.box_inner << 32 | k.box_outer, (uint64_t)k.dtype};
    for (uint64_t v : vs) h = (h ^ v) * 0x100000001B3ull;
    h ^= h >> 33;  // final mix: every input bit reaches the slot index
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    return slots_[h % kSlots];
  }
  std::mutex mu_;
  std::vector<Slot> slots_;
};

inline TmapMemo& tmap_memo() {
  static TmapMemo memo;
  return memo;
}

// An error's subject: `what`, and the global expert index when >= 0 (formatted only on an error).
inline int write_encode_err(char* eb, int el, const char* what, int expert, const char* fmt_tail,
                            unsigned long long v) {
  char subject[96];
  if (expert >= 0)
    snprintf(subject, sizeof(subject), "%s of expert %d", what, expert);
  else
    snprintf(subject, sizeof(subject), "%s", what);
  return write_err(eb, el, fmt_tail, subject, v);
}

// 2-D row-major [outer, inner] of `elem`-byte elements with row stride ld (elements), box
// {box_inner, box_outer}, 128B swizzle.
inline bool encode_2d_typed(CUtensorMap* m, CUtensorMapDataType dtype, unsigned elem, const void* ptr,
                            unsigned long long inner, unsigned long long outer, unsigned long long ld,
                            unsigned box_inner, unsigned box_outer, char* eb, int el, const char* what,
                            int expert = -1) {
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
    return !write_encode_err(eb, el, what, expert, "%s: base pointer not 16-byte aligned (%llx)",
                             (unsigned long long)reinterpret_cast<uintptr_t>(ptr));
  if ((ld * elem) % 16 != 0)
    return !write_encode_err(eb, el, what, expert, "%s: row stride %llu elements is not a multiple of 16 bytes", ld);
  const TmapKey key{ptr, inner, outer, ld, box_inner, box_outer, (int)dtype};
  if (tmap_memo().get(key, m)) return true;
  EncodeTiledFn fn = get_encode_fn();
  if (!fn) return !write_err(eb, el, "cuTensorMapEncodeTiled entry point not available");
  cuuint64_t dims[2] = {inner, outer > 0 ? outer : 1};
  cuuint64_t strides[1] = {ld * elem};
  cuuint32_t box[2] = {box_inner, box_outer};
  cuuint32_t estr[2] = {1, 1};
  CUresult r = fn(m, dtype, 2, const_cast<void*>(ptr), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return !write_encode_err(eb, el, what, expert, "%s: cuTensorMapEncodeTiled failed (%llu)", (unsigned long long)r);
  tmap_memo().put(key, *m);
  return true;
}

// bf16 [outer, inner], row stride ld elements
inline bool encode_2d(CUtensorMap* m, const void* ptr, unsigned long long inner, unsigned long long outer,
                      unsigned long long ld, unsigned box_inner, unsigned box_outer, char* eb, int el,
                      const char* what, int expert = -1) {
  return encode_2d_typed(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, ptr, inner, outer, ld, box_inner, box_outer, eb, el,
                         what, expert);
}

// 1-byte elements (e4m3) [outer, inner], row stride ld bytes
inline bool encode_2d_u8(CUtensorMap* m, const void* ptr, unsigned long long inner, unsigned long long outer,
                         unsigned long long ld, unsigned box_inner, unsigned box_outer, char* eb, int el,
                         const char* what, int expert = -1) {
  return encode_2d_typed(m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, ptr, inner, outer, ld, box_inner, box_outer, eb, el,
                         what, expert);
}

struct StagingBuf {
  uint8_t* host = nullptr;
  size_t cap = 0;
  int device = -1;
  bool busy = false;    // acquired, its copy not yet enqueued (guarded by staging_mutex())
  bool broken = false;  // its copy was enqueued but `done` not recorded: never reused
  cudaEvent_t done = nullptr;
};

inline std::mutex& staging_mutex() {
  static std::mutex mu;
  return mu;
}

// Pinned host staging of a launch's tensor maps + rank tables (one truly asynchronous H2D copy; a
// pageable source may make the driver wait for the stream). A buffer is reused only once its last
// copy has completed (its `done` event); the host never waits for one. That matters: per-rank
// launches sharing a GPU (dgrad + wgrad of R ranks on R streams) enqueue copies behind kernels that
// only finish once a later rank has launched, so a host wait on an earlier copy would deadlock them
// until the kernels' own timeout. The first call pins kFirstSlabs slabs of kSlabSlots 64 KB slots; the
// pool grows by a slab when it has no idle slot (a page-locked allocation serialises the streams
// around it, so growth should be rare: only a host kFirstSlabs * kSlabSlots launches ahead of the GPU
// needs it), tables over 64 KB get blocks of their own, and past kMaxStaging buffers acquiring is an
// error naming the cause, never a wait.
inline const char* acquire_staging(size_t bytes, StagingBuf** out) {
  constexpr size_t kMaxStaging = 1024;
  constexpr size_t kSlot = 64u << 10;
  constexpr size_t kSlabSlots = 32;
  constexpr int kFirstSlabs = 2;
  static std::vector<std::unique_ptr<StagingBuf>> pool;
  std::lock_guard<std::mutex> lock(staging_mutex());
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return "cudaGetDevice failed";
  auto idle = [](StagingBuf& b) {
    if (b.busy || b.broken) return false;
    const cudaError_t q = cudaEventQuery(b.done);
    if (q == cudaErrorNotReady) (void)cudaGetLastError();  // not an error: clear it like torch's Event::query
    return q == cudaSuccess;
  };
  auto add = [&](uint8_t* host, size_t cap) -> StagingBuf* {
    std::unique_ptr<StagingBuf> b(new StagingBuf);
    b->device = dev;
    b->host = host;
    b->cap = cap;
    if (cudaEventCreateWithFlags(&b->done, cudaEventDisableTiming) != cudaSuccess) return nullptr;
    pool.push_back(std::move(b));
    return pool.back().get();
  };
  auto add_slab = [&]() -> const char* {
    uint8_t* slab = nullptr;
    if (cudaMallocHost(reinterpret_cast<void**>(&slab), kSlot * kSlabSlots) != cudaSuccess)
      return "cudaMallocHost(staging slab) failed";
    for (size_t i = 0; i < kSlabSlots; ++i)
      if (!add(slab + i * kSlot, kSlot)) return "cudaEventCreate failed";
    return nullptr;
  };
  bool have_dev = false;
  for (auto& b : pool) have_dev = have_dev || b->device == dev;
  for (int i = 0; !have_dev && i < kFirstSlabs; ++i)
    if (const char* msg = add_slab()) return msg;
  StagingBuf* pick = nullptr;
  for (auto& b : pool)  // the first idle buffer of this device that is large enough
    if (b->device == dev && b->cap >= bytes && idle(*b)) {
      pick = b.get();
      break;
    }
  if (!pick) {
    if (pool.size() + kSlabSlots > kMaxStaging)
      return "staging pool exhausted: the host is ~1000 launches ahead of the GPU (synchronise now and then)";
    if (bytes <= kSlot) {
      if (const char* msg = add_slab()) return msg;
      pick = pool[pool.size() - kSlabSlots].get();
    } else {
      uint8_t* host = nullptr;
      if (cudaMallocHost(reinterpret_cast<void**>(&host), align_up(bytes, kSlot)) != cudaSuccess)
        return "cudaMallocHost failed";
      if (!(pick = add(host, align_up(bytes, kSlot)))) return "cudaEventCreate failed";
    }
  }
  pick->busy = true;
  *out = pick;
  return nullptr;
}

// One launch's hold on a staging buffer (the launchers' `stg`): acquire, fill, upload (the H2D copy +
// `done`); on every return path the buffer goes back to the pool, reused once `done` has completed.
// A launch captured into a CUDA graph fills a host buffer of its own instead and uploads it through
// kernel parameters (param_upload.cuh): a graph's memcpy node would read its pinned source again on every
// replay, long after this launch returned the buffer to the pool and later launches refilled it.
class StagingLease {
 public:
  StagingLease() = default;
  StagingLease(const StagingLease&) = delete;
  StagingLease& operator=(const StagingLease&) = delete;
  ~StagingLease() {
    if (!buf_ || captured_) return;
    std::lock_guard<std::mutex> lock(staging_mutex());
    buf_->busy = false;
  }
  const char* acquire(size_t bytes, cudaStream_t stream) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &st) != cudaSuccess) return "cudaStreamIsCapturing failed";
    if (st == cudaStreamCaptureStatusInvalidated) return "the stream's CUDA graph capture was invalidated";
    if (st == cudaStreamCaptureStatusActive) {
      captured_ = true;
      scratch_.assign(bytes, 0);
      graph_buf_.host = scratch_.data();
      graph_buf_.cap = bytes;
      buf_ = &graph_buf_;
      return nullptr;
    }
    return acquire_staging(bytes, &buf_);
  }
  StagingBuf* operator->() const { return buf_; }
  // The copy of the first `bytes` to dst on `stream`, then `done`. If the copy was enqueued but `done`
  // could not be recorded, the buffer is never reused (its copy may still be reading it).
  cudaError_t upload(void* dst, size_t bytes, cudaStream_t stream) {
    if (captured_) return upload_by_kernel_params(dst, buf_->host, bytes, stream);
    cudaError_t e = cudaMemcpyAsync(dst, buf_->host, bytes, cudaMemcpyHostToDevice, stream);
    if (e != cudaSuccess) return e;
    e = cudaEventRecord(buf_->done, stream);
    if (e != cudaSuccess) {
      std::lock_guard<std::mutex> lock(staging_mutex());
      buf_->broken = true;
    }
    return e;
  }

 private:
  StagingBuf* buf_ = nullptr;
  bool captured_ = false;
  StagingBuf graph_buf_;          // a captured launch's buffer: scratch_ below
  std::vector<uint8_t> scratch_;  // its bytes, copied into the graph's kernel parameters by upload()
};

}  // namespace mok_host

// In functions taking (char* errbuf, int errlen) and returning int: a failing CUDA call -> error text, 1.
#define MOK_CUDA_CHECK(call)                                                                       \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess)                                                                         \
      return mok_host::write_err(errbuf, errlen, "%s failed: %s (%s:%d)", #call, cudaGetErrorString(e_), \
                                 __FILE__, __LINE__);                                              \
  } while (0)
