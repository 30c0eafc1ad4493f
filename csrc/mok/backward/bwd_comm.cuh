// Backward comm role (comm SMs of owner rank q) and the home-side reductions.
//
// pull reverse-combine (x_kept: the forward kept xl, only grad_out is pulled): minibatch by minibatch (same minibatch/slot protocol as the forward: minibatch i
//   may start once minibatch i-S has finished its reverse-dispatch pushes), each layout row (r, t, k)
//   pulls x[r][t] and grad_out[r][t] from home rank r and writes, in layout order,
//     xl[row]  = x[r][t]                          (bf16 copy; fc1 recompute + dW1 operand)
//     gyl[row] = bf16(w[r][t,k] * grad_out[r][t])  (fp32 math; fc2 dgrad + dW2 operand)
//     FP8 dgrad (kFp8): also gyl8[row] / gys[row] = gyl[row] as e4m3 with 1 x 128 block scales
//   then publishes ready[q][i] (+1 per pulling CTA, release: the comm CTAs, and for minibatch 0 every
//   CTA of the owner, bwd_ready_target).
// Background work, one share after each minibatch's pull (the pulls leave the comm SMs idle most of the
//   time, and doing it after the last pull would leave a tail on them):
//   router-weight grad grad_w[t,k] = <grad_out[t], combine[t,k]> (fp32) of rank q's own tokens (unless
//   the wgrad kernel does it: defer_home), and, when
//   the forward kept h, act[row] = bf16(silu(g) * u) of minibatch i's rows (only the wgrad reads it).
// grad_x (home): once every compute CTA of every rank is done, grad_x[t] = bf16(sum_k grad_buf[t,k])
//   in fp32, k ascending, slots with idx == -1 skipped; tokens handed out by an atomic cursor.
#pragma once
#include "backward/bwd_common.cuh"
#include "backward/home_reduce.cuh"
#include "quant/fp8_quant.cuh"
#include "gemm/swiglu.cuh"

namespace mok {
namespace bwd {

// One warp: xd = xs (bf16 copy; not with kX = false: the forward kept xl) and gd = bf16(w * gs); kFp8 also writes gd's values (as rounded to
// bf16) as e4m3 with one scale per 1 x 128 block into gq / gqs (H % 128 == 0), the A operand of the FP8
// dgrad's stage 1. Iteration u covers 32 lanes x 8 values = two scale blocks (fp8_quant.cuh). Returns true (on
// every lane) if gs holds a NaN or an Inf (x was checked by the forward's pull).
template <bool kFp8, bool kX>
__device__ __forceinline__ bool pull_rows_pair(__nv_bfloat16* __restrict__ xd, __nv_bfloat16* __restrict__ gd,
                                               uint8_t* __restrict__ gq, float* __restrict__ gqs,
                                               const __nv_bfloat16* __restrict__ xs,
                                               const __nv_bfloat16* __restrict__ gs, float w, int H, int lane) {
  const uint4* xs4 = reinterpret_cast<const uint4*>(xs);
  const uint4* gs4 = reinterpret_cast<const uint4*>(gs);
  uint4* xd4 = reinterpret_cast<uint4*>(xd);
  uint4* gd4 = reinterpret_cast<uint4*>(gd);
  const int nv = H / 8;
  constexpr int U = 8;
  uint32_t bad = 0;
  for (int base = 0; base < nv; base += 32 * U) {
    uint4 bx[U], bg[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = base + u * 32 + lane;
      bx[u] = bg[u] = make_uint4(0, 0, 0, 0);
      if (v < nv) {
        if constexpr (kX) bx[u] = __ldg(xs4 + v);
        bg[u] = __ldg(gs4 + v);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u * 32 >= nv) break;  // warp-uniform
      const int v = base + u * 32 + lane;
      bad |= bf16x8_nonfinite(bg[u]);  // zeros past the row's end
      const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&bg[u]);
      uint4 o;
      uint32_t* po = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(p[i]);
        po[i] = pack2(w * f.x, w * f.y);
      }
      if (v < nv) {
        if constexpr (kX) xd4[v] = bx[u];
        gd4[v] = o;
      }
      if constexpr (kFp8) {  // quantise the bf16 gy (what wgrad reads), all lanes (shuffles)
        float scale;
        const uint2 qv = quantize_bf16x8_block16(o, &scale);
        if (v < nv) {
          reinterpret_cast<uint2*>(gq)[v] = qv;
          if ((lane & 15) == 0) gqs[v / 16] = scale;
        }
      }
    }
  }
  return __any_sync(0xffffffffu, bad != 0);
}

