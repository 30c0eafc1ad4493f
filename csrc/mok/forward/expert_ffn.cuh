// Expert FFN on the compute SMs of rank q: a persistent, warp-specialized WGMMA pipeline.
//
//   WG0 (1 thread)  producer: takes work tickets in order (ring_buffer.cuh), waits for the
//                   tile's dependency (slot ready / fc1 row block done), publishes a TileInfo to
//                   the consumers (2-deep smem ring, mbarriers), then streams the K loop with TMA
//                   into a kStages-deep smem ring (full/empty mbarriers with transaction bytes).
//   WG1, WG2        consumers: 64 rows each of a 128x256 tile; per 64-wide K block four
//                   wgmma.m64n256k16 (bf16 -> fp32), one group kept in flight.
//     fc1 tile  : B = [128 gate rows ; 128 up rows] of W1_e for activation cols [nt*128, nt*128+128)
//                 -> epilogue a = bf16(silu(g) * u) in fp32 (gate col j and up col j sit in the same
//                 thread's registers), stored to the slot's activation buffer.
//     fc2 tile  : A = activations of the row block, B = W2_e rows [nt*256, +256)
//                 -> epilogue = push combine: bf16 rows written straight to combine_buf[r][t,k,:]
//                 of the home rank (a peer store in real EP).
//
// FP8 variant (template kFp8, kernel.dtype fp8): the same tiles, stages and tickets; operands are e4m3
// (128 per SW128 row = one scale block per K step), one group of four WGMMA m64n256k32 per K block and
// warpgroup, drained and promoted to the next block's scales before the next group (ffn_kloop_fp8;
// fp8_quant.cuh: rescale_half; the other warpgroup's group keeps the tensor cores busy meanwhile), and the
// fc1 epilogue quantises the SwiGLU output per 1 x 128
// block (one tile = one block per row) for fc2.
#pragma once
#include "common.cuh"
#include "comm/deferred_release.cuh"
#include "gemm/bf16_kloop.cuh"
#include "gemm/fp8_kloop.cuh"
#include "quant/fp8_quant.cuh"
#include "gemm/gemm_sm90.cuh"
#include "comm/push_combine.cuh"
#include "comm/peer_sync.cuh"
#include "comm/pull_dispatch.cuh"
#include "comm/ring_buffer.cuh"
#include "gemm/swiglu.cuh"
#include "timeline.cuh"
#include "comm/timeout.cuh"

