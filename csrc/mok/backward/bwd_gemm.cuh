// Backward dgrad on the compute SMs of owner rank q: persistent, warp-specialized WGMMA pipeline
// (same structure as the forward's expert_ffn.cuh: 1 TMA producer thread + 2 consumer warpgroups,
// 128-row tiles, BK = 64, kStages-deep smem ring with full/empty mbarriers).
//
// Tickets per minibatch (handed out in order by a per-rank atomic counter):
//   stage 1, (mt, nt) over mt_max x nt1 (needs the minibatch's pulled rows):
//     recompute (bwd_consumer), nt = 128 ffn columns:
//       K loop G (K = H): [128x256] = x_rows @ [W1_gate rows ; W1_up rows]^T   (recompute h = [g | u])
//       -> act[row, c] = bf16(silu(g)*u) stored; c1 = u*dsilu(g), c2 = silu(g) parked (bf16) in dh
//       K loop D (K = H): [128x128] = gy_rows @ W2^T rows (dA = gy @ W2), accumulator reused
//       -> dh[row, c] = bf16(dA*c1), dh[row, F+c] = bf16(dA*c2)
//     saved h (bwd_consumer_saved), nt = 256 ffn columns: one K loop (K = H) dA = gy_rows @ W2 (n256),
//       then the tile's g / u through the smem ring -> dh as above (act: comm SMs)
//     -> s1_done[q][mb][mt] += 1
//   stage 2, (mt, nt) over mt_max x nt2, nt = 256 hidden columns, needs s1_done == nt1:
//     K loop (K = 2F): acc[128x256] = dh_rows @ W1 (dX = dH @ W1)
//     epilogue = push reverse-dispatch: bf16 rows to home rank's grad_buf[t, k, :]
//     -> mb_done[q][mb] += 1 (frees the slot for minibatch mb + S)
// B operands: gate/up rows of W1 K-major as stored; W1 (stage 2) and, with saved h, W2 (stage 1)
// MN-major as stored; only the recompute path's loop D reads a transposed copy W2^T made by the wrapper.
//
// FP8 dgrad (template kFp8, saved h only; kernel.dtype fp8): the same tiles and tickets, both GEMM stages
// in e4m3 with block scales through the forward's rescaling K loop (fp8_kloop.cuh, 128-element K steps):
//   stage 1: A = gyl8 (gy quantised 1 x 128 in the pull), B = W2^T e4m3 [F, H] (K-major: 8-bit WGMMA
//            has no MN-major operands; the 128 x 128 quantisation of W2^T is the transpose of W2's)
//   stage 2: A = dh8 (the stage-1 epilogue quantises the bf16 dH per 1 x 128 block beside storing it),
//            B = W1^T e4m3 [H, 2F]
// The SwiGLU backward, dH (bf16, for wgrad) and the dX push are as in bf16.
#pragma once
#include "backward/bwd_common.cuh"
#include "comm/deferred_release.cuh"
#include "gemm/bf16_kloop.cuh"
#include "gemm/fp8_kloop.cuh"
#include "quant/fp8_quant.cuh"
#include "gemm/swiglu.cuh"