// Warps gw, gw + stride, ... of a CTA pull layout rows of minibatch i of owner q: x rows into xl (not when
// the forward kept them) and the scaled grad_out rows into gyl (+ e4m3 gyl8 / gys with kFp8).
template <bool kFp8>
__device__ __forceinline__ void bwd_pull_rows(const BwdParams& P, int q, int i, int gw, int stride) {
  const Params& B = P.base;
  const int M = B.minibatch, H = B.H, K = B.K, lane = threadIdx.x & 31;
  const int N = bwd_expert_off(P, q)[B.L];
  const int2* layout = bwd_layout(P, q);
  const BwdRank& me = P.br[q];
  const int a = i * M, b = min(a + M, N);
  for (int row = a + gw; row < b; row += stride) {
    const int2 src = layout[row];
    const int t = src.y / K;
    const float w = B.ranks[src.x].w[src.y];
    uint8_t* const gq = kFp8 ? me.gyl8 + (long long)row * H : nullptr;
    float* const gqs = kFp8 ? me.gys + (long long)row * (H / kScaleBlock) : nullptr;
    const __nv_bfloat16* const gs = P.br[src.x].grad_out + (long long)t * H;
    const bool bad = P.x_kept  // warp-uniform
                         ? pull_rows_pair<kFp8, false>(nullptr, me.gyl + (long long)row * H, gq, gqs, nullptr, gs, w, H, lane)
                         : pull_rows_pair<kFp8, true>(me.xl + (long long)row * H, me.gyl + (long long)row * H, gq, gqs,
                                                      B.ranks[src.x].x + (long long)t * H, gs, w, H, lane);
    if (bad) report_nonfinite_row(B, kPhaseGradOutCheck, src.x, t, q, lane);
  }
}

// A compute CTA's share of minibatch 0 (all its threads, before its pipeline starts; bwd_ready_target).
template <bool kFp8>
__device__ __forceinline__ void bwd_compute_pulls_first_minibatch(const BwdParams& P, int q, int local) {
  const Params& B = P.base;
  bwd_pull_rows<kFp8>(P, q, 0, local * kWarps + (threadIdx.x >> 5), B.ctas_per_rank * kWarps);
  fence_proxy_async_global();  // read next by TMA (async proxy)
  __syncthreads();
  if (threadIdx.x == 0 && !(q == B.stall_rank && 0 == B.stall_slot)) {
    __threadfence();
    red_release_gpu_add(c_ready(P, q, 0), 1u);
  }
}

// Rank q's home-side buffers as the reductions of home_reduce.cuh take them.
__device__ __forceinline__ HomeRank home_rank(const BwdParams& P, int q) {
  const RankTable& rt = P.base.ranks[q];
  const BwdRank& me = P.br[q];
  return HomeRank{me.grad_out, me.combine, me.grad_buf, rt.idx, me.grad_w, me.grad_x, rt.T};
}

// grad_w[t, k] for rank q's (token, k) entries [lo, hi); worker / nworkers = warp index / count.
__device__ void bwd_router_grad(const BwdParams& P, int q, long long lo, long long hi, int worker, int nworkers) {
  const HomeRank h = home_rank(P, q);
  for (long long e = lo + worker; e < hi; e += nworkers) router_grad_entry(h, e, P.base.K, P.base.H, threadIdx.x & 31);
}

// act[row] = bf16(silu(g) * u) (or its clamp / offset variant) from the forward's h = [g | u] for owner q's layout rows [a, b): the same
// rounding as the recompute path's epilogue (fp32 math on the bf16 h). Loads of a row are issued together.
template <bool kGlu>
__device__ void bwd_act_rows(const BwdParams& P, int q, int a, int b, int worker, int nworkers) {
  const int lane = threadIdx.x & 31;
  const int F = P.base.F;
  const __nv_bfloat16* __restrict__ h = P.br[q].saved_h;
  __nv_bfloat16* __restrict__ act = P.br[q].act;
  const int nv = F / 8;
  constexpr int U = 4;
  for (int row = a + worker; row < b; row += nworkers) {
    const uint4* g4 = reinterpret_cast<const uint4*>(h + (long long)row * 2 * F);
    const uint4* u4 = reinterpret_cast<const uint4*>(h + (long long)row * 2 * F + F);
    uint4* o4 = reinterpret_cast<uint4*>(act + (long long)row * F);
    for (int base = 0; base < nv; base += 32 * U) {
      uint4 gv[U], uv[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = base + u * 32 + lane;
        if (v < nv) {
          gv[u] = __ldg(g4 + v);
          uv[u] = __ldg(u4 + v);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = base + u * 32 + lane;
        if (v < nv) {
          const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&gv[u]);
          const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&uv[u]);
          uint32_t o[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const float2 g = __bfloat1622float2(g2[k]), x = __bfloat1622float2(u2[k]);
            if constexpr (kGlu) {  // clamp / offset (swiglu.cuh), as the recompute path
              float c1, c2, a0, a1;
              glu_terms(P.base, g.x, x.x, [](float v) { return sigmoid_fast(v); }, c1, c2, a0);
              glu_terms(P.base, g.y, x.y, [](float v) { return sigmoid_fast(v); }, c1, c2, a1);
              o[k] = pack2(a0, a1);
            } else {
              o[k] = pack2(g.x * sigmoid_fast(g.x) * x.x, g.y * sigmoid_fast(g.y) * x.y);  // as the recompute path
            }
          }
          o4[v] = make_uint4(o[0], o[1], o[2], o[3]);
        }
      }
    }
  }
}