namespace mok {

struct ComputeSmem {
  uint8_t* stages;
  uint64_t* full;
  uint64_t* empty;
  uint64_t* info_full;
  uint64_t* info_empty;
  TileInfo* info;
  int* off;        // [L + 1] the owner's expert offsets (expert_offsets)
  int* pull_flag;  // in-SM pull warps' shared verdict (insm_pull_role)
};

__host__ __device__ constexpr int compute_smem_bytes() {
  return kStages * kStageBytes + (2 * kStages + 4) * 8 + 2 * (int)sizeof(TileInfo) +
         (MOK_MAX_LOCAL_EXPERTS + 1) * 4 + 64;  // ..., pull flag
}

__device__ __forceinline__ ComputeSmem carve_smem(uint8_t* smem) {
  ComputeSmem s;
  s.stages = smem;
  s.full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  s.empty = s.full + kStages;
  s.info_full = s.empty + kStages;
  s.info_empty = s.info_full + 2;
  s.info = reinterpret_cast<TileInfo*>(s.info_empty + 2);
  s.off = reinterpret_cast<int*>(s.info + 2);
  s.pull_flag = s.off + MOK_MAX_LOCAL_EXPERTS + 1;  // inside compute_smem_bytes' 64 spare bytes
  return s;
}


// __fdividef, not "/": an IEEE division has a subroutine slow path, and any CALL in the consumer region
// makes ptxas drop the setmaxnreg budget (224) back to the launch bound (168 registers, spills).
__device__ __forceinline__ float silu_f(float g) { return __fdividef(g, 1.0f + __expf(-g)); }
// The weight maps of a kind-1 (fc1) or kind-2 (fc2) tile of expert g, fetched while the tile waits for its
// dependency and for a free stage.
__device__ __forceinline__ void prefetch_tile_maps(const Params& P, int g, int kind) {
  if (kind == 1) {
    tma_prefetch_desc(tmap_gate(P, g));
    tma_prefetch_desc(tmap_up(P, g));
  } else if (kind == 2) {
    tma_prefetch_desc(tmap_w2(P, g));
  }
}

// The dependency of a kind-1 (fc1) tile of minibatch mb -- its rows pulled -- or of a kind-2 (fc2) tile of row
// block mt -- that row block's fc1 tiles done. False on an abort (error recorded by the waiter).
__device__ __forceinline__ bool wait_tile_inputs(const Params& P, int q, int kind, int mb, int mt) {
  const int s = mb % P.ring_slots;
  if (kind == 1)  // from the second round on a slot's dispatch waits for its previous combine: a stall
                  // upstream is reported by that round's own waiters first (secondary, slack 2)
    return wait_counter_geq(P, ctr_ready(P, q, mb), ready_target(P, mb), q, s, kPhaseDispatchReady,
                            mb >= P.ring_slots ? 2 : 1);
  return wait_counter_geq(P, ctr_fc1_done(P, q, mb, mt), (unsigned)(kConsumerWGs * P.nt1), q, s, kPhaseFc1Done,
                          2);  // secondary: a stalled dispatch is reported by its own waiters first
}

// The producer hands tile ti to its consumers (2-deep tile-info ring).
__device__ __forceinline__ void publish_tile(const Params& P, int q, const ComputeSmem& sm, const TileInfo& ti, int& ii,
                                             uint32_t& iph) {
  mbar_wait(P, &sm.info_empty[ii], iph ^ 1u, q, 1);
  sm.info[ii] = ti;
  Barrier::arrive(&sm.info_full[ii]);
  if (++ii == 2) { ii = 0; iph ^= 1u; }
}

// The K loop's TMA loads of tile ti into the stage ring.
template <bool kFp8>
__device__ __forceinline__ void stream_tile(const Params& P, int q, const ComputeSmem& sm, const TileInfo& ti, int& st,
                                            uint32_t& ph) {
  const int g = q * P.L + ti.expert;
  // A rows in the partition's ring / act tensor maps ([S * slot_rows] rows per partition)
  const int arow = (int)(slot_row(P, q, ti.mb, ti.mb_start, ti.row0, ti.lrow0) -
                         (long long)part(P, q) * P.ring_slots * P.slot_rows);
  constexpr int bk = kFp8 ? kBKf8 : kBK;  // elements per K step (128 B either way)
  const CUtensorMap* amap = ti.kind == 1 ? tmap_ring(P, q) : tmap_act(P, q);
  for (int kb = 0; kb < ti.nk; ++kb) {
    mbar_wait(P, &sm.empty[st], ph ^ 1u, q, 2);
    uint8_t* a_s = sm.stages + st * kStageBytes;
    uint8_t* b_s = a_s + kATileBytes;
    Barrier::arrive_and_expect_tx(&sm.full[st], (uint32_t)kStageBytes);
    tma_load_2d(amap, &sm.full[st], a_s, kb * bk, arow);
    if (ti.kind == 1) {
      tma_load_2d(tmap_gate(P, g), &sm.full[st], b_s, kb * bk, ti.nt * kFc1ActCols);
      tma_load_2d(tmap_up(P, g), &sm.full[st], b_s + kBTileBytes / 2, kb * bk, ti.nt * kFc1ActCols);
    } else {
      tma_load_2d(tmap_w2(P, g), &sm.full[st], b_s, kb * bk, ti.nt * kBN);
    }
    if (++st == kStages) { st = 0; ph ^= 1u; }
  }
}

// ------------------------------------------------------------------------------------------------
template <bool kFp8>
__device__ void ffn_producer(const Params& P, int q, const ComputeSmem& sm) {
  const int L = P.L, M = P.minibatch, S = P.ring_slots;
  const int N = sm.off[L];
  const int nmb = num_minibatches(N, M);
  // Dense tickets: minibatch mb owns cnt(mb) * (nt1 + nt2) consecutive tickets, cnt = its row blocks
  // (count_mtiles), not a worst-case mt_max: every ticket is a tile, none is drawn only to be skipped (an
  // atomic round trip each; ~30 of 48 row-block slots per minibatch of the DeepSeek-V3 slice were empty).
  // The tickets one producer draws only grow, so it walks a cursor over the minibatches.
  const unsigned per_mt = (unsigned)(P.nt1 + P.nt2);
  int cur_mb = 0, cur_a = 0, cur_b = mb_begin(sm.off, L, M, 1);
  int cur_cnt = count_mtiles(sm.off, L, cur_a, cur_b);
  unsigned cur_base = 0;
  int st = 0;
  uint32_t ph = 0;
  int ii = 0;
  uint32_t iph = 0;
  while (true) {
    TileInfo ti;
    ti.kind = 0;
    while (true) {
      const unsigned tk = atomicAdd(ctr_ticket(P, q), 1u);
      while (cur_mb < nmb && tk >= cur_base + (unsigned)cur_cnt * per_mt) {
        cur_base += (unsigned)cur_cnt * per_mt;
        ++cur_mb;
        cur_a = cur_b;
        cur_b = mb_begin(sm.off, L, M, cur_mb + 1);
        cur_cnt = count_mtiles(sm.off, L, cur_a, cur_b);
      }
      if (cur_mb >= nmb) break;  // every tile handed out
      const int mb = cur_mb, cnt = cur_cnt;
      int u = (int)(tk - cur_base);
      const int t1 = cnt * P.nt1;
      const int kind = u < t1 ? 1 : 2;
      if (kind == 2) u -= t1;
      const int ntc = kind == 1 ? P.nt1 : P.nt2;
      int mt, nt;
      if (P.raster == 0) {         // row-block major
        mt = u / ntc; nt = u % ntc;
      } else if (P.raster == 1) {  // n-tile major
        mt = u % cnt; nt = u / cnt;
      } else {                     // bands of `raster` row blocks, n-tile major inside a band (L2 reuse)
        const int GM = P.raster;
        const int b = u / (GM * ntc), idx = u % (GM * ntc);
        const int gm = min(GM, cnt - b * GM);
        mt = b * GM + idx % gm; nt = idx / gm;
      }
      const int a = cur_a, b = cur_b;
      const int s = mb % S, j = mb / S;
      int e = 0, row0 = 0, rows = 0;
      if (!find_mtile(sm.off, L, a, b, mt, e, row0, rows)) {  // cannot happen: mt < cnt by construction
        record_error(P, kErrInternal, q, s, kPhasePipeline, cnt, mt, 5);
        break;
      }
      prefetch_tile_maps(P, q * L + e, kind);
      if (!wait_tile_inputs(P, q, kind, mb, mt)) break;  // abort: publish exit
      fence_proxy_async_global();
      ti.kind = kind; ti.mb = mb; ti.slot = s; ti.round = j; ti.mt = mt; ti.nt = nt;
      ti.expert = e; ti.row0 = row0; ti.rows = rows; ti.mb_start = a; ti.lrow0 = row0;
      ti.nk = kind == 1 ? ceil_div(P.H, kFp8 ? kBKf8 : kBK) : ceil_div(P.F, kFp8 ? kBKf8 : kBK);
      break;
    }
    publish_tile(P, q, sm, ti, ii, iph);
    if (ti.kind == 0) return;
    stream_tile<kFp8>(P, q, sm, ti, st, ph);
  }
}

// A consumer warpgroup with no rows in its half of a tile: take each stage and
// give it back at once (the stage is freed when both warpgroups arrived on its empty barrier). Only the
// warpgroup's thread 0 waits and releases; the other threads just move their ring position on. (Each warp
// waiting by itself, a warp that fell a whole stage turnover behind -- released by thread 0, refilled, landed
// -- would wait on the wrong phase for ever: no MMA keeps the warps of a skipping warpgroup together. Found by
// a model check of the pipeline.)
__device__ __forceinline__ void skip_kloop(const Params& P, int q, const ComputeSmem& sm, int nk, int& st,
                                           uint32_t& ph) {
  const bool lead = (threadIdx.x & 127) == 0;
  for (int kb = 0; kb < nk; ++kb) {
    if (lead) {
      mbar_wait(P, &sm.full[st], ph, q, 4);
      release_stage(sm, st);
    }
    if (++st == kStages) { st = 0; ph ^= 1u; }
  }
  __syncwarp();  // lanes 1-31 of thread 0's warp meet it again before any aligned barrier or full-mask shuffle
}

// wgc = consumer warpgroup index (0/1): rows [wgc*64, wgc*64+64) of the tile.
template <bool kFp8, int kFeat>
__device__ void ffn_consumer(const Params& P, int q, const ComputeSmem& sm, int wgc) {
  const int lt = threadIdx.x & 127;
  const int warp_in_wg = lt >> 5, lane = lt & 31;
  const int H = P.H, F = P.F;
  float acc[128];
  int st = 0;
  uint32_t ph = 0;
  int ii = 0;
  uint32_t iph = 0;
  DeferredRelease rel;         // thread 0 of the warpgroup: its last fc2 tile's mb_done (deferred_release.cuh)
  DeferredActRelease act_rel;  // the whole warpgroup: its last fc1 tile's fc1_done
  const int wg_bar = 2 + wgc;  // this warpgroup's named barrier
  // The two warpgroups signal their own rows (fc1_done, mb_done count kConsumerWGs per tile) and meet
  // only on the producer's rings (the stage ring and the 2-deep tile-info ring), so one may run a few K
  // blocks ahead: while one stores its epilogue the other keeps the tensor cores busy.
  while (true) {
    if (lt == 0) rel.before_wait(&sm.info_full[ii], iph);
    act_rel.before_wait(&sm.info_full[ii], iph, wg_bar, lt);
    mbar_wait(P, &sm.info_full[ii], iph, q, 3);
    const TileInfo ti = sm.info[ii];
    named_bar_sync(2 + wgc, 128);  // everyone in this WG has read the info slot
    if (lt == 0) Barrier::arrive(&sm.info_empty[ii]);
    if (++ii == 2) { ii = 0; iph ^= 1u; }
    if (ti.kind == 0) {
      if (lt == 0) rel.flush();
      act_rel.flush(wg_bar, lt);
      break;
    }
    const unsigned long long t_tile = globaltimer_ns();

    const int r_lo = wgc * 64 + warp_in_wg * 16 + (lane >> 2);
    // slot row of the tile's row 0: A operand and scales (fc1: ring, fc2: act), fc1 epilogue's act rows
    const long long srow = slot_row(P, q, ti.mb, ti.mb_start, ti.row0, ti.lrow0);
    // fc2 push destinations of this thread's two rows: the layout entries are loaded now and resolved to
    // the home rank's combine row once the first MMAs are in flight (resolve_push); left to the epilogue,
    // these two dependent global loads opened every fc2 epilogue with a ~1 us stall.
    int2 src_row[2] = {make_int2(-1, 0), make_int2(-1, 0)};
    __nv_bfloat16* push_dst[2] = {nullptr, nullptr};
    if (ti.kind == 2 && !MOK_DBG(2)) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (r_lo + 8 * h < ti.rows) src_row[h] = P.layout[(long long)part(P, q) * P.layout_cap + ti.lrow0 + r_lo + 8 * h];
    }
    auto resolve_push = [&] {
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (src_row[h].x >= 0) push_dst[h] = P.ranks[src_row[h].x].combine + (long long)src_row[h].y * H;
    };
    if (wgc == 1 && ti.rows <= 64) {
      // An expert's last row block with all its rows in the first warpgroup's 64: this warpgroup only
      // passes the stages on, and the first runs the tile's MMAs alone -- one warpgroup's m64n256 WGMMAs
      // use all four tensor cores of the SM, so the tile takes about half as long. The FP8 warpgroup goes
      // straight on to the next tile: falling through to the epilogue, which joins this path's accumulator
      // registers with the K loop's, made ptxas serialise every wgmma of the FP8 kernel (C7515).
      const int nk = ti.kind == 1 ? ceil_div(H, kFp8 ? kBKf8 : kBK) : ceil_div(F, kFp8 ? kBKf8 : kBK);
      // the previous tile's held releases first: this warpgroup issues no MMAs to hide their fences behind,
      // and a consumer that held them through the skipped K loop would delay whoever waits on them
      if (lt == 0) rel.flush();
      act_rel.flush(wg_bar, lt);
      skip_kloop(P, q, sm, nk, st, ph);  // acc keeps the last tile's values: the epilogue stores none of them
      resolve_push();                    // (no rows of this warpgroup: nothing to resolve)
      if constexpr (kFp8) {  // no epilogue, only the tile's count (its rows are the other warpgroup's)
        if (ti.kind == 1)
          act_rel.hold(ctr_fc1_done(P, q, ti.mb, ti.mt), wg_bar, lt);
        else if (lt == 0)
          rel.hold(ctr_mb_done(P, q, ti.mb));
        continue;
      }
    } else if constexpr (kFp8) {
      const int nk = ti.kind == 1 ? H / kBKf8 : F / kBKf8;
      const float* sa = ti.kind == 1 ? P.ring_scale : P.act_scale;
      const float* sa0 = r_lo < ti.rows ? sa + fp8_scale_at(P, srow + r_lo, 0, nk) : nullptr;
      const float* sa1 = r_lo + 8 < ti.rows ? sa + fp8_scale_at(P, srow + r_lo + 8, 0, nk) : nullptr;
      const float* ws = P.wscale[2 * (q * P.L + ti.expert - P.rank0 * P.L) + (ti.kind == 1 ? 0 : 1)];
      const float *sb0, *sb1;
      if (ti.kind == 1) {  // B = [128 gate rows of block nt ; 128 up rows of block F/128 + nt]
        sb0 = ws + (long long)ti.nt * nk;
        sb1 = ws + (long long)(F / kScaleBlock + ti.nt) * nk;
      } else {  // B = W2 rows [nt*256, +256): row blocks 2nt, 2nt+1 (the second may lie past H)
        sb0 = ws + (long long)(2 * ti.nt) * nk;
        sb1 = 2 * ti.nt + 1 < H / kScaleBlock ? ws + (long long)(2 * ti.nt + 1) * nk : nullptr;
      }
      ffn_kloop_fp8(P, q, sm, wgc, nk, sa0, sa1, fp8_scale_step(P), sb0, sb1, acc, st, ph, [&](int kb) {
        if (kb == 0) {  // the previous fc2 / fc1 tile's release, MMAs in flight (one group at most: wait<0>)
          if (lt == 0) rel.flush();
          act_rel.flush(wg_bar, lt);
        }
        if (kb == (nk > 1 ? 1 : 0)) resolve_push();  // the layout loads landed during block 0
      });
    } else {
    const int nk = ti.kind == 1 ? ceil_div(H, kBK) : ceil_div(F, kBK);
    int prev = 0;
    bf16_kloop<256>(P, q, sm, wgc, nk, acc, st, ph, prev, [&](int kb) {
      if (kb == (nk > 1 ? 1 : 0)) {  // two groups in flight: block 0's landed the layout loads
        resolve_push();
        if (lt == 0) rel.flush();  // the previous fc2 / fc1 tile's release, the fences hidden by MMAs
        act_rel.flush(wg_bar, lt);
      }
    });
    cute::warpgroup_wait<0>();
    fence_acc(acc);
    if (lt == 0) release_stage(sm, prev);
    }
    const unsigned long long t_mma = P.timeline != nullptr ? globaltimer_ns() : 0ull;

    // ---------------- epilogue ----------------
    if (ti.kind == 1) {
      // Keep the fc1 output h = [gate | up] (bf16, layout order) for the backward when it does not
      // recompute fc1 (the user's save-vs-recompute choice); rows of this tile, columns of this n-tile.
      __nv_bfloat16* const hs = P.ranks[q].saved_h;
      if (hs != nullptr) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = r_lo + 8 * h;
          __nv_bfloat16* dst = r < ti.rows ? hs + ((long long)ti.lrow0 + r) * 2 * F : nullptr;
#pragma unroll
          for (int half = 0; half < 2; ++half) {  // 0: gate (acc j < 16), 1: up (acc j >= 16)
#pragma unroll
            for (int j0 = 0; j0 < 16; j0 += 4) {
              const int j = j0 + 16 * half;
              const uint4 v = quad_transpose(pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]),
                                             pack_bf16x2(acc[4 * (j + 1) + 2 * h], acc[4 * (j + 1) + 2 * h + 1]),
                                             pack_bf16x2(acc[4 * (j + 2) + 2 * h], acc[4 * (j + 2) + 2 * h + 1]),
                                             pack_bf16x2(acc[4 * (j + 3) + 2 * h], acc[4 * (j + 3) + 2 * h + 1]),
                                             lane);
              const int c = ti.nt * kFc1ActCols + 8 * (j0 + (lane & 3));
              if (dst != nullptr && c < F) *reinterpret_cast<uint4*>(dst + half * F + c) = v;
            }
          }
        }
      }
    if constexpr (kFp8) {
      // SwiGLU in fp32, quantised per row (the tile's 128 columns are one 1 x 128 block) for fc2
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r_lo + 8 * h;
#pragma unroll
        for (int j = 0; j < 16; ++j) {  // in place over the gate values (saved h was stored above)
#pragma unroll
          for (int p = 0; p < 2; ++p) {
            float g = acc[4 * j + 2 * h + p], u = acc[4 * (j + 16) + 2 * h + p];
            if (feat_glu<kFeat>(P)) glu_inputs(P, g, u);
            acc[4 * j + 2 * h + p] = silu_f(g) * u;
          }
        }
        const bool ok = r < ti.rows && !MOK_DBG(4);
        uint8_t* dst = ok ? reinterpret_cast<uint8_t*>(P.act) + (srow + r) * F + ti.nt * kFc1ActCols : nullptr;
        store_act_row_e4m3(dst, P.act_scale + fp8_scale_at(P, srow + r, ti.nt, F / kScaleBlock), acc, h, lane);
      }
    } else {
      __nv_bfloat16* act = P.act + srow * F;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r_lo + 8 * h;
        __nv_bfloat16* dst = r < ti.rows ? act + (long long)r * F : nullptr;
#pragma unroll
        for (int j0 = 0; j0 < 16; j0 += 4) {
          uint32_t wv[4];
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            const int j = j0 + jj;
            float a[2];
#pragma unroll
            for (int p = 0; p < 2; ++p) {
              float g = acc[4 * j + 2 * h + p], u = acc[4 * (j + 16) + 2 * h + p];
              if (feat_glu<kFeat>(P)) glu_inputs(P, g, u);
              a[p] = silu_f(g) * u;
            }
            wv[jj] = pack_bf16x2(a[0], a[1]);
          }
          const uint4 v = quad_transpose(wv[0], wv[1], wv[2], wv[3], lane);
          const int c = ti.nt * kFc1ActCols + 8 * (j0 + (lane & 3));
          if (dst != nullptr && c < F && !MOK_DBG(4)) *reinterpret_cast<uint4*>(dst + c) = v;
        }
      }
    }
      // activations are read next by TMA (fc2 tiles, maybe other SMs): fenced and released once the next
      // tile's MMAs run (DeferredActRelease)
      act_rel.hold(ctr_fc1_done(P, q, ti.mb, ti.mt), wg_bar, lt);
      if (threadIdx.x == 128) timeline_record(P, kTlFc1, (unsigned)ti.mb, t_tile, globaltimer_ns(), t_mma);
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h)  // push: the home rank's combine buffer rows
        store_row_frag256(push_dst[h], ti.nt * kBN, H, acc, h, lane);
      named_bar_sync(wg_bar, 128);  // this warpgroup's rows are stored
      if (lt == 0) rel.hold(ctr_mb_done(P, q, ti.mb));
      if (threadIdx.x == 128) timeline_record(P, kTlFc2, (unsigned)ti.mb, t_tile, globaltimer_ns(), t_mma);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Returns true if this CTA's consumer threads should go on to the final combine reduce.
