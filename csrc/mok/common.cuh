// MoK forward megakernel: shared types, constants and small PTX helpers.
//
// Everything here is our own code. From CUTLASS/CuTe (nvidia-cutlass==4.2.0.0 headers) we only use
// arch-level atoms: the WGMMA instruction wrappers (cute/arch/mma_sm90_gmma.hpp), the TMA load
// atom (cute/arch/copy_sm90_tma.hpp) and mbarrier helpers (cutlass/arch/barrier.h).
#pragma once

#include <cstdint>
#include <cuda.h>  // CUtensorMap (types only; the driver entry point is fetched at run time)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "mok_limits.h"

// Timing ablations (leave one stage out; results are wrong on purpose). Only compiled into the
// -DMOK_ABLATION build (MOK_DEBUG=ablation=BITS, megatron_mok/env.py), so the normal kernel has no extra
// branches or registers.
#ifdef MOK_ABLATION
#define MOK_DBG(bit) (P.debug & (bit))
#else
#define MOK_DBG(bit) 0
#endif

namespace mok {

struct TimelineEvent;

// ---- kernel geometry --------------------------------------------------------------------------
constexpr int kThreads = 384;           // 3 warpgroups: WG0 = TMA producer, WG1/WG2 = WGMMA consumers
constexpr int kWarps = kThreads / 32;
constexpr int kBM = 128;                // GEMM tile rows (2 consumer warpgroups x 64)
constexpr int kConsumerWGs = 2;         // each signals its rows of a tile itself (fc1_done, mb_done count both)
constexpr int kBN = 256;                // GEMM tile cols (fc1: 128 gate + 128 up; fc2: 256 hidden)
constexpr int kBK = 64;                 // 64 bf16 = 128 B = one SWIZZLE_128B row
constexpr int kStages = 4;              // smem pipeline depth
constexpr int kFc1ActCols = kBN / 2;    // activation columns produced per fc1 tile
constexpr int kATileBytes = kBM * kBK * 2;      // 16 KB
constexpr int kBTileBytes = kBN * kBK * 2;      // 32 KB
constexpr int kStageBytes = kATileBytes + kBTileBytes;
constexpr int kChunkTokens = 128;       // schedule phase: tokens per chunk (one warp per chunk)
// FP8 (e4m3) variant: the same 48 KB stages, each K step one 128-byte SW128 row = 128 e4m3 = one
// scale block (DeepSeek-V3 recipe: 1 x 128 activation, 128 x 128 weight blocks).
constexpr int kBKf8 = 128;
constexpr int kScaleBlock = 128;
constexpr float kE4m3Max = 448.0f;
constexpr float kInvE4m3Max = (float)(1.0 / 448.0);  // scale = amax * this (megatron_mok/fp8.py: _INV_MAX)
constexpr float kScaleTiny = 1e-12f;  // all-zero blocks: a tiny scale instead of 0 (megatron_mok/fp8.py)

// Nonzero iff one of the 8 bf16 values in v is NaN or +-Inf (all exponent bits set): per 16-bit half,
// (bits & 0x7F80) + 0x0080 carries into bit 15 exactly then. Three integer operations a word, no conversion.
__device__ __forceinline__ uint32_t bf16x8_nonfinite(const uint4& v) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t w = i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
    m |= ((w & 0x7F807F80u) + 0x00800080u) & 0x80008000u;
  }
  return m;
}

// ---- error reporting ----------------------------------------------------------------------------
enum ErrCode : int {
  kErrNone = 0,
  kErrTimeout = 1,
  kErrBadIndex = 2,
  kErrInternal = 3,
  kErrBadShape = 4,
  kErrCapacity = 5,  // the routing sends an owner more rows than its owner-side buffers hold
  kErrNonFinite = 6, // a NaN / Inf in a token's x or grad_out, or in an FP8 weight block scale
};
enum Phase : int {
  kPhaseGridBarrier = 1,
  kPhaseDispatchReady = 2,   // compute waits for dispatch of a ring slot
  kPhaseSlotFree = 3,        // dispatch waits for a ring slot to be released by combine
  kPhaseFc1Done = 4,         // fc2 tile waits for the fc1 tiles of its row block
  kPhaseComputeDone = 5,     // final weighted combine waits for all experts' pushes
  kPhasePipeline = 6,        // internal smem pipeline (mbarrier) wait
  kPhaseSchedule = 7,
  kPhasePeerStart = 8,       // per-rank launch: waits for every peer's start signal (inputs published)
  kPhasePeerDone = 9,        // per-rank launch: waits for every peer's compute-done signal (pushes landed)
  kPhasePeerShape = 10,      // per-rank launch: a peer announced a different token count
  kPhaseWgrad = 11,          // wgrad: expert row counts inconsistent with the layout buffers
  kPhasePeerSrcQuant = 13,   // per-rank FP8 launch: waits for every peer's
                             // source-quantised signal (its tokens' e4m3 copy written)
  kPhaseInputCheck = 14,     // x read by the pull (bf16) or by its source quantisation (FP8)
  kPhaseWeightScales = 15,   // FP8: the experts' weight block scales, read before the schedule
  kPhaseGradOutCheck = 16,   // backward: grad_out read by the pull reverse-combine
  kPhaseTokenCounts = 17,    // FP8 wgrad units: per-expert token counts that do not fit the rows / token columns
};
// err[0]=code err[1]=rank err[2]=slot err[3]=phase err[4]=expected err[5]=seen err[6]=extra err[7]=block

