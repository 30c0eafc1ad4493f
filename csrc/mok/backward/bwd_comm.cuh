// Backward comm role (comm SMs of owner rank q) and the home-side reductions.
//
// pull reverse-combine: minibatch by minibatch (same minibatch/slot protocol as the forward: minibatch i
//   may start once minibatch i-S has finished its reverse-dispatch pushes), each layout row (r, t, k)
//   pulls x[r][t] and grad_out[r][t] from home rank r and writes, in layout order,
//     xl[row]  = x[r][t]                          (bf16 copy; fc1 recompute + dW1 operand)
//     gyl[row] = bf16(w[r][t,k] * grad_out[r][t])  (fp32 math; fc2 dgrad + dW2 operand)
//   then publishes ready[q][i] (+1 per comm CTA, release).
// router-weight grad (home, fused): after its pulls, the comm CTAs of rank q compute
//   grad_w[t,k] = <grad_out[t], combine[t,k]> (fp32) for rank q's own tokens (no dependency).
// grad_x (home): once every compute CTA of every rank is done, grad_x[t] = bf16(sum_k grad_buf[t,k])
//   in fp32, k ascending, slots with idx == -1 skipped.
#pragma once
#include "bwd_common.cuh"

namespace mok {
namespace bwd {

__device__ __forceinline__ void pull_rows_pair(__nv_bfloat16* __restrict__ xd, __nv_bfloat16* __restrict__ gd,
                                               const __nv_bfloat16* __restrict__ xs,
                                               const __nv_bfloat16* __restrict__ gs, float w, int H, int lane) {
  const uint4* xs4 = reinterpret_cast<const uint4*>(xs);
  const uint4* gs4 = reinterpret_cast<const uint4*>(gs);
  uint4* xd4 = reinterpret_cast<uint4*>(xd);
  uint4* gd4 = reinterpret_cast<uint4*>(gd);
  const int nv = H / 8;
  constexpr int U = 8;
  for (int base = 0; base < nv; base += 32 * U) {
    uint4 bx[U], bg[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = base + u * 32 + lane;
      if (v < nv) {
        bx[u] = __ldg(xs4 + v);
        bg[u] = __ldg(gs4 + v);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = base + u * 32 + lane;
      if (v < nv) {
        xd4[v] = bx[u];
        const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&bg[u]);
        uint4 o;
        uint32_t* po = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __bfloat1622float2(p[i]);
          po[i] = pack2(w * f.x, w * f.y);
        }
        gd4[v] = o;
      }
    }
  }
}

// Returns false if the kernel is aborting.
__device__ bool bwd_pull_role(const BwdParams& P, int q, int c, int* s_flag) {
  const Params& B = P.base;
  const int L = B.L, M = B.minibatch, S = B.ring_slots, H = B.H, K = B.K;
  const int* off = B.expert_off + q * (L + 1);
  const int N = off[L];
  const int nmb = num_minibatches(N, M);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gw = c * kWarps + warp;
  const int stride = B.comm_sms * kWarps;
  const int2* layout = B.layout + (long long)q * B.layout_cap;
  const BwdRank me = P.br[q];
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
    const unsigned long long t0 = B.timeline != nullptr ? globaltimer_ns() : 0ull;
    const int a = i * M, b = min(a + M, N);
    for (int row = a + gw; row < b; row += stride) {
      const int2 src = layout[row];
      const int t = src.y / K;
      const float w = B.ranks[src.x].w[src.y];
      pull_rows_pair(me.xl + (long long)row * H, me.gyl + (long long)row * H, B.ranks[src.x].x + (long long)t * H,
                     P.br[src.x].grad_out + (long long)t * H, w, H, lane);
    }
    fence_proxy_async_global();  // read next by TMA (async proxy)
    __syncthreads();
    if (threadIdx.x == 0 && !(q == B.stall_rank && s == B.stall_slot)) {
      __threadfence();
      red_release_gpu_add(c_ready(P, q, i), 1u);
    }
    if (threadIdx.x == 0) timeline_record(B, kTlBwdPull, (unsigned)i, t0, globaltimer_ns());
  }
  return true;
}

// grad_w[t, k] for rank q's tokens; worker / nworkers = warp index / count among rank q's comm warps.
__device__ void bwd_router_grad(const BwdParams& P, int q, int worker, int nworkers) {
  const Params& B = P.base;
  const int lane = threadIdx.x & 31;
  const int H = B.H, K = B.K;
  const RankTable rt = B.ranks[q];
  const BwdRank me = P.br[q];
  const long long n = (long long)rt.T * K;
  for (long long e = worker; e < n; e += nworkers) {
    const long long t = e / K;
    const uint4* go = reinterpret_cast<const uint4*>(me.grad_out + t * H);
    const uint4* cb = reinterpret_cast<const uint4*>(me.combine + e * H);
    float acc = 0.f;
    if (rt.idx[e] >= 0) {
      for (int v = lane; v < H / 8; v += 32) {
        const uint4 a = __ldg(go + v), b = __ldg(cb + v);
        const __nv_bfloat162* pa = reinterpret_cast<const __nv_bfloat162*>(&a);
        const __nv_bfloat162* pb = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 fa = __bfloat1622float2(pa[i]), fb = __bfloat1622float2(pb[i]);
          acc = fmaf(fa.x, fb.x, acc);
          acc = fmaf(fa.y, fb.y, acc);
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    }
    if (lane == 0) me.grad_w[e] = acc;
  }
}

// grad_x[t] = bf16(sum_k grad_buf[t,k]) for rank q's tokens.
__device__ void bwd_grad_x_reduce(const BwdParams& P, int q, int worker, int nworkers) {
  const Params& B = P.base;
  const int lane = threadIdx.x & 31;
  const int H = B.H, K = B.K;
  const RankTable rt = B.ranks[q];
  const BwdRank me = P.br[q];
  for (int t = worker; t < rt.T; t += nworkers) {
    const int* idx = rt.idx + (long long)t * K;
    const uint4* gb = reinterpret_cast<const uint4*>(me.grad_buf + (long long)t * K * H);
    uint4* out = reinterpret_cast<uint4*>(me.grad_x + (long long)t * H);
    for (int v = lane; v < H / 8; v += 32) {
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.f;
      for (int k0 = 0; k0 < K; k0 += 8) {
        uint4 d[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int k = k0 + u;
          d[u] = (k < K && idx[k] >= 0) ? gb[(long long)k * (H / 8) + v] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {  // k ascending; skipped slots add +0 (exact)
          const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&d[u]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(p[i]);
            acc[2 * i] += f.x;
            acc[2 * i + 1] += f.y;
          }
        }
      }
      uint4 o;
      uint32_t* po = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
      for (int i = 0; i < 4; ++i) po[i] = pack2(acc[2 * i], acc[2 * i + 1]);
      out[v] = o;
    }
  }
}

}  // namespace bwd
}  // namespace mok