// Comm CTA c of owner rank q: pulls, then after each minibatch one share of the background work.
// Returns false if the kernel is aborting.
template <bool kFp8, bool kGlu>
__device__ bool bwd_comm_role(const BwdParams& P, int q, int c, int* s_flag) {
  const Params& B = P.base;
  const int L = B.L, M = B.minibatch, S = B.ring_slots, K = B.K;
  const int* off = bwd_expert_off(P, q);
  const int N = off[L];
  const int nmb = num_minibatches(N, M);
  const int gw = c * kWarps + (threadIdx.x >> 5);
  const int stride = B.comm_sms * kWarps;
  const BwdRank me = P.br[q];
  const long long n_rg = (long long)B.ranks[q].T * K;  // router-grad entries of rank q's tokens
  // recompute: the stage-1 epilogue writes act; act_kept: the forward kept it
  const bool act_here = me.saved_h != nullptr && !P.act_kept;
  for (int i = 0; i < nmb; ++i) {
    const int s = i % S;
    if (i >= S) {  // the slot's previous minibatch must have finished its reverse-dispatch pushes
      if (threadIdx.x == 0) {
        const int pa = (i - S) * M;
        const unsigned need = (unsigned)(P.nt2 * count_mtiles(off, L, pa, min(pa + M, N)));
        *s_flag = wait_counter_geq(B, c_mb_done(P, q, i - S), need, q, s, kPhaseSlotFree) ? 1 : 0;
      }
      __syncthreads();
      if (!*s_flag) return false;
    }
    unsigned long long t0 = B.timeline != nullptr ? globaltimer_ns() : 0ull;
    const int a = i * M, b = min(a + M, N);
    // minibatch 0: this CTA's share among all ctas_per_rank CTAs (bwd_compute_pulls_first_minibatch)
    bwd_pull_rows<kFp8>(P, q, i, gw, i == 0 ? B.ctas_per_rank * kWarps : stride);
    fence_proxy_async_global();  // read next by TMA (async proxy)
    __syncthreads();
    if (threadIdx.x == 0 && !(q == B.stall_rank && s == B.stall_slot)) {
      __threadfence();
      red_release_gpu_add(c_ready(P, q, i), 1u);
    }
    if (threadIdx.x == 0) timeline_record(B, kTlBwdPull, (unsigned)i, t0, globaltimer_ns());
    // background share i
    if (B.timeline != nullptr) t0 = globaltimer_ns();
    if (!P.defer_home) bwd_router_grad(P, q, n_rg * i / nmb, n_rg * (i + 1) / nmb, gw, stride);
    if (act_here) bwd_act_rows<kGlu>(P, q, a, b, gw, stride);
    if (B.timeline != nullptr) {
      __syncthreads();
      if (threadIdx.x == 0) timeline_record(B, kTlBwdBackground, (unsigned)i, t0, globaltimer_ns());
    }
  }
  if (nmb == 0 && !P.defer_home) {  // this owner received no rows: the router grad still needs doing
    const unsigned long long t0 = B.timeline != nullptr ? globaltimer_ns() : 0ull;
    bwd_router_grad(P, q, 0, n_rg, gw, stride);
    if (B.timeline != nullptr) {
      __syncthreads();
      if (threadIdx.x == 0) timeline_record(B, kTlBwdBackground, 0, t0, globaltimer_ns());
    }
  }
  return true;
}

// grad_x[t] = bf16(sum_k grad_buf[t,k]) for rank q's tokens; each warp takes the next token from the
// rank's cursor (SMs that arrive late, e.g. comm SMs finishing background work, simply take fewer).
__device__ void bwd_grad_x_reduce(const BwdParams& P, int q) {
  const HomeRank h = home_rank(P, q);
  const int lane = threadIdx.x & 31;
  for (long long t; (t = next_item(c_gradx_next(P, q), lane)) < h.T;) grad_x_token<8>(h, (int)t, P.base.K, P.base.H, lane);
}

}  // namespace bwd
}  // namespace mok