// ---- per-rank table (global memory) -------------------------------------------------------------
// Emulated EP: all ranks live on one GPU and one launch. Per-rank launches (real EP, or several
// launches on one GPU): x / idx / combine / signal are peer pointers (torch symmetric memory
// buffer_ptrs) and the same device code runs unchanged.
struct RankTable {
  const __nv_bfloat16* x;       // [T, H]
  const int* idx;               // [T, K]
  const float* w;               // [T, K]
  __nv_bfloat16* out;           // [T, H]
  __nv_bfloat16* combine;       // [T, K, H]   (home-rank receive buffer of push combine)
  int* tokens_per_expert;       // [L]
  int T;
  int entry_base;               // sum_{r'<r} T_r' * K
  int chunk_base;               // sum_{r'<r} ceil(T_r' / kChunkTokens)
  int pad;
  unsigned* signal;             // [kSigKinds][MOK_MAX_RANKS] rank r's signal pad (per-rank launches only)
  __nv_bfloat16* saved_h;       // owner: [layout rows, 2F] fc1 output kept for the backward, or null
};

// Signal pad of a rank (per-rank launches): slot [kind][src] is written by rank src with the call's
// epoch (monotonic across calls, so the pad is never re-zeroed). kSigTokens carries src's T. kSigSrcQuant:
// src's tokens are quantised into its symmetric e4m3 copy (FP8 forward only).
enum SignalKind : int { kSigStart = 0, kSigDone = 1, kSigTokens = 2, kSigSrcQuant = 3, kSigKinds = 4 };