namespace mok {
namespace bwd {

struct BTile {
  int kind;  // 0 exit, 1 stage 1 (dH), 2 stage 2 (dX)
  int mb, slot, mt, nt, expert, row0, rows;
};

struct BSmem {
  uint8_t* stages;
  uint64_t* full;
  uint64_t* empty;
  uint64_t* info_full;
  uint64_t* info_empty;
  BTile* info;
  int* off;
};

__host__ __device__ constexpr int bwd_compute_smem_bytes() {
  return kStages * kStageBytes + (2 * kStages + 4) * 8 + 2 * (int)sizeof(BTile) + (MOK_MAX_LOCAL_EXPERTS + 1) * 4 +
         64;
}

__device__ __forceinline__ BSmem bwd_carve(uint8_t* smem) {
  BSmem s;
  s.stages = smem;
  s.full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  s.empty = s.full + kStages;
  s.info_full = s.empty + kStages;
  s.info_empty = s.info_full + 2;
  s.info = reinterpret_cast<BTile*>(s.info_empty + 2);
  s.off = reinterpret_cast<int*>(s.info + 2);
  return s;
}

// ------------------------------------------------------------------------------------------------
template <bool kFp8>
__device__ void bwd_producer(const BwdParams& P, int q, const BSmem& sm) {
  const Params& B = P.base;
  const int L = B.L, M = B.minibatch, S = B.ring_slots;
  const int N = sm.off[L];
  const int nmb = num_minibatches(N, M);
  const unsigned total = (unsigned)nmb * (unsigned)P.tickets_per_mb;
  int st = 0;
  uint32_t ph = 0;
  int ii = 0;
  uint32_t iph = 0;
  while (true) {
    BTile ti;
    ti.kind = 0;
    while (true) {
      const unsigned tk = atomicAdd(c_ticket(P, q), 1u);
      if (tk >= total) break;
      const int mb = (int)(tk / (unsigned)P.tickets_per_mb);
      int u = (int)(tk % (unsigned)P.tickets_per_mb);
      const int kind = u < P.t1 ? 1 : 2;
      if (kind == 2) u -= P.t1;
      const int ntc = kind == 1 ? P.nt1 : P.nt2;
      const int mt = u / ntc, nt = u % ntc;
      const int a = mb * M, b = min(a + M, N);
      const int s = mb % S;
      int e = 0, row0 = 0, rows = 0;
      if (!find_mtile(sm.off, L, a, b, mt, e, row0, rows)) continue;  // empty ticket
      bool ok;
      if (kind == 1)
        ok = wait_counter_geq(B, c_ready(P, q, mb), bwd_ready_target(P, mb), q, s, kPhaseDispatchReady);
      else
        ok = wait_counter_geq(B, c_s1_done(P, q, mb, mt), (unsigned)P.nt1, q, s, kPhaseFc1Done,
                              2);  // secondary: a stalled pull is reported by its own waiters first
      if (!ok) break;  // abort: publish exit
      fence_proxy_async_global();
      ti.kind = kind; ti.mb = mb; ti.slot = s; ti.mt = mt; ti.nt = nt;
      ti.expert = e; ti.row0 = row0; ti.rows = rows;
      break;
    }
    mbar_wait(B, &sm.info_empty[ii], iph ^ 1u, q, 1);
    sm.info[ii] = ti;
    Barrier::arrive(&sm.info_full[ii]);
    if (++ii == 2) { ii = 0; iph ^= 1u; }
    if (ti.kind == 0) return;

    const int g = bwd_expert(P, q, ti.expert);
    if (ti.kind == 1 && (kFp8 || P.br[q].saved_h != nullptr)) {
      // saved h: dA loop (A = gy rows, B = 256 rows of W2^T), then the tile's g / u columns: per 128-col
      // half one stage of g and one of u (two [128 x 64] boxes each; bwd_consumer_saved reads them)
      if constexpr (kFp8) {  // A = gyl8 [128 rows x 128 B], B = W2^T e4m3 rows [nt*256, +256) x 128 B
        const int nk = B.H / kBKf8;
        for (int kb = 0; kb < nk; ++kb) {
          mbar_wait(B, &sm.empty[st], ph ^ 1u, q, 2);
          uint8_t* a_s = sm.stages + st * kStageBytes;
          Barrier::arrive_and_expect_tx(&sm.full[st], (uint32_t)kStageBytes);
          tma_load_2d(tm_gyl(P, q), &sm.full[st], a_s, kb * kBKf8, ti.row0);
          tma_load_2d(tm_w2(P, g), &sm.full[st], a_s + kATileBytes, kb * kBKf8, ti.nt * 256);
          if (++st == kStages) { st = 0; ph ^= 1u; }
        }
      } else {
        const int nk = ceil_div(B.H, kBK);
        for (int kb = 0; kb < nk; ++kb) {
          mbar_wait(B, &sm.empty[st], ph ^ 1u, q, 2);
          uint8_t* a_s = sm.stages + st * kStageBytes;
          Barrier::arrive_and_expect_tx(&sm.full[st], (uint32_t)kStageBytes);
          tma_load_2d(tm_gyl(P, q), &sm.full[st], a_s, kb * kBK, ti.row0);
          for (int b = 0; b < 4; ++b)  // W2 rows h = K, columns f = N: four [64 f x 64 h] MN-major boxes
            tma_load_2d(tm_w2(P, g), &sm.full[st], a_s + kATileBytes + b * (kBK * 64 * 2), ti.nt * 256 + 64 * b,
                        kb * kBK);
          if (++st == kStages) { st = 0; ph ^= 1u; }
        }
      }
      for (int hf = 0; hf < 2; ++hf) {
        for (int part_u = 0; part_u < 2; ++part_u) {  // 0: g columns, 1: u columns (F further right)
          mbar_wait(B, &sm.empty[st], ph ^ 1u, q, 2);
          uint8_t* s_s = sm.stages + st * kStageBytes;
          const int c0 = part_u * B.F + ti.nt * 256 + hf * 128;
          Barrier::arrive_and_expect_tx(&sm.full[st], (uint32_t)(2 * kATileBytes));
          tma_load_2d(tm_h(P, q), &sm.full[st], s_s, c0, ti.row0);
          tma_load_2d(tm_h(P, q), &sm.full[st], s_s + kATileBytes, c0 + kBK, ti.row0);
          if (++st == kStages) { st = 0; ph ^= 1u; }
        }
      }
    } else if (ti.kind == 1) {
      const int nk = ceil_div(B.H, kBK);
      for (int phase = 0; phase < 2; ++phase) {  // 0: h operands (x, gate/up), 1: dA operands (gy, W2^T)
        for (int kb = 0; kb < nk; ++kb) {
          mbar_wait(B, &sm.empty[st], ph ^ 1u, q, 2);
          uint8_t* a_s = sm.stages + st * kStageBytes;
          uint8_t* b_s = a_s + kATileBytes;
          if (phase == 0) {
            Barrier::arrive_and_expect_tx(&sm.full[st], (uint32_t)kStageBytes);
            tma_load_2d(tm_xl(P, q), &sm.full[st], a_s, kb * kBK, ti.row0);
            tma_load_2d(tm_gate(P, g), &sm.full[st], b_s, kb * kBK, ti.nt * 128);
            tma_load_2d(tm_up(P, g), &sm.full[st], b_s + kBTileBytes / 2, kb * kBK, ti.nt * 128);
          } else {
            Barrier::arrive_and_expect_tx(&sm.full[st], (uint32_t)(kATileBytes + kBTileBytes / 2));
            tma_load_2d(tm_gyl(P, q), &sm.full[st], a_s, kb * kBK, ti.row0);
            tma_load_2d(tm_w2(P, g), &sm.full[st], b_s, kb * kBK, ti.nt * 128);  // W2^T, K-major
          }
          if (++st == kStages) { st = 0; ph ^= 1u; }
        }
      }
    } else if constexpr (kFp8) {  // stage 2: A = dh8 [128 rows x 128 B], B = W1^T e4m3 rows [nt*256, +256)
      const int nk = 2 * B.F / kBKf8;
      for (int kb = 0; kb < nk; ++kb) {
        mbar_wait(B, &sm.empty[st], ph ^ 1u, q, 2);
        uint8_t* a_s = sm.stages + st * kStageBytes;
        Barrier::arrive_and_expect_tx(&sm.full[st], (uint32_t)kStageBytes);
        tma_load_2d(tm_dh(P, q), &sm.full[st], a_s, kb * kBKf8, ti.row0);
        tma_load_2d(tm_w1mn(P, g), &sm.full[st], a_s + kATileBytes, kb * kBKf8, ti.nt * kBN);
        if (++st == kStages) { st = 0; ph ^= 1u; }
      }
    } else {
      const int nk = ceil_div(2 * B.F, kBK);
      for (int kb = 0; kb < nk; ++kb) {
        mbar_wait(B, &sm.empty[st], ph ^ 1u, q, 2);
        uint8_t* a_s = sm.stages + st * kStageBytes;
        uint8_t* b_s = a_s + kATileBytes;
        Barrier::arrive_and_expect_tx(&sm.full[st], (uint32_t)kStageBytes);
        tma_load_2d(tm_dh(P, q), &sm.full[st], a_s, kb * kBK, ti.row0);
        for (int b = 0; b < 4; ++b)  // W1 rows j = K, columns h = N: four [64 h x 64 j] MN-major boxes
          tma_load_2d(tm_w1mn(P, g), &sm.full[st], b_s + b * (kBK * 64 * 2), ti.nt * kBN + 64 * b, kb * kBK);
        if (++st == kStages) { st = 0; ph ^= 1u; }
      }
    }
  }
}

// Stage-2 epilogue: the tile's dX rows (bf16) pushed to their home ranks' grad_buf[t, k, :] (peer
// stores in real EP), then +1 on mb_done (frees the ring slot once every tile of the minibatch is done),
// held in rel (thread 128).
__device__ __forceinline__ void push_dx_tile(const BwdParams& P, int q, const BTile& ti, const float* acc, int r_lo,
                                             int lane, DeferredRelease& rel) {
  const int H = P.base.H;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r_lo + 8 * h;
    __nv_bfloat16* dst = nullptr;
    if (r < ti.rows) {
      const int2 src = bwd_layout(P, q)[ti.row0 + r];
      dst = P.br[src.x].grad_buf + (long long)src.y * H;
    }
#pragma unroll
    for (int j0 = 0; j0 < 32; j0 += 4) {
      const uint4 v = quad_xpose(pack2(acc[4 * j0 + 2 * h], acc[4 * j0 + 2 * h + 1]),
                                 pack2(acc[4 * (j0 + 1) + 2 * h], acc[4 * (j0 + 1) + 2 * h + 1]),
                                 pack2(acc[4 * (j0 + 2) + 2 * h], acc[4 * (j0 + 2) + 2 * h + 1]),
                                 pack2(acc[4 * (j0 + 3) + 2 * h], acc[4 * (j0 + 3) + 2 * h + 1]), lane);
      const int c = ti.nt * kBN + 8 * (j0 + (lane & 3));
      if (dst != nullptr && c < H) *reinterpret_cast<uint4*>(dst + c) = v;
    }
  }
  named_bar_sync(1, 256);
  if (threadIdx.x == 128) rel.hold(c_mb_done(P, q, ti.mb));
}

// Byte offset of element (row r, col c) of a [128 rows x 64 cols] bf16 TMA box with 128-byte swizzle:
// row r at r * 128, its 16-byte chunk (c / 8) XOR-ed with r % 8.
__device__ __forceinline__ int sw128_offset(int r, int c) { return r * 128 + ((((c >> 3) ^ (r & 7))) << 4) + ((c & 7) << 1); }

// The consumers' side of the producer's two-entry tile-info ring: wait for the next tile, read it into `ti`, free its
// entry (after this warpgroup's threads have read it); false at the producer's end mark (kind 0). Thread 128
// releases its deferred counters before a wait and flushes them at the end.
struct TileQueue {
  int ii = 0;
  uint32_t iph = 0;

