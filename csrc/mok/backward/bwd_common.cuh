// MoK backward megakernel (BF16): parameters, counters, tensor-map table, small helpers.
//
// Reuses the forward's read-only building blocks: mok::Params (only the fields the in-kernel
// schedule, the grid barrier and the timeout helpers read), schedule.cuh (layout), timeout.cuh
// (every flag wait), gemm_sm90.cuh (WGMMA / TMA / mbarrier atoms), ring_buffer.cuh (row blocks).
#pragma once
#include "common.cuh"
#include "gemm/gemm_sm90.cuh"
#include "comm/peer_sync.cuh"
#include "comm/ring_buffer.cuh"
#include "comm/timeout.cuh"
#include "timeline.cuh"

namespace mok {
namespace bwd {

// Per-rank buffers of the backward (a partition's own, or peers' through their pointers).
struct BwdRank {
  const __nv_bfloat16* grad_out;  // [T, H]   home: output gradient (pulled by owners)
  const __nv_bfloat16* combine;   // [T, K, H] home: forward's unweighted expert outputs
  __nv_bfloat16* grad_buf;        // [T, K, H] home: receive buffer of the push reverse-dispatch
  __nv_bfloat16* grad_x;          // [T, H]   home: sum_k grad_buf[t, k]
  float* grad_w;                  // [T, K]   home: <grad_out[t], combine[t, k]>
  __nv_bfloat16* xl;              // [cap, H]  owner: pulled x rows, layout order (wgrad operand)
  __nv_bfloat16* gyl;             // [cap, H]  owner: w * grad_out rows, layout order (bf16)
  __nv_bfloat16* dh;              // [cap, 2F] owner: [dgate | dup], layout order (bf16)
  __nv_bfloat16* act;             // [cap, F]  owner: bf16(silu(g) * u) recomputed, layout order
  const __nv_bfloat16* saved_h;   // [cap, 2F] owner: forward's fc1 output [g | u] (bf16), or null: recompute
  // FP8 dgrad only (kernel variant kFp8; null otherwise): e4m3 copies with one fp32 scale per 1 x 128 block
  uint8_t* gyl8;                  // [cap, H]  owner: gyl as e4m3 (stage-1 A operand)
  float* gys;                     // [cap, H/128]
  uint8_t* dh8;                   // [cap, 2F] owner: dh as e4m3 (stage-2 A operand; wgrad reads the bf16 dh)
  float* dhs;                     // [cap, 2F/128]
};

struct BwdParams {
  Params base;          // schedule / barrier / timeout fields (see host/backward.cu)
  const BwdRank* br;    // [R]
  const CUtensorMap* tm;
  unsigned* ctr;        // == base.counters
  int nt1, nt2;         // stage-1 tiles (128 ffn cols) and stage-2 tiles (256 hidden cols) per row block
  int t1, tickets_per_mb;
  int defer_home;       // 1: router grad and grad_x are left to the wgrad kernel (home_reduce.cuh)
  int x_kept;           // 1: xl holds the forward's kept expert input rows: pull grad_out only
  int act_kept;         // 1: act holds the forward's kept SwiGLU output (saved-h path): no act rows here
};

// Tensor maps (this launch's partitions p = part(q) = q - rank0; one launch of every rank: p = q):
// per local expert g = p * L + e: 4g+0 gate [F,H], 4g+1 up [F,H], 4g+2 W2 (see tm_w2), 4g+3 W1 (MN-major);
// per partition p: 4*np*L + 5p + 0 xl [cap,H], +1 gyl [cap,H], +2 dh [cap,2F], +3 saved h [cap,2F] (or unset),
// +4 dh in [64 x 64] boxes (TMA stores).
// FP8 dgrad (kFp8, saved h only): 4g+2 = W2^T e4m3 [F, H], 4g+3 = W1^T e4m3 [H, 2F] (K-major, [128 B x 256
// row] boxes; 8-bit WGMMA operands must be K-major), +1 = gyl8 [cap, H], +2 = dh8 [cap, 2F] ([128 B x 128
// row] boxes); their block scales: base.wscale[2g] (W2^T, [F/128, H/128]), base.wscale[2g+1] (W1^T,
// [H/128, 2F/128]).
__device__ __forceinline__ int bwd_expert(const BwdParams& P, int q, int e) { return part(P.base, q) * P.base.L + e; }
__device__ __forceinline__ const CUtensorMap* tm_gate(const BwdParams& P, int g) { return P.tm + 4 * g + 0; }
__device__ __forceinline__ const CUtensorMap* tm_up(const BwdParams& P, int g) { return P.tm + 4 * g + 1; }
// 4g+2: recompute: W2^T [F, H] K-major, 128-row boxes; saved h: W2 [H, F] as stored, MN-major [64 x 64] boxes
__device__ __forceinline__ const CUtensorMap* tm_w2(const BwdParams& P, int g) { return P.tm + 4 * g + 2; }
// 4g+3: W1 [2F, H] as stored, MN-major [64 x 64] boxes (B operand of dX = dH @ W1)
__device__ __forceinline__ const CUtensorMap* tm_w1mn(const BwdParams& P, int g) { return P.tm + 4 * g + 3; }
__device__ __forceinline__ const CUtensorMap* tm_rank(const BwdParams& P, int q) {
  return P.tm + 4 * P.base.nparts * P.base.L + 5 * part(P.base, q);
}
__device__ __forceinline__ const CUtensorMap* tm_xl(const BwdParams& P, int q) { return tm_rank(P, q); }
__device__ __forceinline__ const CUtensorMap* tm_gyl(const BwdParams& P, int q) { return tm_rank(P, q) + 1; }
__device__ __forceinline__ const CUtensorMap* tm_dh(const BwdParams& P, int q) { return tm_rank(P, q) + 2; }
__device__ __forceinline__ const CUtensorMap* tm_h(const BwdParams& P, int q) { return tm_rank(P, q) + 3; }
// dh [cap, 2F] in [64 cols x 64 rows] boxes: TMA stores of one warpgroup's rows (saved-h stage-1 epilogue)
__device__ __forceinline__ const CUtensorMap* tm_dh64(const BwdParams& P, int q) { return tm_rank(P, q) + 4; }

// Counters (zeroed per launch), per partition p of this launch (np = nparts):
// [0] grid barrier (schedule.cuh / timeout.cuh use counters[0]), [1] compute done, [2, 2+np) tickets,
// [2+np, 2+2np) grad_x token cursor, then ready[np][mb_cap], mb_done[np][mb_cap], s1_done[np][mb_cap][mt_max].
__host__ __device__ inline long long bwd_ctr_count(int np, int mb_cap, int mt_max) {
  return 2 + 2LL * np + 2LL * np * mb_cap + (long long)np * mb_cap * mt_max;
}
__device__ __forceinline__ unsigned* c_compute_done(const BwdParams& P) { return P.ctr + 1; }
__device__ __forceinline__ unsigned* c_ticket(const BwdParams& P, int q) { return P.ctr + 2 + part(P.base, q); }
// next home token of rank q to reduce into grad_x (dynamic: SMs that arrive late take less)
__device__ __forceinline__ unsigned* c_gradx_next(const BwdParams& P, int q) {
  return P.ctr + 2 + P.base.nparts + part(P.base, q);
}
__device__ __forceinline__ long long c_base(const BwdParams& P) { return 2 + 2LL * P.base.nparts; }
// +1 per pulling CTA once its share of minibatch mb (x rows + scaled grad_out rows) is written
__device__ __forceinline__ unsigned* c_ready(const BwdParams& P, int q, int mb) {
  return P.ctr + c_base(P) + (long long)part(P.base, q) * P.base.mb_cap + mb;
}

// Minibatch 0 is pulled by every CTA of the owner (comm and compute): until it is in place no compute SM
// has work (a 6144-row Kimi minibatch took the comm SMs alone ~0.5 ms), so its ready counter counts
// ctas_per_rank CTAs, not comm_sms (bwd_ready_target).
__device__ __forceinline__ unsigned bwd_ready_target(const BwdParams& P, int mb) {
  return (unsigned)(mb == 0 ? P.base.ctas_per_rank : P.base.comm_sms);
}
// +1 per finished stage-2 (dX) tile of minibatch mb (its reverse-dispatch pushes are written)
__device__ __forceinline__ unsigned* c_mb_done(const BwdParams& P, int q, int mb) {
  return P.ctr + c_base(P) + (long long)P.base.nparts * P.base.mb_cap + (long long)part(P.base, q) * P.base.mb_cap + mb;
}
// +1 per finished stage-1 (dH) tile of row block mt of minibatch mb
__device__ __forceinline__ unsigned* c_s1_done(const BwdParams& P, int q, int mb, int mt) {
  return P.ctr + c_base(P) + 2LL * P.base.nparts * P.base.mb_cap +
         ((long long)part(P.base, q) * P.base.mb_cap + mb) * P.base.mt_max + mt;
}
// Rank q's per-partition schedule output.
__device__ __forceinline__ const int* bwd_expert_off(const BwdParams& P, int q) {
  return P.base.expert_off + part(P.base, q) * (P.base.L + 1);
}
__device__ __forceinline__ const int2* bwd_layout(const BwdParams& P, int q) {
  return P.base.layout + (long long)part(P.base, q) * P.base.layout_cap;
}

// sigmoid without the IEEE division: `1.0f / x` has an out-of-line slow path, and a call next to the
// 128 live accumulators makes ptxas spill kilobytes (MUFU.RCP based, ~2 ulp; outputs are bf16).
__device__ __forceinline__ float sigmoid_fast(float g) { return __fdividef(1.0f, 1.0f + __expf(-g)); }

// ---- fragment helpers (own copies; the forward's live in push_combine.cuh) ----
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
// Lane l of a quad holds word w_j = columns (8j + 2l, 8j + 2l + 1) of 4 consecutive 8-col chunks j;
// afterwards lane l holds the 8 columns of chunk l (one 16-byte store).
__device__ __forceinline__ uint4 quad_xpose(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3, int lane) {
  const int l = lane & 3, base = lane & ~3;
  uint32_t o[4] = {0, 0, 0, 0};
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int sc = (l - r) & 3;
    const uint32_t send = sc == 0 ? w0 : sc == 1 ? w1 : sc == 2 ? w2 : w3;
    const int src = (l + r) & 3;
    const uint32_t recv = __shfl_sync(0xffffffffu, send, base | src);
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] = src == i ? recv : o[i];
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

}  // namespace bwd
}  // namespace mok