template <bool kFp8, int kFeat>
__device__ bool compute_role(const Params& P, int q, uint8_t* smem) {
  const ComputeSmem sm = carve_smem(smem);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&sm.full[s], 1);
      Barrier::init(&sm.empty[s], kConsumerWGs);
    }
    for (int i = 0; i < 2; ++i) {
      Barrier::init(&sm.info_full[i], 1);
      Barrier::init(&sm.info_empty[i], 2);
    }
    cutlass::arch::fence_barrier_init();
  }
  {  // the expert offsets
    const int* eo = expert_offsets(P, q);
    for (int e = threadIdx.x; e <= P.L; e += blockDim.x) sm.off[e] = eo[e];
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<56>();
    if (threadIdx.x == 0) {  // warp 0, lane 0: the producer
      ffn_producer<kFp8>(P, q, sm);
    } else if (threadIdx.x >= 32) {  // warps 1-3: the in-SM pull (comm_sms == 0)
      if (P.comm_sms == 0) insm_pull_role<kFp8>(P, q, sm.pull_flag);
    }
    return false;
  } else {
    setmaxnreg_inc<224>();
    ffn_consumer<kFp8, kFeat>(P, q, sm, wg - 1);
    named_bar_sync(1, 256);
    if (threadIdx.x == 128) {
      if (!P.peer_sync) {
        __threadfence();
        red_release_gpu_add(ctr_compute_done(P), 1u);
      } else {
        // pushes went to peers' memory: make them visible system-wide, then the last compute CTA of
        // this rank tells every home rank that this rank's outputs have landed (peer_sync.cuh: signal_done)
        __threadfence_system();
        const unsigned n_comp = (unsigned)(P.nparts * (P.ctas_per_rank - P.comm_sms));
        if (atom_add_acq_rel_gpu(ctr_compute_done(P), 1u) == n_comp - 1) signal_done(P, q);
      }
    }
    return true;
  }
}

}  // namespace mok