  __device__ __forceinline__ bool next(const Params& B, const BSmem& sm, int q, int wgc, int lt, DeferredRelease& rel,
                                       BTile& ti) {
    if (threadIdx.x == 128) rel.before_wait(&sm.info_full[ii], iph);
    mbar_wait(B, &sm.info_full[ii], iph, q, 3);
    ti = sm.info[ii];
    named_bar_sync(2 + wgc, 128);
    if (lt == 0) Barrier::arrive(&sm.info_empty[ii]);
    if (++ii == 2) { ii = 0; iph ^= 1u; }
    if (ti.kind == 0) {
      if (threadIdx.x == 128) rel.flush();
      return false;
    }
    return true;
  }
};

// ------------------------------------------------------------------------------------------------
// Recompute variant (no saved h): stage 1 = loop G (fc1 recompute) + loop D (dA, n128), see above.
// The end of a stage-1 tile (both consumers): its dh rows, stored generically or by TMA, fenced for the TMA
// loads of the stage-2 tiles that read them (maybe on other SMs), then counted.
__device__ __forceinline__ void finish_stage1(const BwdParams& P, int q, const BTile& ti, bool rec,
                                              unsigned long long t_epi) {
  fence_proxy_async_global();
  named_bar_sync(1, 256);
  if (threadIdx.x == 128) {
    __threadfence();
    red_release_gpu_add(c_s1_done(P, q, ti.mb, ti.mt), 1u);
  }
  if (rec) timeline_record(P.base, kTlBwdStage1Epi, (unsigned)ti.mb, t_epi, globaltimer_ns());
}

// A stage-2 tile's epilogue (both consumers): its dX rows pushed to their home ranks.
__device__ __forceinline__ void stage2_push(const BwdParams& P, int q, const BTile& ti, float* acc, int r_lo, int lane,
                                            DeferredRelease& rel, bool rec, unsigned long long t_tile) {
  const unsigned long long t_push = rec ? globaltimer_ns() : 0ull;
  if (rec) timeline_record(P.base, kTlBwdStage2, (unsigned)ti.mb, t_tile, t_push);
  push_dx_tile(P, q, ti, acc, r_lo, lane, rel);
  if (rec) timeline_record(P.base, kTlBwdPush, (unsigned)ti.mb, t_push, globaltimer_ns());
}

template <bool kGlu>
__device__ void bwd_consumer(const BwdParams& P, int q, const BSmem& sm, int wgc) {
  const Params& B = P.base;
  const int lt = threadIdx.x & 127;
  const int warp_in_wg = lt >> 5, lane = lt & 31;
  const int H = B.H, F = B.F;
  float acc[128];
  int st = 0;
  uint32_t ph = 0;
  TileQueue tiles;
  DeferredRelease rel;  // thread 128 only
  while (true) {
    BTile ti;
    if (!tiles.next(B, sm, q, wgc, lt, rel, ti)) break;
    const bool rec = B.timeline != nullptr && lt == 0 && wgc == 0;  // one recorder per tile
    const unsigned long long t_tile = rec ? globaltimer_ns() : 0ull;

    // Stage 1: loop G (K = H): acc = x @ [gate ; up]^T (n256) = h; epilogue 1 in registers: act stored,
    //          c1 = u * dsilu(g), c2 = silu(g) parked as bf16 in dh (own words); then loop D (K = H):
    //          acc[0..63] = gy @ W2^T rows (n128) = dA; epilogue 2: dh = [dA * c1 | dA * c2].
    // Stage 2: loop G only (K = 2F): acc = dh @ W1^T rows (n256); epilogue = push.
    // Straight loops with data-dependent trip counts (no branch around the wgmma instructions).
    const int nkG = ti.kind == 1 ? ceil_div(H, kBK) : 0;
    const int nkX = ti.kind == 2 ? ceil_div(2 * F, kBK) : 0;
    const int nkD = ti.kind == 1 ? ceil_div(H, kBK) : 0;
    const int r_lo = wgc * 64 + warp_in_wg * 16 + (lane >> 2);
    int prev = 0;
    auto flush_held = [&](int kb) {
      if (kb == 0 && threadIdx.x == 128) rel.flush();  // the previous tile's release, MMAs in flight
    };
    bf16_kloop<256>(B, q, sm, wgc, nkG, acc, st, ph, prev, flush_held);
    // loop X (stage 2, K = 2F): B = W1 as stored (MN-major)
    bf16_kloop<256, true>(B, q, sm, wgc, nkX, acc, st, ph, prev, flush_held);
    cute::warpgroup_wait<0>();  // unconditional (no-op without loop G / X): keeps the compiler's wgmma tracking simple
    fence_acc(acc);
    if (nkG + nkX > 0 && lt == 0) Barrier::arrive(&sm.empty[prev]);

    if (ti.kind == 1) {
      __nv_bfloat16* const dhp = P.br[q].dh;
      __nv_bfloat16* const actp = P.br[q].act;
      // acc cols 8j + 2(lane%4) + {0,1}: j < 16 gate col nt*128 + 8j.., j >= 16 up col nt*128 + 8(j-16)..
      // c1 / c2 are parked in this thread's own (row, col pair) words of dh (4-byte stores, fragment order)
      // and read back by the same thread after loop D: keeping them in registers across loop D spills.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r_lo + 8 * h;
        const long long row = (long long)ti.row0 + r;
#pragma unroll
        for (int j0 = 0; j0 < 16; j0 += 4) {
          uint32_t wa[4];
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            const int j = j0 + jj;
            float v1[2], v2[2], av[2];
#pragma unroll
            for (int p = 0; p < 2; ++p) {
              const float g = acc[4 * j + 2 * h + p];
              const float u = acc[4 * (j + 16) + 2 * h + p];
              if constexpr (kGlu) {  // clamp / offset (swiglu.cuh), on h rounded to bf16 as the saved-h path
                glu_terms(B, bf16_round(g), bf16_round(u), [](float x) { return sigmoid_fast(x); }, v1[p], v2[p],
                          av[p]);
              } else {
                const float sig = sigmoid_fast(g);
                const float silu = g * sig;
                v1[p] = u * (sig * (1.0f + g * (1.0f - sig)));
                v2[p] = silu;
                av[p] = silu * u;
              }
            }
            const int cf = ti.nt * 128 + 8 * j + 2 * (lane & 3);
            if (r < ti.rows && cf < F) {
              *reinterpret_cast<uint32_t*>(dhp + row * 2 * F + cf) = pack2(v1[0], v1[1]);
              *reinterpret_cast<uint32_t*>(dhp + row * 2 * F + F + cf) = pack2(v2[0], v2[1]);
            }
            wa[jj] = pack2(av[0], av[1]);
          }
          const uint4 va = quad_xpose(wa[0], wa[1], wa[2], wa[3], lane);
          const int c = ti.nt * 128 + 8 * (j0 + (lane & 3));
          if (r < ti.rows && c < F) *reinterpret_cast<uint4*>(actp + row * F + c) = va;
        }
      }
      bf16_kloop<128>(B, q, sm, wgc, nkD, acc, st, ph, prev);
      cute::warpgroup_wait<0>();
      fence_acc64(acc);
      if (lt == 0) Barrier::arrive(&sm.empty[prev]);
      const unsigned long long t_epi = rec ? globaltimer_ns() : 0ull;
      if (rec) timeline_record(B, kTlBwdStage1, (unsigned)ti.mb, t_tile, t_epi);
      // acc[0..63] = dA, cols 8j + 2(lane%4) + {0,1} (j < 16) = col nt*128 + 8j..
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r_lo + 8 * h;
        const long long row = (long long)ti.row0 + r;
#pragma unroll
        for (int j0 = 0; j0 < 16; j0 += 4) {
          uint32_t wg[4], wu[4];
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            const int j = j0 + jj;
            const int cf = ti.nt * 128 + 8 * j + 2 * (lane & 3);
            // f1 = c1 = u * dsilu(g), f2 = c2 = silu(g): parked in epilogue 1
            uint32_t w1v = 0u, w2v = 0u;
            if (r < ti.rows && cf < F) {
              w1v = *reinterpret_cast<const uint32_t*>(dhp + row * 2 * F + cf);
              w2v = *reinterpret_cast<const uint32_t*>(dhp + row * 2 * F + F + cf);
            }
            const float2 f1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w1v));
            const float2 f2 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w2v));
            const float d0 = acc[4 * j + 2 * h], d1 = acc[4 * j + 2 * h + 1];
            wg[jj] = pack2(d0 * f1.x, d1 * f1.y);
            wu[jj] = pack2(d0 * f2.x, d1 * f2.y);
          }
          const uint4 vg = quad_xpose(wg[0], wg[1], wg[2], wg[3], lane);
          const uint4 vu = quad_xpose(wu[0], wu[1], wu[2], wu[3], lane);
          const int c = ti.nt * 128 + 8 * (j0 + (lane & 3));
          if (r < ti.rows && c < F) {
            *reinterpret_cast<uint4*>(dhp + row * 2 * F + c) = vg;
            *reinterpret_cast<uint4*>(dhp + row * 2 * F + F + c) = vu;
          }
        }
      }
      finish_stage1(P, q, ti, rec, t_epi);  // dh is read next by TMA (stage-2 tiles, maybe other SMs)
    } else {
      stage2_push(P, q, ti, acc, r_lo, lane, rel, rec, t_tile);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Saved-h variant: the forward kept h = [g | u], so stage 1 has no recompute and its tile is as wide as
// stage 2's: loop (K = H): acc[128 x 256] = gy_rows @ W2[:, nt*256 : +256] (dA, n256 atom: half
// the operand bytes per FLOP of the 128-column tile, whose loop was L2-bound). Its g / u columns come
// through the same smem ring right after the loop (the producer's 4 h stages: per 128-column half, one
// stage of g and one of u, two [128 x 64] boxes each), so the epilogue reads them from smem instead of
// waiting on global loads:
//   c1 = bf16(u * dsilu(g)), c2 = bf16(silu(g)); dh = [bf16(dA * c1) | bf16(dA * c2)],
// written back over g / u in the same smem words and TMA-stored per warpgroup (no per-thread global
// stores; the epilogue went from 35 to 23 us per tile on the H200). act is written by the comm SMs
// (bwd_act_rows). Both GEMM loops read B (W2, W1) MN-major, as stored.
template <bool kFp8, bool kGlu>
__device__ void bwd_consumer_saved(const BwdParams& P, int q, const BSmem& sm, int wgc) {
  const Params& B = P.base;
  const int lt = threadIdx.x & 127;
  const int warp_in_wg = lt >> 5, lane = lt & 31;
  const int H = B.H, F = B.F;
  float acc[128];
  int st = 0;
  uint32_t ph = 0;
  TileQueue tiles;
  DeferredRelease rel;  // thread 128 only
  while (true) {
    BTile ti;
    if (!tiles.next(B, sm, q, wgc, lt, rel, ti)) break;
    const bool rec = B.timeline != nullptr && lt == 0 && wgc == 0;  // one recorder per tile
    const unsigned long long t_tile = rec ? globaltimer_ns() : 0ull;

    const int r_lo = wgc * 64 + warp_in_wg * 16 + (lane >> 2);
    if constexpr (kFp8) {
      const int nk = ti.kind == 1 ? H / kBKf8 : 2 * F / kBKf8;  // = scale blocks per A row
      const float* sa = ti.kind == 1 ? P.br[q].gys : P.br[q].dhs;
      const float* sa0 = r_lo < ti.rows ? sa + ((long long)ti.row0 + r_lo) * nk : nullptr;
      const float* sa1 = r_lo + 8 < ti.rows ? sa + ((long long)ti.row0 + r_lo + 8) * nk : nullptr;
      const float* ws = B.wscale[2 * bwd_expert(P, q, ti.expert) + (ti.kind == 1 ? 0 : 1)];
      const int nb = (ti.kind == 1 ? F : H) / kScaleBlock;  // 128-row blocks of B (W2^T / W1^T)
      const float* sb0 = ws + (long long)(2 * ti.nt) * nk;
      const float* sb1 = 2 * ti.nt + 1 < nb ? ws + (long long)(2 * ti.nt + 1) * nk : nullptr;
      ffn_kloop_fp8(B, q, sm, wgc, nk, sa0, sa1, 1, sb0, sb1, acc, st, ph, [&](int kb) {
        if (kb == 0 && threadIdx.x == 128) rel.flush();  // the previous tile's release, MMAs in flight
      });
    } else {
    const int nk = ti.kind == 1 ? ceil_div(H, kBK) : ceil_div(2 * F, kBK);
    int prev = 0;
    for (int kb = 0; kb < nk; ++kb) {
      mbar_wait(B, &sm.full[st], ph, q, 4);
      const uint8_t* a_s = sm.stages + st * kStageBytes + wgc * (64 * kBK * 2);
      const uint8_t* b_s = sm.stages + st * kStageBytes + kATileBytes;
      const uint64_t da = make_smem_desc_sw128(a_s);
      const uint64_t db = make_smem_desc_sw128_mn(b_s);  // W2 (stage 1) / W1 (stage 2) as stored
      fence_acc(acc);
      cute::warpgroup_arrive();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk)
        wgmma_64x256x16_bmn(da + (uint64_t)(2 * kk), db + kMnDescK16Step * kk, acc, (kb > 0) || (kk > 0));
      cute::warpgroup_commit_batch();
      if (kb == 0 && threadIdx.x == 128) rel.flush();  // the previous tile's release, MMAs in flight
      cute::warpgroup_wait<1>();
      fence_acc(acc);
      if (kb > 0 && lt == 0) Barrier::arrive(&sm.empty[prev]);
      prev = st;
      if (++st == kStages) { st = 0; ph ^= 1u; }
    }
    cute::warpgroup_wait<0>();
    fence_acc(acc);
    if (lt == 0) Barrier::arrive(&sm.empty[prev]);
    }

    if (ti.kind == 1) {
      const unsigned long long t_epi = rec ? globaltimer_ns() : 0ull;
      if (rec) timeline_record(B, kTlBwdStage1, (unsigned)ti.mb, t_tile, t_epi);
      // acc cols 8J + 2(lane%4) + {0,1}, J < 32 = tile col; half hf holds J in [16hf, 16hf + 16).
      // dgate / dup overwrite g / u in place in the smem stages (same thread, same words), then go out
      // with TMA stores of this warpgroup's [64 rows x 64 cols] sub-boxes (no per-thread global stores);
      // a warpgroup whose 64 rows run past the tile (last tile of an expert) copies its valid rows instead.
      const int wg_rows = min(max(ti.rows - wgc * 64, 0), 64);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int sg = st;
        const uint32_t pg = ph;
        if (++st == kStages) { st = 0; ph ^= 1u; }
        const int su = st;
        const uint32_t pu = ph;
        if (++st == kStages) { st = 0; ph ^= 1u; }
        mbar_wait(B, &sm.full[sg], pg, q, 4);
        mbar_wait(B, &sm.full[su], pu, q, 4);
        uint8_t* gsm = sm.stages + sg * kStageBytes;
        uint8_t* usm = sm.stages + su * kStageBytes;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = r_lo + 8 * h;
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const int cc = 8 * j + 2 * (lane & 3);  // col within the half (0..127)
            const int off = (cc >> 6) * (kBM * kBK * 2) + sw128_offset(r, cc & 63);
            const uint32_t gv = *reinterpret_cast<const uint32_t*>(gsm + off);
            const uint32_t uv = *reinterpret_cast<const uint32_t*>(usm + off);
            const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&gv));
            const float2 u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&uv));
            // c1 / c2 rounded to bf16 as in the recompute path (parked there)
            uint32_t p1, p2;
            if constexpr (kGlu) {  // clamp / offset (swiglu.cuh)
              float c1[2], c2[2], a[2];
              glu_terms(B, g.x, u.x, [](float x) { return sigmoid_fast(x); }, c1[0], c2[0], a[0]);
              glu_terms(B, g.y, u.y, [](float x) { return sigmoid_fast(x); }, c1[1], c2[1], a[1]);
              p1 = pack2(c1[0], c1[1]);
              p2 = pack2(c2[0], c2[1]);
            } else {
              const float sx = sigmoid_fast(g.x), sy = sigmoid_fast(g.y);
              p1 = pack2(u.x * (sx * (1.0f + g.x * (1.0f - sx))), u.y * (sy * (1.0f + g.y * (1.0f - sy))));
              p2 = pack2(g.x * sx, g.y * sy);
            }
            const float2 f1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&p1));
            const float2 f2 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&p2));
            const int J = 16 * hf + j;
            const float d0 = acc[4 * J + 2 * h], d1 = acc[4 * J + 2 * h + 1];
            *reinterpret_cast<uint32_t*>(gsm + off) = pack2(d0 * f1.x, d1 * f1.y);
            *reinterpret_cast<uint32_t*>(usm + off) = pack2(d0 * f2.x, d1 * f2.y);
          }
        }
        const int c_half = ti.nt * 256 + 128 * hf;  // first dh column of this half
        if constexpr (kFp8) {
          // the half's 128 dgate / dup columns of a row are one 1 x 128 block each (F % 128 == 0): read
          // back this thread's own bf16 words (what wgrad sees) and store them as e4m3 + scale (dh8 / dhs)
          if (c_half < F) {  // warp-uniform
            // one (row, g/u) block at a time, not unrolled: the 128 accumulators of this half are still live
#pragma unroll 1
            for (int i = 0; i < 4; ++i) {
              const int h = i & 1, part_u = i >> 1;
              const int r = r_lo + 8 * h;
              const uint8_t* src = part_u ? usm : gsm;
              float v[32];
#pragma unroll
              for (int j = 0; j < 16; ++j) {
                const int cc = 8 * j + 2 * (lane & 3);
                const int off = (cc >> 6) * (kBM * kBK * 2) + sw128_offset(r, cc & 63);
                const uint32_t w = *reinterpret_cast<const uint32_t*>(src + off);
                const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
                v[2 * j] = f.x;
                v[2 * j + 1] = f.y;
              }
              const long long row = (long long)ti.row0 + r;
              const int c = part_u * F + c_half;  // first dh column of the block
              uint8_t* dst = r < ti.rows ? P.br[q].dh8 + row * 2 * F + c : nullptr;
              quantize_store_row128(dst, P.br[q].dhs + row * (2 * F / kScaleBlock) + c / kScaleBlock, v, lane);
            }
          }
        }
        if (wg_rows == 64) {
          fence_view_async_shared();       // this thread's smem writes -> visible to the TMA store
          named_bar_sync(2 + wgc, 128);
          if (lt == 0) {
            for (int b = 0; b < 2; ++b) {
              const int c = c_half + 64 * b;
              if (c >= F) break;  // F % 64 == 0: a box is all inside or all outside [0, F)
              const int so = b * (kBM * kBK * 2) + wgc * (64 * 128);
              tma_store_2d(tm_dh64(P, q), gsm + so, c, ti.row0 + wgc * 64);
              tma_store_2d(tm_dh64(P, q), usm + so, F + c, ti.row0 + wgc * 64);
            }
            tma_store_commit();
            tma_store_wait_read0();  // the stages may be refilled once the stores have read them
            Barrier::arrive(&sm.empty[sg]);
            Barrier::arrive(&sm.empty[su]);
          }
        } else {
          named_bar_sync(2 + wgc, 128);
          __nv_bfloat16* const dhp = P.br[q].dh;
          for (int i = lt; i < wg_rows * 16; i += 128) {  // (row, box, 16-byte chunk)
            const int rr = i >> 4, b = (i >> 3) & 1, ch = i & 7;
            const int r = wgc * 64 + rr;
            const int c = c_half + 64 * b + 8 * ch;
            if (c < F) {
              const int so = b * (kBM * kBK * 2) + r * 128 + ((ch ^ (r & 7)) << 4);
              const long long row = (long long)ti.row0 + r;
              *reinterpret_cast<uint4*>(dhp + row * 2 * F + c) = *reinterpret_cast<const uint4*>(gsm + so);
              *reinterpret_cast<uint4*>(dhp + row * 2 * F + F + c) = *reinterpret_cast<const uint4*>(usm + so);
            }
          }
          named_bar_sync(2 + wgc, 128);
          if (lt == 0) {
            Barrier::arrive(&sm.empty[sg]);
            Barrier::arrive(&sm.empty[su]);
          }
        }
      }
      // dh must be globally visible before s1_done: TMA stores complete, generic stores fenced; both
      // are read next by TMA (stage-2 tiles, maybe other SMs)
      if (wg_rows == 64 && lt == 0) tma_store_wait_all();
      finish_stage1(P, q, ti, rec, t_epi);
    } else {
      stage2_push(P, q, ti, acc, r_lo, lane, rel, rec, t_tile);
    }
  }
}