struct Params {
  int R, L, E, H, F, K;
  int rank0, nparts;                  // ranks [rank0, rank0 + nparts) run in this launch (the product's launches: rank, 1)
  int peer_sync;                      // 1: one launch per rank, ranks meet through signal pads (.sys)
  unsigned epoch;                     // call number (>= 1) for the signal pads
  int comm_sms, ctas_per_rank, ring_slots, minibatch;
  int slot_rows;                      // forward: rows a ring slot holds (minibatch + kBM - 1; kept rows: minibatch)
  int kept_layout;                    // forward: the ring is the caller's kept rows in layout order (KeptRows)
  int mt_max, nt1, nt2, tickets_per_mb;  // tickets_per_mb: the backward's (the forward's are dense)
  int mb_cap;                         // max minibatches per rank (counter array size)
  int debug;                          // timing ablations (MOK_DEBUG bitmask, results wrong): 1 no final sum,
                                      // 2 no fc2 epilogue stores, 4 no fc1 epilogue stores, 8 no dispatch copy,
                                      // 32 no fp8 scale promotion (the drain stays), 64 no fp8 drain
                                      // either (wait<1> as bf16)
  int pad;                            // unused: keeps the ints below on the 8-byte pairs their loads combine
  int raster;                         // ticket order in a GEMM stage: 0 row-block major, 1 n-tile major, G>1 bands of G row blocks
  int num_chunks, total_entries;
  int stall_rank, stall_slot;
  unsigned long long timeout_ns;
  long long layout_cap;               // rows per rank in layout buffer
  long long owner_rows;               // rows an owner's row buffers hold (saved h; backward xl/gyl/dh/act)
  const RankTable* ranks;             // [R]
  const CUtensorMap* tmaps;           // see tmap_* helpers
  // Per-partition workspace ([nparts] leading dim, indexed by part(P, q) = q - rank0):
  __nv_bfloat16* ring;                // [nparts][S][slot_rows][H]  dispatch ring buffer (x rows in layout order)
  __nv_bfloat16* act;                 // [nparts][S][slot_rows][F]  SwiGLU activations per slot
  int2* layout;                       // [nparts][layout_cap] (src rank, src entry t*K+k)
  int* local_rank;                    // [total_entries]
  int* chunk_counts;                  // [E][num_chunks] (zeroed per launch)
  int* expert_total;                  // [E]
  int* expert_off;                    // [nparts][L+1]
  unsigned* counters;                 // see ctr_* helpers (zeroed per launch)
  int* err;                           // [8]
  TimelineEvent* timeline;            // optional [grid][timeline_cap] events (timeline.cuh), or nullptr
  unsigned* timeline_count;           // [grid] events written per CTA (zeroed by the host)
  int timeline_cap;
  // FP8 forward only (kernel variant kFp8, kernel.dtype fp8): ring / act hold e4m3 bytes (ring and act
  // above, reinterpreted), with one fp32 scale per 1 x 128 block of each row; the expert weights (tensor
  // maps) are e4m3 with one fp32 scale per 128 x 128 block. Null in the bf16 kernel.
  const float* const* wscale;         // [nparts * L * 2]: local expert g' -> {w1 [2F/128, H/128], w2 [H/128, F/128]}
  float* ring_scale;                  // [H / 128][nparts * S * slot_rows] (K-block-major: fp8_scale_at)
  float* act_scale;                   // [F / 128][nparts * S * slot_rows]
  // FP8 forward: rank r's tokens as e4m3 rows with their 1 x 128 scales, written
  // by r's launch before the pulls (EP 1: workspace; EP > 1: r's symmetric region, peer
  // pointers). Null otherwise.
  uint8_t* const* xq;                 // [R] -> [T_r][H]
  float* const* xs;                   // [R] -> [T_r][H / 128]
  // The SwiGLU variant (swiglu.cuh; forward: kFeatGlu instances, backward: kGlu instances only):
  int glu;                            // 1: the SwiGLU variant of swiglu.cuh (clamp and / or offset); 0: plain SwiGLU
  float glu_clamp, glu_offset;        // its clamp (+inf: none) and offset (Megatron's activation_func_clamp_value,
                                      // glu_linear_offset)
};

// Float index of (slot row r, K block kb) in the FP8 forward's activation-scale buffers (ring_scale of the pulled
// rows, act_scale of the SwiGLU output; r = the flattened slot row, part * S * slot_rows + slot * slot_rows + row),
// and the floats between a row's consecutive K blocks. The scales are stored K-block-major, [block][row]: the K
// loop's scale loads (per thread, rows r and r + 8 of its fragment, one K block ahead) then read 8 consecutive
// rows per warp load, one L2 sector instead of eight (16 sector reads per SM and K block instead of 128); the
// writers pay instead (the pull's scales of a row land in H / 128 sectors, written once, read by every n-tile).
// Together with the source quantisation this made the FP8 forward 3.7 % faster (docs/design.md).
__device__ __forceinline__ long long fp8_scale_rows(const Params& P) {
  return (long long)P.nparts * P.ring_slots * P.slot_rows;
}
__device__ __forceinline__ long long fp8_scale_at(const Params& P, long long r, int kb, int /*nk*/) {
  return kb * fp8_scale_rows(P) + r;
}
__device__ __forceinline__ long long fp8_scale_step(const Params& P) { return fp8_scale_rows(P); }

// Optional forward features, compiled into an instance of the forward kernel (its template argument kFeat):
// the launcher runs the lean instance (kFeat 0) unless a launch uses one. A compiled-in feature's run-time tests
// and code sit in every launch's hot paths (an FP8 instance with three such features compiled in and none used
// ran ~5 % slower than the lean one: Kimi-K2 slice, side by side on an H100).
enum FwdFeature : int {
  kFeatGlu = 1,  // the SwiGLU variant (clamp / offset, swiglu.cuh) in the fc1 epilogue
};
template <int kFeat>
__host__ __device__ __forceinline__ bool feat_glu(const Params& P) {
  return (kFeat & kFeatGlu) && P.glu;
}

// Partition of rank q inside this launch (workspace index); in_launch: q runs in this launch.
__host__ __device__ __forceinline__ int part(const Params& P, int q) { return q - P.rank0; }
__host__ __device__ __forceinline__ bool in_launch(const Params& P, int q) {
  return (unsigned)(q - P.rank0) < (unsigned)P.nparts;
}