// Returns true for the consumer threads (they go on to the grad_x reduce).
template <bool kFp8, bool kGlu>
__device__ bool bwd_compute_role(const BwdParams& P, int q, uint8_t* smem) {
  const BSmem sm = bwd_carve(smem);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&sm.full[s], 1);
      Barrier::init(&sm.empty[s], 2);
    }
    for (int i = 0; i < 2; ++i) {
      Barrier::init(&sm.info_full[i], 1);
      Barrier::init(&sm.info_empty[i], 2);
    }
    cutlass::arch::fence_barrier_init();
  }
  for (int e = threadIdx.x; e <= P.base.L; e += blockDim.x) sm.off[e] = bwd_expert_off(P, q)[e];
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<56>();
    if (threadIdx.x == 0) bwd_producer<kFp8>(P, q, sm);
    return false;
  } else {
    setmaxnreg_inc<224>();
    if constexpr (kFp8)  // the host launches the FP8 variant only with saved h
      bwd_consumer_saved<true, kGlu>(P, q, sm, wg - 1);
    else if (P.br[q].saved_h != nullptr)
      bwd_consumer_saved<false, kGlu>(P, q, sm, wg - 1);
    else
      bwd_consumer<kGlu>(P, q, sm, wg - 1);
    named_bar_sync(1, 256);
    if (threadIdx.x == 128) {
      __threadfence();
      // per-rank launch: the last compute CTA of this rank tells every peer its pushes have landed
      const unsigned n_comp = (unsigned)(P.base.ctas_per_rank - P.base.comm_sms);
      if (atom_add_acq_rel_gpu(c_compute_done(P), 1u) == n_comp - 1 && P.base.peer_sync) signal_done(P.base, q);
    }
    return true;
  }
}

}  // namespace bwd
}  // namespace mok