// Tensor map table, only for the experts of this launch's ranks: local expert id
// g' = g - rank0 * L: 3*g'+0 gate [F,H], 3*g'+1 up [F,H], 3*g'+2 w2 [H,F];
// then per partition p: 3*nparts*L + 2*p + 0 ring [S*slot_rows, H], + 1 act [S*slot_rows, F].
__device__ __forceinline__ const CUtensorMap* tmap_expert(const Params& P, int g) {
  return P.tmaps + 3 * (g - P.rank0 * P.L);
}
__device__ __forceinline__ const CUtensorMap* tmap_gate(const Params& P, int g) { return tmap_expert(P, g) + 0; }
__device__ __forceinline__ const CUtensorMap* tmap_up(const Params& P, int g) { return tmap_expert(P, g) + 1; }
__device__ __forceinline__ const CUtensorMap* tmap_w2(const Params& P, int g) { return tmap_expert(P, g) + 2; }
__device__ __forceinline__ const CUtensorMap* tmap_ring(const Params& P, int q) {
  return P.tmaps + 3 * P.nparts * P.L + 2 * part(P, q);
}
__device__ __forceinline__ const CUtensorMap* tmap_act(const Params& P, int q) { return tmap_ring(P, q) + 1; }

// Counter layout (all monotonic within a launch; zeroed by the host launcher before each launch).
// Ring-protocol counters are kept per minibatch (not per slot), so no round arithmetic is needed and
// minibatches with fewer row blocks than others cannot confuse a slot's counters.
// Per-partition counters (nparts = ranks in this launch).
__host__ __device__ inline long long ctr_count(int nparts, int mb_cap, int mt_max) {
  return 2 + (long long)nparts + 2LL * nparts * mb_cap + (long long)nparts * mb_cap * mt_max;
}
__device__ __forceinline__ unsigned* ctr_grid_barrier(const Params& P) { return P.counters + 0; }
__device__ __forceinline__ unsigned* ctr_compute_done(const Params& P) { return P.counters + 1; }
__device__ __forceinline__ unsigned* ctr_ticket(const Params& P, int q) { return P.counters + 2 + part(P, q); }
// +1 per pulling CTA once its share of minibatch mb sits in its ring slot (ready_target: every CTA of the
// rank for minibatch 0, the comm CTAs for the rest)
__device__ __forceinline__ unsigned* ctr_ready(const Params& P, int q, int mb) {
  return P.counters + 2 + P.nparts + (long long)part(P, q) * P.mb_cap + mb;
}
// +1 per consumer warpgroup per finished fc2 tile (its combine pushes written) of minibatch mb
__device__ __forceinline__ unsigned* ctr_mb_done(const Params& P, int q, int mb) {
  return P.counters + 2 + P.nparts + (long long)P.nparts * P.mb_cap + (long long)part(P, q) * P.mb_cap + mb;
}
// +1 per consumer warpgroup per finished fc1 tile of row block mt of minibatch mb
__device__ __forceinline__ unsigned* ctr_fc1_done(const Params& P, int q, int mb, int mt) {
  return P.counters + 2 + P.nparts + 2LL * P.nparts * P.mb_cap + ((long long)part(P, q) * P.mb_cap + mb) * P.mt_max +
         mt;
}

// ---- PTX helpers ---------------------------------------------------------------------------------
// Ring counters are GPU-local (.gpu scope) in the pull design; only the per-rank launches' start /
// done signals cross GPUs (.sys scope, peer_sync.cuh).
__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int ld_volatile_int(const int* p) {
  int v;
  asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned atom_add_acq_rel_gpu(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ void red_release_gpu_add(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Generic-proxy writes (st.global) that a later TMA (async proxy) read must see, and vice versa.
// This thread's generic-proxy shared-memory writes ordered before later async-proxy (TMA) accesses of the
// same bytes: the schedule's scratch (schedule.cuh) lies where the stage ring's TMA loads land afterwards.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
__device__ __forceinline__ void named_bar_sync(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
}
// Named barrier that also ORs a predicate over its threads: every thread gets the same answer.
__device__ __forceinline__ bool named_bar_any(int id, int nthreads, bool p) {
  int r;
  asm volatile(
      "{\n .reg .pred pi, po;\n setp.ne.b32 pi, %1, 0;\n barrier.cta.red.or.pred po, %2, %3, pi;\n"
      " selp.b32 %0, 1, 0, po;\n}"
      : "=r"(r)
      : "r"((int)p), "r"(id), "r"(nthreads)
      : "memory");
  return r != 0;
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace mok
